"""What a control client's messages and requests cost in bytes, for the control socket's bounds.

Bounds counted in messages let one client hold gigabytes: a single 60 MB `submit` fitted
under a fixed 64 MiB message limit, and its token ids cost eight times that once decoded. So
the control ROUTER's largest message is derived from what the configuration can use, and
the requests a client has in flight are charged what the core keeps of them
(`engined.server.control.ownership` sums them per client; README "Limits and guarantees").
"""

from __future__ import annotations

from typing import Final

from engined.core.args import EngineArgs
from engined.core.vocab import EXCLUDED_TOKEN_IDS_MAX
from engined.wire.client_messages import WireRequest

# A token id on the wire: msgpack spends up to 5 bytes on a u32.
TOKEN_WIRE_BYTES: Final = 5
# The rest of the largest message: a request id and a handoff id (256 bytes each), a message
# id (128) and the keys and headers around them.
MESSAGE_FIXED_BYTES: Final = 1024
# Room above the largest message the configuration uses, for encodings this count misses.
MESSAGE_MARGIN_BYTES: Final = 1024 * 1024

# What the core keeps of a request in flight, measured with tracemalloc on the pure-Python
# core: about 900 bytes of state with a short prompt; 4 bytes a prompt token in its array
# plus its share of the block hashes (~10 in all at block size 16, less above); 40 bytes a
# planned output token, which stays a list of Python ints; 64 a stop id, an int in a
# frozenset (33 bytes of set slots an id, measured, plus the int); and the bytes of its
# strings (a cache salt, a LoRA adapter's name and path), plus LORA_BYTES for an adapter.
REQUEST_BYTES: Final = 1024
PROMPT_TOKEN_BYTES: Final = 10
PLANNED_TOKEN_BYTES: Final = 40
STOP_TOKEN_BYTES: Final = 64
# A `LoraRequest` struct and its two strings' headers.
LORA_BYTES: Final = 256


def control_max_message_bytes(engine: EngineArgs) -> int:
    """The control ROUTER's MAXMSGSIZE for a normalised `engine`.

    The largest message worth sending is a request whose prompt fills a rank's KV pool
    (longer ones are refused) with as many planned output ids again, or a `set_vocabulary`
    with every excluded id allowed; plus the margin. Defaults (16,384 blocks of 64 tokens):
    11,535,360 bytes.
    """
    capacity = engine.num_gpu_blocks * engine.block_size
    request = 2 * capacity * TOKEN_WIRE_BYTES + MESSAGE_FIXED_BYTES
    vocabulary = EXCLUDED_TOKEN_IDS_MAX * TOKEN_WIRE_BYTES + MESSAGE_FIXED_BYTES
    return max(request, vocabulary) + MESSAGE_MARGIN_BYTES


def request_bytes(
    prompt_tokens: int, planned_tokens: int, stop_tokens: int = 0, text_bytes: int = 0
) -> int:
    """What a request in flight is charged against its client's `control_inflight_bytes`."""
    return (
        REQUEST_BYTES
        + PROMPT_TOKEN_BYTES * prompt_tokens
        + PLANNED_TOKEN_BYTES * planned_tokens
        + STOP_TOKEN_BYTES * stop_tokens
        + text_bytes
    )


def text_bytes(request: WireRequest) -> int:
    """The bytes of the request's strings the core keeps, for `request_bytes`."""
    size = len(request.cache_salt.encode()) if request.cache_salt else 0
    lora = request.lora_request
    if lora is not None:
        size += LORA_BYTES + len(lora.lora_name.encode()) + len(lora.lora_path.encode())
    return size


def over_budget(held: int, cost: int, budget: int) -> str:
    """The `overloaded` message of a request whose `cost` would take its client's requests
    in flight from `held` bytes past its `budget`."""
    return (
        f"request: this client's requests in flight hold {held} bytes and this one needs "
        f"{cost}, over the client's budget of {budget} bytes (control_inflight_bytes)"
    )
