"""The engine side of one OpenAI request: its engine requests, their outputs, their end.

An OpenAI request becomes one engine request per prompt and sample (`n`), as vLLM's
ParentRequest fans out: sample j of a seeded request gets seed + j, and each is its own
request in the scheduler, so the samples share the prompt's KV through prefix caching
exactly as vLLM's do. Outputs are read as the daemon sends them, one `output` message per
pass, and whatever arrived for a choice while the HTTP side was busy is merged into one
delta, as vLLM's RequestOutputCollector merges for a consumer that falls behind; a client
that keeps up sees every pass.

Whoever ends the HTTP side first (the client disconnects, the server shuts down, a stop
string matches), the engine requests that have not finished are cancelled, once, so their
KV is freed on the next pass.

A request with `kv_transfer_params` (one prompt, n = 1) is one side of a handoff
(engined.openai.disagg): its prefill runs as a handoff source and its final delta waits for
the params the response carries; its decode pulls the source's KV before it streams.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engined.client import EngineClient
from engined.client.handoff_coordinator import DestinationRequest
from engined.openai.disagg import DecodeRole, Disaggregation, PrefillRole, Role
from engined.openai.in_flight import InFlight
from engined.openai.queue_admission import Ticket
from engined.openai.weight_versions import Runs, add_run, joined
from engined.wire.constraints import KvCacheReportMode
from engined.wire.control import OutputEntry, Submitted, WireLoraRequest

# Bounds every control call of the API server; the daemon answers within a pass or two.
CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Sample:
    """One engine request: choice `choice_index` of an OpenAI request."""

    request_id: str
    choice_index: int
    prompt_ids: list[int]
    max_tokens: int
    seed: int | None = None
    priority: int = 0
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    cache_salt: str | None = None
    # The LoRA adapter the request's `model` names, vLLM's `lora_request`.
    lora_request: WireLoraRequest | None = None
    # vLLM's `extra_args["kv_cache_report_mode"]` (the request's `vllm_xargs`).
    kv_cache_report_mode: KvCacheReportMode = "incremental"
    # vLLM's external request id, which `/abort_requests` names, when it is not `request_id`:
    # the prompt's, which its n samples share, or a decode's own under a prefill's id.
    external_id: str | None = None
    # One of a prompt's n > 1 samples: a child of vLLM's ParentRequest.
    parallel: bool = False


@dataclass(slots=True)
class Delta:
    """What one choice produced since its previous delta."""

    choice_index: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | None = None
    cached_tokens: int | None = None
    # The weight version of its tokens, in runs (engined.openai.weight_versions).
    versions: Runs = field(default_factory=list)


@dataclass(slots=True)
class _Choice:
    sample: Sample
    ticket: Ticket | None = None
    finished: bool = False
    cached_tokens: int | None = None
    generated: int = 0
    # `stream_interval`: tokens sent so far, and a delta held back until it has enough.
    sent: int = 0
    held: Delta | None = None
    # `/abort_requests` cancelled it (its terminal may not have arrived yet).
    aborted: bool = False


def _merge(choice: _Choice, entries: Sequence[OutputEntry]) -> Delta:
    tokens: list[int] = []
    versions: Runs = []
    for entry in entries:
        tokens.extend(entry.token_ids)
        add_run(versions, entry.weight_version, len(entry.token_ids))
        if entry.cached_tokens is not None and choice.cached_tokens is None:
            choice.cached_tokens = entry.cached_tokens
    last = entries[-1]
    choice.generated += len(tokens)
    ticket = choice.ticket
    if ticket is not None and (tokens or last.finished):
        ticket.output()
    if last.finished:
        choice.finished = True
        if ticket is not None:
            ticket.leave()
    return Delta(
        choice_index=choice.sample.choice_index,
        token_ids=tokens,
        finished=last.finished,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        cached_tokens=choice.cached_tokens,
        versions=versions,
    )


@dataclass(frozen=True, slots=True)
class Transfer:
    """A request's part in a handoff, and the process's means for it."""

    disagg: Disaggregation
    role: Role


# NOTE: eq=False: hashed by identity, as the in-flight registry holds it.
@dataclass(slots=True, eq=False)
class Generation:
    """The engine requests of one OpenAI request; `start`, then `deltas`, then `close`."""

    client: EngineClient
    samples: Sequence[Sample]
    transfer: Transfer | None = None
    # A prefill's params for the decode side, set before its final delta is yielded.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's stream interval: a choice's delta waits until it has this many tokens, unless
    # it is the choice's first output or its last.
    stream_interval: int = 1
    # Each sample's admission (engined.openai.queue_admission), in the order of `samples`; none
    # when the request was not counted.
    tickets: Sequence[Ticket] = ()
    # Where it is registered while it runs, for `/abort_requests`.
    in_flight: InFlight | None = None
    _choices: list[_Choice] = field(default_factory=list)
    _closed: bool = False
    _stopping: set[asyncio.Task[None]] = field(default_factory=set)
    _source: Submitted | None = None

    async def start(self) -> None:
        """Submit every sample; on a refusal, cancel those already submitted and re-raise.

        Raises:
            EngineError: the daemon refused a sample (its code says why).
            TimeoutError, ConnectionError: the daemon did not answer.
            ApiError: a handoff's KV could not be pulled.
        """
        try:
            if self.transfer is not None:
                await self._start_transfer(self.transfer)
            else:
                await self._submit_all()
        except BaseException as failure:
            # Not started: the request no longer counts for admission.
            self._leave_all()
            if isinstance(failure, asyncio.CancelledError) and not self._closed:
                # The client left while the samples were being submitted: whichever reached
                # the daemon are cancelled, in tasks (this one is being cancelled).
                self._closed = True
                if self.transfer is None:
                    for sample in self.samples:
                        self._cancel_soon(sample.request_id)
            raise
        if self.in_flight is not None:
            self.in_flight.add(self)

    async def _submit_all(self) -> None:
        # NOTE: all at once: the samples of one request reach the same pass, as in vLLM.
        results = await asyncio.gather(
            *(
                self.client.submit(
                    sample.prompt_ids,
                    sample.max_tokens,
                    request_id=sample.request_id,
                    seed=sample.seed,
                    priority=sample.priority,
                    stop_token_ids=sample.stop_token_ids or None,
                    min_tokens=sample.min_tokens,
                    cache_salt=sample.cache_salt,
                    lora_request=sample.lora_request,
                    kv_cache_report_mode=sample.kv_cache_report_mode,
                    timeout=CALL_TIMEOUT_S,
                )
                for sample in self.samples
            ),
            return_exceptions=True,
        )
        for i, (sample, result) in enumerate(zip(self.samples, results, strict=True)):
            if not isinstance(result, BaseException):
                self._choices.append(_Choice(sample, self._ticket(i)))
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            await self.close()
            raise failure

    def _ticket(self, index: int) -> Ticket | None:
        return self.tickets[index] if index < len(self.tickets) else None

    async def _start_transfer(self, transfer: Transfer) -> None:
        (sample,) = self.samples
        disagg, role = transfer.disagg, transfer.role
        if isinstance(role, PrefillRole):
            self._source = await disagg.start_prefill(
                self.client,
                role,
                sample.prompt_ids,
                request_id=sample.request_id,
                seed=sample.seed,
                priority=sample.priority,
                cache_salt=sample.cache_salt,
                lora_request=sample.lora_request,
            )
            self._choices.append(_Choice(sample, self._ticket(0)))
            return
        # NOTE: under the prefill's request id, so an unseeded decode draws the tokens the
        # prefill started (a seeded one draws its seed's, whatever the id).
        sample = replace(
            sample,
            request_id=role.request_id or sample.request_id,
            external_id=sample.external_id or sample.request_id,
        )
        destination = DestinationRequest(
            sample.prompt_ids,
            sample.max_tokens,
            request_id=sample.request_id,
            seed=sample.seed,
            priority=sample.priority,
            stop_token_ids=sample.stop_token_ids or None,
            min_tokens=sample.min_tokens,
            cache_salt=sample.cache_salt,
            lora_request=sample.lora_request,
        )
        await disagg.pull(role, destination)
        self._choices.append(_Choice(sample, self._ticket(0)))

    async def _finish_transfer(self, choice: _Choice, delta: Delta) -> None:
        """A prefill's final delta: the params once its source is held."""
        transfer, source = self.transfer, self._source
        if transfer is None or source is None or not isinstance(transfer.role, PrefillRole):
            return
        if delta.finish_reason != "length":
            return
        self.kv_transfer_params = await transfer.disagg.finish_prefill(
            self.client,
            transfer.role,
            source,
            len(choice.sample.prompt_ids),
            choice.cached_tokens,
        )

    @property
    def cached_tokens(self) -> list[int | None]:
        """Per choice, what its prompt found in the prefix cache (None until known); for a
        decode, the prefill's when its params say (as vLLM reports a remote prefill)."""
        role = None if self.transfer is None else self.transfer.role
        if isinstance(role, DecodeRole) and role.cached_tokens is not None:
            return [role.cached_tokens for _ in self._choices]
        return [choice.cached_tokens for choice in self._choices]

    @property
    def generated(self) -> int:
        return sum(choice.generated for choice in self._choices)

    def deltas(self) -> AsyncGenerator[list[Delta], None]:
        """Lists of deltas, at most one per choice each, until every choice finished."""
        return self._deltas() if self.stream_interval == 1 else self._paced()

    async def _paced(self) -> AsyncGenerator[list[Delta], None]:
        by_index = {choice.sample.choice_index: choice for choice in self._choices}
        async for batch in self._deltas():
            due = [d for d in (self._pace(by_index[d.choice_index], d) for d in batch) if d]
            if due:
                yield due

    def _pace(self, choice: _Choice, delta: Delta) -> Delta | None:
        """`delta`, with what was held back before it, if it is due; else None (held)."""
        held = choice.held
        if held is not None:
            held.token_ids.extend(delta.token_ids)
            delta.token_ids = held.token_ids
            delta.versions = joined(held.versions, delta.versions)
        if not delta.finished and choice.sent and len(delta.token_ids) < self.stream_interval:
            choice.held = delta
            return None
        choice.held = None
        choice.sent += len(delta.token_ids)
        return delta

    async def _deltas(self) -> AsyncGenerator[list[Delta], None]:
        if len(self._choices) == 1:
            choice = self._choices[0]
            batches = self.client.output_batches(choice.sample.request_id, timeout=None)
            async with contextlib.aclosing(batches):
                async for entries in batches:
                    delta = _merge(choice, entries)
                    if delta.finished:
                        await self._finish_transfer(choice, delta)
                    yield [delta]
            return
        queue: asyncio.Queue[tuple[_Choice, list[OutputEntry]] | BaseException] = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                batches = self.client.output_batches(choice.sample.request_id, timeout=None)
                async with contextlib.aclosing(batches):
                    async for entries in batches:
                        queue.put_nowait((choice, entries))
            except Exception as exc:
                queue.put_nowait(exc)

        pumps = [asyncio.create_task(pump(choice)) for choice in self._choices]
        try:
            while not all(choice.finished for choice in self._choices):
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                merged: dict[int, list[OutputEntry]] = {}
                owners: dict[int, _Choice] = {}
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    choice, entries = item
                    merged.setdefault(choice.sample.choice_index, []).extend(entries)
                    owners[choice.sample.choice_index] = choice
                yield [_merge(owners[index], entries) for index, entries in merged.items()]
        finally:
            for task in pumps:
                task.cancel()

    def abortable(self, external_ids: Collection[str] | None) -> list[Sample]:
        """The engine requests still running that `external_ids` names (None: all), from
        now on aborted: vLLM drops an aborted request's state at once, so a later abort
        neither finds nor counts it."""
        taken = []
        for choice in self._choices:
            sample = choice.sample
            if choice.finished or choice.aborted:
                continue
            if external_ids is None or (sample.external_id or sample.request_id) in external_ids:
                choice.aborted = True
                taken.append(sample)
        return taken

    def stop(self, choice_index: int) -> None:
        """End one choice's engine request now (a stop string matched), as vLLM's output
        processor aborts it, without waiting for the daemon's answer."""
        for choice in self._choices:
            if choice.sample.choice_index == choice_index and not choice.finished:
                choice.finished = True
                if choice.ticket is not None:
                    choice.ticket.leave()
                self._cancel_soon(choice.sample.request_id)

    def _cancel_soon(self, request_id: str) -> None:
        task = asyncio.create_task(self._cancel(request_id))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _cancel(self, request_id: str) -> None:
        await self.client.abandon(request_id, timeout=CALL_TIMEOUT_S)

    async def close(self) -> None:
        """Cancel every engine request that has not finished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.in_flight is not None:
            self.in_flight.discard(self)
        self._leave_all()
        transfer = self.transfer
        if (
            transfer is not None
            and isinstance(transfer.role, PrefillRole)
            and self._source is not None
            and self.kv_transfer_params is None
        ):
            # Nothing was handed to a decode side: whatever the source holds is freed.
            transfer.disagg.abandon_prefill(transfer.role)
        for choice in self._choices:
            if not choice.finished:
                await self._cancel(choice.sample.request_id)

    def _leave_all(self) -> None:
        """Whatever happens to the engine requests now, this request no longer counts."""
        for ticket in self.tickets:
            ticket.leave()
