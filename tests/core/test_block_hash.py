"""The C block hash (engined/core/_block_hash.c) is vLLM's default hash, byte for byte.

vLLM 0.33 hashes a block as `sha256(pickle.dumps((parent, tuple(tokens), None), 5))`; the C
module writes those pickle bytes itself and runs its own SHA-256 (the CPU's SHA instructions,
or portable code), so both halves are held here to CPython's pickle and hashlib, at every
token size class and boundary. The module is built from its source into a temporary
directory, so the pure and the compiled passes both test it (a missing C compiler fails the
test); that the compiled core uses it, and the pure core does not, is checked against the
running core.
"""

from __future__ import annotations

import hashlib
import importlib.util
import pickle
import random
import re
import subprocess
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest

import engined.core
from engined.core import vllm_hashing
from engined.core.vllm_hashing import HashAlgo, native_chain

SOURCE = Path(engined.core.__file__).with_name("_block_hash.c")
# Each pickle size class of a token, and its edges: BININT1, BININT2, BININT, LONG1.
EDGES = (0, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1)


@pytest.fixture(scope="module")
def block_hash(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The C module, compiled as setup.py's build_ext would (this Python's compiler/flags)."""
    out = tmp_path_factory.mktemp("c") / f"_block_hash{sysconfig.get_config_var('EXT_SUFFIX')}"
    compiler = str(sysconfig.get_config_var("CC") or "cc").split()
    flags = str(sysconfig.get_config_var("CFLAGS") or "").split()
    include = sysconfig.get_paths()["include"]
    command = [*compiler, *flags, "-shared", "-fPIC", f"-I{include}", str(SOURCE), "-o", str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    spec = importlib.util.spec_from_file_location("_block_hash", out)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vllm_chain(parent: bytes, tokens: list[int], start: int, count: int, bs: int) -> list[bytes]:
    """vLLM's `hash_block_tokens(sha256, ...)` over consecutive blocks, as vLLM writes it."""
    hashes = []
    for i in range(count):
        block = tuple(tokens[start + i * bs : start + (i + 1) * bs])
        parent = hashlib.sha256(pickle.dumps((parent, block, None), protocol=5)).digest()
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("portable", [False, True])
def test_sha256_is_hashlibs_at_every_padding_length(block_hash: ModuleType, portable: bool) -> None:
    rng = random.Random(7)
    for length in (*range(0, 200), 1000, 4096, 65537):
        data = rng.randbytes(length)
        assert block_hash.sha256(data, portable) == hashlib.sha256(data).digest(), length


