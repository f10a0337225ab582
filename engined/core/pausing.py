"""vLLM 0.33's pause and sleep on one rank: the scheduler's pause state, the pause that
completes when the engine goes idle, and the executor's sleeping pools.

The reference is `EngineCoreProc` (vllm/v1/engine/core.py) over its `Scheduler`:

* `pause_scheduler(mode, clear_cache)`: `abort` ends every request (the commands do that,
  as a cancel), then the state is PAUSED_NEW (`abort`, `wait`) or PAUSED_ALL (`keep`). The
  pause completes at once if the engine has no work (`_pause_complete`: `not has_work()`),
  else an idle callback completes it when it has none, after the step that left it none.
  Completing (`_finish_pause`) with `clear_cache` is `_reset_caches`: the scheduler's
  `reset_prefix_cache(reset_running_requests=True)`, which preempts every running request,
  last first, and resets the prefix cache. Idle callbacks run last registered first.
* `has_work()` is the scheduler's `has_requests()` (`has_requests` here) or, with async
  scheduling, a batch in flight (EngineCore's `batch_queue`). `has_requests()` is unfinished
  requests under the pause state (`get_num_unfinished_requests`: none under PAUSED_ALL;
  running ones and waiting ones holding KV under PAUSED_NEW), or requests finished since the
  last `schedule()` (its `finished_req_ids`: a step or an abort that ended some makes one
  more step run). Here a waiting request holds KV when its prompt is already built (an
  activated P/D destination). EngineCore does not step without work, and neither does a
  paused pass; with async scheduling a paused step schedules only if `has_requests()`
  (engined/core/paged/async_batches.py), as `step_with_batch_queue` does.
* `pause_generation` is `pause_scheduler` that also rejects new requests (`abort`, `wait`);
  `resume_scheduler` unpauses and accepts them again; a pending completion still runs.
* `sleep(level, mode)`: `pause_scheduler(mode, clear_cache=level >= 1)`; at level >= 1,
  once the pause completes, the executor sleeps (every pool of `SLEEP_TAGS`, unless the
  weights already sleep); the frontend then records the sleep state (`record_sleep_state`).
* `wake_up(tags)`: "scheduling" is dropped from the tags; if any are left (or None), the
  executor wakes them (all of them, or nothing if one does not sleep, or if none sleeps);
  once no pool sleeps, scheduling resumes and the frontend records the engine awake.
* `release_kv_cache_memory()`: only after a completed pause (paused, no request to step,
  no completion pending) with no pool asleep; `_reset_caches`, then the executor discards
  the `kv_cache` pool, and the frontend records the engine asleep at level 0.
* `reset_prefix_cache(reset_running_requests)`, the scheduler's, which `_reset_caches` calls
  with True: preempt every running request, last first, then reset; a reset that still
  fails then is vLLM's RuntimeError (`RESET_FAILED`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sized

import msgspec

from engined.core.errors import InvalidRequestError
from engined.core.handoff_book import HandoffBook
from engined.core.kv_cache import KvCache
from engined.core.pause_types import (
    KV_CACHE_TAG,
    MAX_SLEEP_LEVEL,
    SCHEDULING_TAG,
    SLEEP_TAGS,
    Pause,
    PauseCommand,
    PauseMode,
    PauseState,
    ReleaseKvCacheMemory,
    Resume,
    Sleep,
    WakeUp,
)
from engined.core.preemption import Preempter
from engined.core.state import SchedulerState
from engined.core.types import EngineMetrics

# vLLM's messages (vllm/v1/engine/core.py, vllm/v1/core/sched/scheduler.py).
RESET_FAILED = (
    "Failed to reset KV cache even when all the running requests are preempted and moved "
    "to the waiting queue. This is likely due to the presence of running requests waiting "
    "for remote KV transfer, which is not supported yet."
)
RELEASE_BEFORE_PAUSE = "release_kv_cache_memory() requires a completed pause first"
RELEASE_WHILE_ASLEEP = "release_kv_cache_memory() requires all executor memory to be resident"

_UNPAUSED = PauseState.UNPAUSED
_PAUSED_NEW = PauseState.PAUSED_NEW
_PAUSED_ALL = PauseState.PAUSED_ALL


class PauseControl:
    """A rank's pause state, pending pause completions and sleeping pools."""

    __slots__ = (
        "_book",
        "_completions",
        "_in_flight",
        "_kv",
        "_preempter",
        "_state",
        "asleep",
        "engaged",
        "finished_pending",
        "rejecting",
        "sleep_level",
        "sleeping_tags",
        "state",
    )

    def __init__(
        self,
        state: SchedulerState,
        kv: KvCache,
        book: HandoffBook,
        preempter: Preempter,
        in_flight: Sized = (),
    ) -> None:
        """`in_flight`: the batches in flight under async scheduling (their queue)."""
        self._in_flight = in_flight
        self._state = state
        self._kv = kv
        self._book = book
        self._preempter = preempter
        self.state = _UNPAUSED
        # Pending completions, as EngineCore's idle callbacks: (clear_cache, sleep level or
        # None for a pause that does not sleep the executor).
        self._completions: list[tuple[bool, int | None]] = []
        # Requests ended since the last pass scheduled (vLLM's `finished_req_ids`).
        self.finished_pending = False
        self.rejecting = False
        self.sleeping_tags: set[str] = set()
        self.asleep = False
        self.sleep_level = 0
        # Whether anything here differs from a fresh engine: the one flag a pass checks.
        self.engaged = False

    def validate(self, command: PauseCommand) -> None:
        """Raises `InvalidRequestError` for a sleep level outside 0..2, or a release before
        its pause completed or while a pool sleeps, having changed nothing."""
        if isinstance(command, Sleep) and not 0 <= command.level <= MAX_SLEEP_LEVEL:
            raise InvalidRequestError(f"sleep level must be 0 to {MAX_SLEEP_LEVEL}")
        if isinstance(command, ReleaseKvCacheMemory):
            if self.state is _UNPAUSED or self._completions or self.has_work():
                raise InvalidRequestError(RELEASE_BEFORE_PAUSE)
            if self.sleeping_tags:
                raise InvalidRequestError(RELEASE_WHILE_ASLEEP)

    def apply(self, command: PauseCommand) -> None:
        """Carry out a validated command; an `abort` pause's requests are already ended."""
        match command:
            case Pause(mode, clear_cache):
                self._pause(mode, clear_cache, None)
                self.rejecting = mode is not PauseMode.KEEP
            case Sleep(level, mode):
                self._pause(mode, level >= 1, level)
            case Resume():
                self._resume()
            case WakeUp(tags):
                self._wake_up(tags)
            case ReleaseKvCacheMemory():
                self.reset_caches(reset_running_requests=True)
                self.sleeping_tags.add(KV_CACHE_TAG)
                self.asleep = True
                self.sleep_level = 0
        self._update_engaged()

    def reset_caches(self, *, reset_running_requests: bool) -> bool:
        """The scheduler's `reset_prefix_cache`: with `reset_running_requests`, every
        running request preempted first (last first), and a reset that still fails raises
        `InvalidRequestError(RESET_FAILED)`; without, False while blocks are in use."""
        if reset_running_requests:
            self._preempter.preempt_all()
        reset = self._kv.reset_prefix_cache()
        if reset_running_requests and not reset:
            raise InvalidRequestError(RESET_FAILED)
        return reset

    def _pause(self, mode: PauseMode, clear_cache: bool, sleep_level: int | None) -> None:
        self.state = _PAUSED_ALL if mode is PauseMode.KEEP else _PAUSED_NEW
        self.engaged = True
        if self.has_work():
            self._completions.append((clear_cache, sleep_level))
        else:
            self._complete(clear_cache, sleep_level)

    def _resume(self) -> None:
        self.state = _UNPAUSED
        self.rejecting = False

    def _wake_up(self, tags: tuple[str, ...] | None) -> None:
        if tags is not None:
            tags = tuple(t for t in tags if t != SCHEDULING_TAG)
        sleeping = self.sleeping_tags
        if (tags is None or tags) and sleeping:
            if tags is None:
                sleeping.clear()
            elif all(t in sleeping for t in tags):
                sleeping.difference_update(tags)
        if not sleeping:
            self._resume()
            self.asleep = False
            self.sleep_level = 0

    # --- completion -----------------------------------------------------------------------

    def has_work(self) -> bool:
        """Whether EngineCore would step now (`has_work()`, without a DP wave)."""
        return self.has_requests() or bool(len(self._in_flight))

    def has_requests(self) -> bool:
        """The scheduler's `has_requests()` under the pause state."""
        if self.finished_pending:
            return True
        pause = self.state
        if pause is _PAUSED_ALL:
            return False
        state = self._state
        book = self._book
        if pause is _UNPAUSED:
            return bool(state.requests or book.pending or book.held)
        return bool(state.running or book.held) or state.has_prebuilt_waiting()

    def pending_step(self) -> bool:
        """Whether a pause waits to complete: a pass must run (it completes it when idle)."""
        return bool(self._completions)

    def after_pass(self, ended: bool) -> None:
        """A pass ran (`ended`: it ended requests); complete the pauses if now idle."""
        self.finished_pending = ended
        if self._completions and not self.has_work():
            completions = self._completions
            while completions:
                clear_cache, sleep_level = completions.pop()
                self._complete(clear_cache, sleep_level)
        self._update_engaged()

    def _complete(self, clear_cache: bool, sleep_level: int | None) -> None:
        """EngineCore's `_finish_pause`, then the sleep that waited on it."""
        if clear_cache:
            # vLLM fails the pause's future then; here the pause completes all the same.
            with contextlib.suppress(InvalidRequestError):
                self.reset_caches(reset_running_requests=True)
        if sleep_level is None:
            return
        if sleep_level >= 1 and "weights" not in self.sleeping_tags:
            self.sleeping_tags.update(SLEEP_TAGS)
        self.asleep = True
        self.sleep_level = sleep_level

    def _update_engaged(self) -> None:
        self.engaged = bool(
            self.state is not _UNPAUSED
            or self._completions
            or self.rejecting
            or self.sleeping_tags
            or self.asleep
        )

    def gauges(self, metrics: EngineMetrics) -> EngineMetrics:
        """`metrics` with this rank's pause and sleep state."""
        return msgspec.structs.replace(
            metrics,
            pause_state=int(self.state),
            pause_pending=bool(self._completions),
            rejecting=self.rejecting,
            sleeping_tags=tuple(t for t in SLEEP_TAGS if t in self.sleeping_tags),
            asleep=self.asleep,
            sleep_level=self.sleep_level,
        )
