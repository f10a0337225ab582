"""Where a request's unplanned tokens come from: its own random stream, keyed once at intake.

A request's generated tokens depend only on the engine seed, the request and the position,
never on which pass, batch or rank drew them, so the same requests give the same tokens (and
the same KV events of their generated blocks) whatever the timing:

* with a request `seed` (vLLM's `SamplingParams.seed`; -1 means none, as in vLLM), the
  stream is keyed by that seed and the prompt: the same seed and prompt give the same tokens
  under any request id, on any engine, whatever its `--seed`; as in vLLM, another prompt
  gives other tokens;
* without one, by the engine seed and the request id: the two daemons of a P/D handoff
  (same `--seed`, same id, as Dynamo's worker sends them) produce the same sequence, so the
  decode side continues it as the prefill side would have. A daemon names an unnamed request
  by its count among the unnamed ones instead of the UUID it gets (`Request.stream_name`).

Token p is the p-th draw of the stream (rejection draws of a vocabulary included). A token
taken back when its block could not be allocated is kept for the retry (`Sequence.pop`), MTP
never draws the drafts it rejects, and a preempted request keeps its tokens and its stream, so
none of these shift later tokens. Under vLLM semantics MTP's acceptance is the request's own
too: a second stream, keyed by the first's key and `--mtp-seed` (`acceptance`), so which
drafts a step accepts depends on the request and its steps, not on the batch. The engine's
shared RNG still names the blocks of requests without prefix caching; those ids never reach a
token.

One Mersenne Twister per request, seeded here once (about 5 µs: its 624-word state), leaves
the decode path at one `getrandbits` per token, as before. It is `_random.Random`, the C base
of `random.Random`: an int seed gives both the same stream, and the base skips the
Python-level `__init__` and `seed` (half a microsecond a request).
"""

from __future__ import annotations

import sys
from _random import Random
from array import array
from collections.abc import Callable, Sequence
from hashlib import blake2b

TokenBits = Callable[[int], int]

# vLLM's `SamplingParams` turns a seed of -1 into None (unseeded); its API takes an int64.
UNSEEDED = -1
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
_SEEDED_TAG = b"engined/request-seed\x00"
_UNSEEDED_TAG = b"engined/engine-seed\x00"
_UNNAMED_TAG = b"engined/unnamed\x00"
_ACCEPTANCE_TAG = b"engined/mtp-acceptance\x00"


def stream_key(engine_seed: int, name: str | int, seed: int | None, prompt: Sequence[int]) -> int:
    """The integer a request's stream is seeded with (see the module docstring).

    `name` is the request id, or the count of an unnamed request (an int: no id collides).
    """
    if seed is None or seed == UNSEEDED:
        if isinstance(name, int):
            tag, label = _UNNAMED_TAG, str(name).encode()
        else:
            tag, label = _UNSEEDED_TAG, name.encode()
        material = tag + str(engine_seed).encode() + b"\x00" + label
        return int.from_bytes(blake2b(material, digest_size=32).digest(), "little")
    digest = blake2b(_SEEDED_TAG + str(seed).encode() + b"\x00", digest_size=32)
    tokens = array("I", prompt)
    if sys.byteorder != "little":
        tokens.byteswap()
    digest.update(tokens)
    return int.from_bytes(digest.digest(), "little")


def token_bits(
    engine_seed: int, name: str | int, seed: int | None, prompt: Sequence[int]
) -> TokenBits:
    """The request's `getrandbits`: every unplanned token it generates is drawn from it."""
    return Random(stream_key(engine_seed, name, seed, prompt)).getrandbits


def acceptance(key: int, mtp_seed: int) -> Callable[[], float]:
    """The `random` MTP's acceptance of a request's drafts is drawn from, for the request
    whose token stream is keyed `key`."""
    material = _ACCEPTANCE_TAG + str(mtp_seed).encode() + b"\x00" + key.to_bytes(32, "little")
    return Random(int.from_bytes(blake2b(material, digest_size=32).digest(), "little")).random