def test_the_sha_instructions_are_used_where_the_cpu_has_them(block_hash: ModuleType) -> None:
    """Detection decides the speed, not the result: a broken one would silently leave every
    machine on the portable code, which the equality tests above cannot see."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    assert block_hash.uses_sha_instructions() is ("sha_ni" in flags)


def test_the_chain_is_sha256_over_cpythons_pickle(block_hash: ModuleType) -> None:
    rng = random.Random(2026)
    for _ in range(400):
        bs = rng.choice((4, 5, 16, 32, 256, 1024))
        count = rng.randrange(4)
        # 9 tokens before `start`, then the blocks: edges and random tokens of every class.
        classes = (EDGES, range(256), range(2**16), range(2**31), range(2**32))
        tokens = [rng.choice(rng.choice(classes)) for _ in range(9 + count * bs)]
        parent = rng.randbytes(rng.choice((32, 0, 1, 255)))
        expected = vllm_chain(parent, tokens, 9, count, bs)
        assert block_hash.sha256_pickle_chain(parent, tokens, 9, count, bs) == expected


def test_a_block_of_random_tokens_chains_from_none_hash(block_hash: ModuleType) -> None:
    root = vllm_hashing.none_hash(HashAlgo.SHA256, None)
    tokens = random.Random(3).choices(range(150_000), k=64)
    hasher = vllm_hashing.BlockHasher(HashAlgo.SHA256, root)
    parent, expected = root, []
    for start in range(0, 64, 16):
        parent = hasher.block_hash(parent, tokens[start : start + 16])
        expected.append(parent)
    assert block_hash.sha256_pickle_chain(root, tokens, 0, 4, 16) == expected


ONES = [1] * 16


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((b"p", ONES, 0, 2, 16), ValueError, "past the end of tokens"),
        ((b"p", ONES, -1, 1, 16), ValueError, "past the end of tokens"),
        ((b"p", ONES, 0, 2**62, 16), ValueError, "past the end of tokens"),
        ((b"p", ONES, 2**62, 1, 16), ValueError, "past the end of tokens"),
        ((b"p", ONES, 0, 1, 3), ValueError, "block_size must be in [4, 1024], not 3"),
        ((b"p", [1] * 2048, 0, 1, 1025), ValueError, "block_size must be in"),
        ((b"p", tuple(ONES), 0, 1, 16), TypeError, "tokens must be a list of ints"),
        ((b"p", b"\0" * 64, 0, 1, 16), TypeError, "tokens must be a list of ints"),
        ((b"p", [*ONES[:15], "1"], 0, 1, 16), TypeError, "tokens[15] is not an int"),
        ((b"p", [*ONES[:15], True], 0, 1, 16), TypeError, "tokens[15] is not an int"),
        ((b"p", [*ONES[:15], 1.0], 0, 1, 16), TypeError, "tokens[15] is not an int"),
        ((b"p", [0, -1, *ONES[:14]], 0, 1, 16), ValueError, "tokens[1] is not a token id"),
        ((b"p", [*ONES, 2**32], 1, 1, 16), ValueError, "tokens[16] is not a token id in"),
        ((b"p", [*ONES, 2**70], 1, 1, 16), ValueError, "tokens[16] is not a token id in"),
        (("p", ONES, 0, 1, 16), TypeError, "parent must be bytes"),
        ((b"p" * 256, ONES, 0, 1, 16), TypeError, "shorter than 256"),
        ((b"p", ONES, 0, 1), TypeError, "takes 5 arguments (4 given)"),
        ((b"p", ONES, "0", 1, 16), TypeError, "an integer is required"),
        ((b"p", ONES, 0, 1.0, 16), TypeError, "an integer is required"),
        ((b"p", ONES, 0, 1, 2**70), OverflowError, "too large"),
    ],
)
def test_bad_arguments_are_typed_errors(
    block_hash: ModuleType, args: tuple[object, ...], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        block_hash.sha256_pickle_chain(*args)


def test_the_compiled_core_hashes_in_c_and_the_pure_core_in_python() -> None:
    chain = native_chain(HashAlgo.SHA256, 16)
    if engined.core.compiled():
        assert chain is not None
        assert chain.__module__ == "engined.core._block_hash"
    else:
        assert chain is vllm_hashing._sha256_pickle_chain


@pytest.mark.parametrize("block_size", [1, 3, 4, 16, 1024, 1025, 2048])
def test_the_python_chain_is_vllms_hash_too(block_size: int) -> None:
    rng = random.Random(block_size)
    tokens = [rng.choice(EDGES) for _ in range(5 + 3 * block_size)]
    parent = vllm_hashing.none_hash(HashAlgo.SHA256, None)
    expected = vllm_chain(parent, tokens, 5, 3, block_size)
    assert vllm_hashing._sha256_pickle_chain(parent, tokens, 5, 3, block_size) == expected


@pytest.mark.parametrize("block_size", [3, 1025])
def test_c_covers_4_to_1024_tokens_and_python_the_rest(block_size: int) -> None:
    assert native_chain(HashAlgo.SHA256, block_size) is vllm_hashing._sha256_pickle_chain


@pytest.mark.parametrize("algo", [HashAlgo.SHA256_CBOR, HashAlgo.XXHASH, HashAlgo.XXHASH_CBOR])
def test_the_other_algorithms_hash_block_by_block(algo: HashAlgo) -> None:
    assert native_chain(algo, 16) is None
