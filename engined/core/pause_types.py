"""The pause, sleep and cache-reset commands of vLLM 0.33's engine core, as core values
(types.py re-exports them; engined/core/pausing.py carries them out).

RL frameworks call these between rollouts: pause generation (or put the engine to sleep),
update the weights, resume (or wake it up). vLLM's `EngineCore.pause_scheduler`,
`sleep` and `wake_up` (vllm/v1/engine/core.py) are the reference; `PauseState` is its
scheduler's (vllm/v1/core/sched/interface.py), with the same values.
"""

from __future__ import annotations

import enum

import msgspec


class PauseMode(enum.StrEnum):
    """What a pause does with the requests in flight (vLLM's `PauseMode`).

    `ABORT`: end every request now. `WAIT`: let the running ones (and waiting ones that hold
    KV) drain, keep the queued ones queued. `KEEP`: freeze everything where it is.
    """

    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


class PauseState(enum.IntEnum):
    """The scheduler's pause state (vLLM's `PauseState`, its values).

    `PAUSED_NEW`: only running requests and waiting ones holding KV are scheduled.
    `PAUSED_ALL`: nothing is scheduled.
    """

    UNPAUSED = 0
    PAUSED_NEW = 1
    PAUSED_ALL = 2


# The executor's memory pools that sleep puts away (vLLM's `SLEEP_TAGS`), in the order
# the gauges list them; "scheduling" names the pause itself in a wake-up's tags.
KV_CACHE_TAG = "kv_cache"
SLEEP_TAGS: tuple[str, ...] = (KV_CACHE_TAG, "weights")
SCHEDULING_TAG = "scheduling"
MAX_SLEEP_LEVEL = 2


class Pause(msgspec.Struct, frozen=True, tag=True):
    """vLLM's `pause_generation(mode, clear_cache)`: pause the scheduler (`ABORT` and `WAIT`
    set PAUSED_NEW, `KEEP` PAUSED_ALL); with `ABORT` every request ends first, as a cancel
    ends it. The pause completes once the engine has no work under it (at once when idle):
    then, with `clear_cache`, the running requests are preempted and the prefix cache is
    reset (AllBlocksCleared). `ABORT` and `WAIT` also mark new requests as to be refused
    (`EngineMetrics.rejecting`: the API server refuses them; the core still queues them).
    """

    mode: PauseMode = PauseMode.ABORT
    clear_cache: bool = True


class Resume(msgspec.Struct, frozen=True, tag=True):
    """vLLM's `resume_scheduler`: unpause, and accept new requests again. A pause still
    waiting to complete completes all the same once the engine is idle, as in vLLM."""


class Sleep(msgspec.Struct, frozen=True, tag=True):
    """vLLM's `sleep(level, mode)`: a pause that clears the cache at `level` >= 1 and, once
    complete, puts the weights and the KV cache to sleep (level 0 sleeps no memory).
    `level` is 0 to 2 (`InvalidRequestError` otherwise)."""

    level: int = 1
    mode: PauseMode = PauseMode.ABORT


class WakeUp(msgspec.Struct, frozen=True, tag=True):
    """vLLM's `wake_up(tags)`: wake the named pools (None: all); "scheduling" alone wakes
    none. Scheduling resumes only once no pool sleeps. A tag that does not sleep makes the
    whole call wake nothing, as vLLM's executor does."""

    tags: tuple[str, ...] | None = None


class ResetPrefixCache(msgspec.Struct, frozen=True, tag=True):
    """Forget every cached block (vLLM's `reset_prefix_cache`), publishing AllBlocksCleared.

    `Applied` when done; `Refused` while any block is in use, as vLLM refuses: the router
    would be told to drop blocks still held. With `reset_running_requests` (vLLM semantics
    without async scheduling, else `UnsupportedError`), every running request is preempted
    first, last first, as vLLM's scheduler does; blocks still held then (a P/D hold) raise
    `InvalidRequestError` with vLLM's message instead of a refusal.
    """

    reset_running_requests: bool = False


class ReleaseKvCacheMemory(msgspec.Struct, frozen=True, tag=True):
    """vLLM's `release_kv_cache_memory()`: after a completed pause, with every pool awake,
    clear the caches as a pause's clear does (the running requests preempted, the prefix
    cache reset: AllBlocksCleared) and put the KV cache to sleep (the frontend records the
    engine asleep at level 0). `WakeUp(("kv_cache",))` brings it back and resumes. Refused
    (`InvalidRequestError`, vLLM's messages) before the pause has completed or while a pool
    sleeps."""


PauseCommand = Pause | Resume | Sleep | WakeUp | ReleaseKvCacheMemory
