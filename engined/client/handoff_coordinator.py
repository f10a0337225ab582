"""Prefill/decode handoffs between two daemons, coordinated by a client of both.

Both coordinators engined has (the Dynamo worker behind Dynamo's PrefillRouter, and the
OpenAI API server behind llm-d's routing sidecar) run the same protocol steps (§1.7): the
prefill side runs the prompt as a handoff source and waits for `source_held`; the decode
side reserves a destination, waits out the modelled KV transfer at the source daemon's
speedup, activates it and releases the source on the prefill daemon, and if it gives up
before activation cancels both sides, each once. Only how the two sides find each other
(Dynamo's `disaggregated_params`, vLLM's `kv_transfer_params`) is the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from engined.client.api import EngineClient
from engined.client.client_errors import EngineError
from engined.model_clock import ModelClock
from engined.wire.control import (
    Applied,
    DestinationAccepted,
    DestinationReservedEvent,
    SourceHeldEvent,
    TransferTiming,
    WireLoraRequest,
)

T = TypeVar("T")

# Bounds each control call; the daemon answers commands within one pass.
CALL_TIMEOUT_S: Final = 30.0

Connect = Callable[[str], Awaitable[EngineClient]]
# Resolves when whoever asked for the handoff has gone (Dynamo's stopped context).
Stopped = Callable[[], Awaitable[object]]
Sleep = Callable[[float], Awaitable[None]]


class HandoffFailed(Exception):
    """The handoff cannot go on; the message says which side and why."""


def transfer_wait_s(
    timing: TransferTiming | None,
    handoff_delay_ms: float,
    source_clock: ModelClock,
    reserved: DestinationReservedEvent,
) -> float:
    """The modelled KV transfer time in wall seconds at the source daemon's pacing
    (`source_clock`; none unpaced).

    With the source's `transfer_timing` (its `kv_transfer_timing_mode`) the delay is the
    coordinator's: `destination_missing` moves only what this destination's reservation
    lacks. Without it (an older prefill side) the prefill output's full-prompt delay.
    """
    if not source_clock.paced:
        return 0.0
    if timing is None:
        delay_ms = handoff_delay_ms
    else:
        delay_ms = timing.delay_ms(reserved.transferable_prompt_tokens) or 0.0
    return source_clock.to_wall_s(max(float(delay_ms), 0.0))


async def held_source(client: EngineClient, handoff_id: str) -> SourceHeldEvent | None:
    """The `source_held` of a prefill that finished `length` (it follows the final output).

    Taking the event also forgets the client's lifecycle queue for this handoff.
    """
    try:
        held = await client.next_lifecycle(handoff_id, timeout=CALL_TIMEOUT_S)
    except TimeoutError:
        raise HandoffFailed(f"engined never held the source of handoff {handoff_id}") from None
    return held if isinstance(held, SourceHeldEvent) else None


@dataclass(frozen=True, slots=True)
class DestinationRequest:
    """The decode side's request: what `reserve_destination` runs once activated."""

    token_ids: Sequence[int]
    max_tokens: int
    request_id: str | None = None
    dp_rank: int | None = None
    seed: int | None = None
    priority: int = 0
    stop_token_ids: Sequence[int] | None = None
    min_tokens: int = 0
    cache_salt: str | None = None
    lora_request: WireLoraRequest | None = None


