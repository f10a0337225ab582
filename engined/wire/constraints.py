"""Value constraints shared by the wire formats, declared once as `Annotated` aliases.

msgspec checks these while decoding (so a bad value never reaches the core) and renders them
into the JSON Schemas in `proto/schemas/`. Rules `Meta` cannot express (byte lengths of UTF-8
strings) are named functions in `engined.wire.control`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from engined.core.stops import STOP_TOKEN_IDS_MAX

U32_LIMIT = 1 << 32
U64_LIMIT = 1 << 64
# A cache salt is an opaque tenant key (vLLM bounds none): 1 KiB holds any id or digest.
CACHE_SALT_MAX_BYTES = 1024

# A LoRA adapter's name and path (vLLM bounds neither): a name is a served model name, a path
# a filesystem path or a repository id; 256 and 4096 bytes hold any of them.
LORA_NAME_MAX_BYTES = 256
LORA_PATH_MAX_BYTES = 4096

# Token ids are u32 on every peer (Dynamo `Vec<u32>`, llm-d `[]uint32`).
TokenId = Annotated[int, Meta(ge=0, lt=U32_LIMIT, description="Token id, an unsigned 32-bit int.")]

# A prompt: at least one token (a request with nothing to prefill is meaningless).
PromptTokenIds = Annotated[list[TokenId], Meta(min_length=1)]

NonNegativeInt = Annotated[int, Meta(ge=0)]

# A request's stop ids (vLLM's `stop_token_ids`), at most STOP_TOKEN_IDS_MAX of them.
StopTokenIds = Annotated[
    list[TokenId],
    Meta(
        max_length=STOP_TOKEN_IDS_MAX,
        description=f"At most {STOP_TOKEN_IDS_MAX} ids; generating one ends the request.",
    ),
]

# vLLM's `cache_salt`: at most CACHE_SALT_MAX_BYTES UTF-8 bytes, by a named check.
CacheSalt = Annotated[
    str,
    Meta(description=f"At most {CACHE_SALT_MAX_BYTES} bytes of UTF-8; salts the prefix cache."),
]

# vLLM's `SamplingParams.extra_args["kv_cache_report_mode"]`: "full" publishes a request's
# prefix hits again (as BlockStored), "incremental" (vLLM's default) only what it caches.
KvCacheReportMode = Annotated[
    Literal["incremental", "full"],
    Meta(description='"full": each prefix hit of the request is published again as BlockStored.'),
]

# vLLM's `LoRARequest` fields: the name and path by named byte-length checks, the id from 1
# (vLLM's "id must be > 0") within a signed 64-bit int.
LoraName = Annotated[
    str,
    Meta(min_length=1, description=f"1 to {LORA_NAME_MAX_BYTES} bytes of UTF-8; the adapter."),
]
LoraIntId = Annotated[
    int,
    Meta(ge=1, le=(1 << 63) - 1, description="The adapter's id, at least 1 (vLLM's lora_int_id)."),
]
LoraPath = Annotated[
    str,
    Meta(min_length=1, description=f"1 to {LORA_PATH_MAX_BYTES} bytes of UTF-8; the weights."),
]

# A data-parallel rank; the upper bound (dp_size) is the daemon's to check.
DpRank = Annotated[int, Meta(ge=0, description="Data-parallel rank, in [0, dp_size).")]

# Request and handoff ids: non-empty here, at most 256 UTF-8 *bytes* by a named check.
RequestIdStr = Annotated[
    str, Meta(min_length=1, description="1 to 256 bytes of UTF-8; unique among active requests.")
]
HandoffIdStr = Annotated[str, Meta(min_length=1, description="1 to 256 bytes of UTF-8.")]

# The client's correlation id, echoed in the direct reply (strings at most 128 UTF-8 bytes).
MessageId = Annotated[
    int | str, Meta(description="Echoed in the direct reply; a string is at most 128 bytes.")
]

# A request's sampling seed, vLLM's `SamplingParams.seed` (its API takes an int64; -1 is none).
RequestSeed = Annotated[
    int,
    Meta(
        ge=-(1 << 63),
        le=(1 << 63) - 1,
        description="Keys the request's generated tokens, as vLLM's seed; -1 means none.",
    ),
]

# A request's scheduling priority, vLLM's `priority` (an int; lower is served first under
# `scheduling_policy = priority`, ignored under fcfs).
RequestPriority = Annotated[
    int,
    Meta(
        ge=-(1 << 63),
        le=(1 << 63) - 1,
        description="Lower runs first under scheduling_policy = priority (vLLM's priority).",
    ),
]

# A tokenizer's vocabulary size: generated ids are drawn from [0, vocab_size).
VocabSize = Annotated[
    int, Meta(ge=1, le=U32_LIMIT, description="Generated ids are drawn from [0, vocab_size).")
]

# A weight version label (vLLM's `update_weight_version`): at most 256 UTF-8 bytes here.
WEIGHT_VERSION_MAX_BYTES = 256
WeightVersionStr = Annotated[str, Meta(description="At most 256 bytes of UTF-8.")]

# An FPM worker id (Dynamo stamps the decimal connection id): at most 256 UTF-8 bytes.
WorkerIdStr = Annotated[str, Meta(min_length=1, description="1 to 256 bytes of UTF-8.")]

# The `accept` of a `metrics` request: an HTTP `Accept` header, as a scraper sent it to an API
# server. Real ones are tens of characters; the bound keeps its parsing (per scrape) cheap.
ACCEPT_MAX_LENGTH = 4096
AcceptStr = Annotated[
    str,
    Meta(
        max_length=ACCEPT_MAX_LENGTH,
        description="An HTTP Accept header, at most 4096 characters.",
    ),
]

# `pause` and `sleep`: vLLM's `PauseMode`, and the sleep levels its `/sleep` route accepts.
PauseModeStr = Literal["abort", "wait", "keep"]
SleepLevel = Annotated[int, Meta(ge=0, le=2, description="0: no memory; 1: weights; 2: all.")]

# `wake_up`'s pools ("weights", "kv_cache", "scheduling"); a tag no pool has wakes nothing.
WAKE_UP_TAG_MAX_LENGTH = 64
WAKE_UP_TAGS_MAX = 16
WakeUpTags = Annotated[
    list[Annotated[str, Meta(max_length=WAKE_UP_TAG_MAX_LENGTH)]],
    Meta(max_length=WAKE_UP_TAGS_MAX, description="At most 16 tags of at most 64 characters."),
]
