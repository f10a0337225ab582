"""vLLM's pause, sleep and weight-version calls of the control protocol (§1.1), for
operators: what an RL loop calls between rollouts (pause or sleep, update the weights and
label them, resume or wake up).

Apart from `EngineClient`'s other calls because only an operator's connection may make them;
`EngineClient` inherits them.
"""

from __future__ import annotations

from collections.abc import Sequence

from engined.client.dealer_connection import DEFAULT_TIMEOUT, Connection
from engined.wire.constraints import PauseModeStr
from engined.wire.control import (
    Applied,
    Pause,
    ReleaseKvCacheMemory,
    Resume,
    SetWeightVersion,
    Sleep,
    StatsReply,
    WakeUp,
)


class PauseCalls(Connection):
    """The pause and sleep calls of `EngineClient`, which is the class to use."""

    async def pause(
        self,
        mode: PauseModeStr = "abort",
        clear_cache: bool = True,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> StatsReply:
        """vLLM's `pause_generation` on every rank (operators only): the stats once every
        rank's pause has completed (`abort` ends every request, `cancelled`)."""
        msg = Pause(mode=mode, clear_cache=clear_cache, id=self._next_id())
        return await self._call(msg, StatsReply, timeout)

    async def resume(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> StatsReply:
        """vLLM's `resume_generation` on every rank (operators only)."""
        return await self._call(Resume(id=self._next_id()), StatsReply, timeout)

    async def sleep(
        self,
        level: int = 1,
        mode: PauseModeStr = "abort",
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> StatsReply:
        """vLLM's `sleep(level, mode)` on every rank (operators only), once every rank sleeps."""
        msg = Sleep(level=level, mode=mode, id=self._next_id())
        return await self._call(msg, StatsReply, timeout)

    async def wake_up(
        self, tags: Sequence[str] | None = None, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> StatsReply:
        """vLLM's `wake_up(tags)` on every rank (operators only); fully awake when no rank's
        stats say `asleep`."""
        msg = WakeUp(tags=None if tags is None else list(tags), id=self._next_id())
        return await self._call(msg, StatsReply, timeout)

    async def release_kv_cache_memory(
        self, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> StatsReply:
        """vLLM's `release_kv_cache_memory()` on every rank (operators only), after a
        completed `pause`; `wake_up(["kv_cache"])` undoes it."""
        msg = ReleaseKvCacheMemory(id=self._next_id())
        return await self._call(msg, StatsReply, timeout)

    async def set_weight_version(
        self, weight_version: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied:
        """vLLM's `update_weight_version` on every rank (operators only): the outputs of
        later passes carry `weight_version` ("default" until set)."""
        msg = SetWeightVersion(weight_version=weight_version, id=self._next_id())
        return await self._call(msg, Applied, timeout)