class Coordinator:
    """The handoffs of one engine client: its connections to prefill daemons, its cleanups.

    `connect` opens a client to a prefill daemon's control endpoint (one per endpoint, kept
    until `close`, dropped when it stops answering); `sleep` waits out modelled transfers
    (tests inject a clock).
    """

    def __init__(
        self, client: EngineClient, connect: Connect, *, sleep: Sleep = asyncio.sleep
    ) -> None:
        self._client = client
        self._connect = connect
        self._sleep = sleep
        self._peers: dict[str, EngineClient] = {}
        self._cleanups: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run a cleanup that must outlive the request that needs it (`close` awaits it)."""
        task = asyncio.ensure_future(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    def abandon_source(self, handoff_id: str) -> None:
        """A prefill that ended before its source was held: nothing stays held (once)."""
        self.spawn(_quietly(self._client.cancel_source(handoff_id, timeout=CALL_TIMEOUT_S)))

    async def peer(self, endpoint: str, *, handshake_s: float | None = None) -> EngineClient:
        """The client of the prefill daemon at `endpoint`.

        With `handshake_s`, a new connection must answer a `ping` within it (as NIXL's
        handshake precedes a transfer), so an unreachable daemon fails the request before
        anything is reserved; a peer that did not answer is closed and forgotten.
        """
        peer = self._peers.get(endpoint)
        if peer is not None:
            return peer
        peer = await self._connect(endpoint)
        if handshake_s is not None:
            try:
                await peer.ping(timeout=handshake_s)
            except (TimeoutError, ConnectionError, EngineError):
                await peer.close()
                raise HandoffFailed(
                    f"the prefill daemon at {endpoint} did not answer within {handshake_s:g} s"
                ) from None
        # NOTE: two requests may have connected at once; keep the first, close the other.
        kept = self._peers.setdefault(endpoint, peer)
        if kept is not peer:
            await peer.close()
        return kept

    async def pull(
        self,
        handoff_id: str,
        peer: EngineClient,
        request: DestinationRequest,
        wait_s: Callable[[DestinationReservedEvent], float],
        *,
        stopped: Stopped | None = None,
        strict: bool = False,
    ) -> DestinationAccepted | None:
        """Move handoff `handoff_id` from `peer` (its source) to this client's daemon.

        Returns the accepted destination once it is activated (its outputs then stream
        as any request's), or None when `stopped` resolved first or the daemon ended the
        reservation. Before activation every way out cancels both sides, once each.
        `wait_s` turns the reservation into the transfer to wait out (it may raise).

        `strict`: the source must still be held. It is released before the destination is
        activated, and a release that finds no source (an unknown, already released or
        timed-out handoff) fails the pull with nothing activated. Otherwise (Dynamo's
        order) the destination is activated first and the source released in the
        background (`close` awaits it), its answer not checked.

        Raises:
            EngineError: the decode daemon refused the reservation.
            HandoffFailed: strict, and the source was not held.
        """
        client = self._client
        settled = False
        try:
            accepted = await client.reserve_destination(
                handoff_id,
                request.token_ids,
                request.max_tokens,
                request_id=request.request_id,
                dp_rank=request.dp_rank,
                seed=request.seed,
                priority=request.priority,
                stop_token_ids=request.stop_token_ids,
                min_tokens=request.min_tokens,
                cache_salt=request.cache_salt,
                lora_request=request.lora_request,
                timeout=CALL_TIMEOUT_S,
            )
            reserved = await _until(client.next_lifecycle(handoff_id, timeout=None), stopped)
            if not isinstance(reserved, DestinationReservedEvent):
                return None
            wait = wait_s(reserved)
            if wait > 0 and await _until(_slept(self._sleep, wait), stopped) is None:
                return None
            if strict:
                released = await peer.release_source(handoff_id, timeout=CALL_TIMEOUT_S)
                if not isinstance(released, Applied):
                    await _quietly(client.cancel_destination(handoff_id, timeout=CALL_TIMEOUT_S))
                    settled = True
                    raise HandoffFailed(f"no source of handoff {handoff_id} is held")
            await client.activate_destination(handoff_id, timeout=CALL_TIMEOUT_S)
            settled = True
            if not strict:
                # Not awaited: the decode streams from activation on, whenever a busy
                # prefill daemon answers (its tokens would otherwise queue up meanwhile).
                self.spawn(_quietly(peer.release_source(handoff_id, timeout=CALL_TIMEOUT_S)))
        finally:
            if not settled:
                self.spawn(self._abandon(handoff_id, peer))
        return accepted

    async def _abandon(self, handoff_id: str, peer: EngineClient) -> None:
        """Before activation: both sides of the handoff are cancelled, each once."""
        await _quietly(self._client.cancel_destination(handoff_id, timeout=CALL_TIMEOUT_S))
        await _quietly(peer.cancel_source(handoff_id, timeout=CALL_TIMEOUT_S))


async def _quietly(call: Awaitable[Any]) -> None:
    with contextlib.suppress(EngineError, TimeoutError, ConnectionError):
        await call


async def _slept(sleep: Sleep, seconds: float) -> bool:
    await sleep(seconds)
    return True


async def _until(awaitable: Awaitable[T], stopped: Stopped | None) -> T | None:
    """`awaitable`'s result, or None if `stopped` resolves first."""
    if stopped is None:
        return await awaitable
    work = asyncio.ensure_future(awaitable)
    stop = asyncio.ensure_future(stopped())
    try:
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        return None
    finally:
        work.cancel()
        stop.cancel()
