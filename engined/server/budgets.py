"""What a control client's messages and requests cost in bytes, for the control socket's bounds.

Bounds counted in messages let one client hold gigabytes: a single 60 MB `submit` fitted
under a fixed 64 MiB message limit, and its token ids cost eight times that once decoded. So
the control ROUTER's largest message is derived from what the configuration can use (README
"Limits and guarantees").
"""

from __future__ import annotations

from typing import Final

from engined.core.args import EngineArgs
from engined.core.vocab import EXCLUDED_TOKEN_IDS_MAX

# A token id on the wire: msgpack spends up to 5 bytes on a u32.
TOKEN_WIRE_BYTES: Final = 5
# The rest of the largest message: a request id and a handoff id (256 bytes each), a message
# id (128) and the keys and headers around them.
MESSAGE_FIXED_BYTES: Final = 1024
# Room above the largest message the configuration uses, for encodings this count misses.
MESSAGE_MARGIN_BYTES: Final = 1024 * 1024


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
