"""`engined events`: follow one rank's KV event stream, in seq order, and show every event.

What a KV-aware router sees, made readable: each `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` with its batch seq, hashes, parent and token count, in either wire format
(`decode_batch` reads both). The stream is read the way vLLM's consumers read it, so the
command also shows whether they would have lost anything:

* `--replay-from SEQ` asks the replay ROUTER for the buffered batches from SEQ on before
  following the live PUB, so a late subscriber sees the history.
* A live seq above the next expected one is a gap: it is reported (`{"gap": ...}` in JSON),
  and recovered from the replay socket when there is one, as Dynamo's and llm-d's listeners do.
* Batches already shown through replay that arrive live again are skipped; a live seq that
  goes backwards means the publisher restarted and is reported as such.

The reading itself is `engined.tools.kv_stream` (its own module because the rules of seq
order, gaps and replay are apart from showing them); this module picks the endpoints and renders.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, Final, Literal

import zmq
import zmq.asyncio

from engined.tools.common import (
    EXIT_OK,
    Output,
    ToolError,
    UsageError,
    control_client,
    discover,
    fmt_hash,
    pick_rank,
    zmq_context,
)
from engined.tools.kv_stream import (
    Gap,
    KvStreamReader,
    Malformed,
    Message,
    Recovery,
    Restart,
    StreamItem,
)
from engined.tools.option_values import DEFAULT_TIMEOUT
from engined.wire.kv_events import (
    WireKvEvent,
    decode_batch,
)
from engined.wire.protocol_errors import WireError

# Hashes shown per event in text mode; JSON always has all of them.
_TEXT_HASHES: Final = 4

HashFormat = Literal["hex", "int"]


@dataclass(frozen=True, slots=True)
class EventsOptions:
    control_endpoint: str
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    rank: int = 0
    replay_from: int | None = None
    follow: bool = True
    count: int | None = None
    duration: float | None = None
    timeout: float = DEFAULT_TIMEOUT
    # None: hex in text, ints in JSON (exact, what the wire carries).
    hash_format: HashFormat | None = None


# --- the command ----------------------------------------------------------------------------


async def events(options: EventsOptions, out: Output) -> int:
    """Resolve the rank's endpoints, then print the stream until --count or --duration."""
    if options.replay_from is None and not options.follow:
        raise UsageError("--no-follow", "--no-follow needs --replay-from (nothing to show)")
    async with zmq_context() as ctx:
        events_endpoint, replay_endpoint = await _endpoints(ctx, options)
        if options.replay_from is not None and not options.follow and replay_endpoint is None:
            raise ToolError("no replay endpoint: start the daemon with --kv-replay-endpoint")
        reader = KvStreamReader(ctx, events_endpoint, replay_endpoint, options.timeout)
        hex_hashes = options.hash_format == "hex" or (options.hash_format is None and not out.json)
        shown = 0
        try:
            if options.count == 0:
                return EXIT_OK
            # --duration ends the run quietly: it is a stop condition, not a failure.
            with contextlib.suppress(TimeoutError):
                async with (
                    asyncio.timeout(options.duration),
                    contextlib.aclosing(
                        reader.stream(options.replay_from, options.follow)
                    ) as stream,
                ):
                    async for item in stream:
                        _show(out, item, hex_hashes)
                        if isinstance(item, Message):
                            shown += 1
                            if options.count is not None and shown >= options.count:
                                break
        finally:
            reader.close()
    return EXIT_OK


async def _endpoints(ctx: zmq.asyncio.Context, options: EventsOptions) -> tuple[str, str | None]:
    """The KV PUB and replay endpoints: the overrides, else the daemon's welcome for --rank.

    With `--kv-events-endpoint` the daemon is not asked at all, so the command also reads any
    vLLM publisher; replay is then only used with an explicit `--kv-replay-endpoint`.
    """
    if options.kv_events_endpoint is not None:
        return options.kv_events_endpoint, options.kv_replay_endpoint
    async with control_client(ctx, options.control_endpoint) as client:
        welcome = await discover(client, options.control_endpoint, options.timeout)
    if not welcome.kv_events_endpoints:
        raise ToolError(
            "the daemon publishes no KV events (its kv_events_endpoint is off); "
            "there is nothing to subscribe to"
        )
    events_endpoint = pick_rank(welcome.kv_events_endpoints, options.rank, "KV events")
    replay = options.kv_replay_endpoint
    if replay is None and welcome.kv_replay_endpoints:
        replay = pick_rank(welcome.kv_replay_endpoints, options.rank, "KV replay")
    return events_endpoint, replay


# --- rendering ------------------------------------------------------------------------------


def _show(out: Output, item: StreamItem, hex_hashes: bool) -> None:
    match item:
        case Message():
            _show_message(out, item, hex_hashes)
        case Gap(expected=expected, got=got, source=source):
            if out.json:
                out.record({"gap": {"expected": expected, "got": got, "source": source}})
            elif source == "replay":
                out.warning(
                    f"gap: expected seq {expected}, replay starts at {got} "
                    f"({got - expected} batch(es) no longer buffered)"
                )
            else:
                out.warning(
                    f"gap in the live stream: expected seq {expected}, got {got} "
                    f"({got - expected} batch(es) missed)"
                )
        case Recovery():
            if out.json:
                out.record(
                    {
                        "recovered": {
                            "expected": item.expected,
                            "got": item.got,
                            "batches": item.batches,
                            "missing": item.missing,
                            "error": item.error,
                        }
                    }
                )
            elif item.missing or item.error:
                reason = f": {item.error}" if item.error else ""
                out.warning(
                    f"recovered {item.batches} of {item.got - item.expected} missed batch(es) "
                    f"from replay, {item.missing} lost{reason}"
                )
            else:
                out.line(f"recovered {item.batches} missed batch(es) from replay", style="yellow")
        case Restart(previous=previous, got=got):
            if out.json:
                out.record({"restart": {"previous": previous, "got": got}})
            else:
                out.warning(f"seq went back from {previous} to {got}: the publisher restarted")
        case Malformed(frames=frames, reason=reason):
            if out.json:
                out.record({"malformed": {"frames": frames, "reason": reason}})
            else:
                out.warning(f"malformed message with {frames} frame(s): {reason}")


def _show_message(out: Output, message: Message, hex_hashes: bool) -> None:
    try:
        batch = decode_batch(message.payload)
    except WireError as error:
        if out.json:
            out.record({"undecodable": {"seq": message.seq, "message": error.message}})
        else:
            out.warning(f"seq {message.seq}: undecodable payload: {error.message}")
        return
    for event in batch.events:
        record = event_record(event, hex_hashes)
        if out.json:
            out.record(
                {
                    "seq": message.seq,
                    "ts": batch.ts,
                    "dp_rank": batch.data_parallel_rank,
                    "replayed": message.replayed,
                    **record,
                }
            )
        else:
            out.line(
                _event_text(message, batch.data_parallel_rank, record),
                style=_STYLE.get(str(record["type"])),
            )
    if not batch.events and not out.json:
        out.line(f"#{message.seq} empty batch")


_STYLE: Final = {"BlockStored": "green", "BlockRemoved": "red", "AllBlocksCleared": "bold magenta"}


def event_record(event: WireKvEvent, hex_hashes: bool) -> dict[str, Any]:
    """The stable JSON keys of one event, whichever wire format it came in."""
    name = type(event).__name__.removeprefix("Array")
    hashes = list(getattr(event, "block_hashes", []))
    token_ids = getattr(event, "token_ids", None)
    parent = getattr(event, "parent_block_hash", None)
    return {
        "type": name,
        "block_hashes": [fmt_hash(h, hex_hashes) for h in hashes],
        "parent_block_hash": fmt_hash(parent, hex_hashes),
        "num_blocks": len(hashes),
        "num_tokens": None if token_ids is None else len(token_ids),
        "block_size": getattr(event, "block_size", None),
        "medium": getattr(event, "medium", None),
    }


def _event_text(message: Message, rank: int | None, record: dict[str, Any]) -> str:
    parts = [f"#{message.seq}", f"rank {rank if rank is not None else '?'}", record["type"]]
    if record["type"] != "AllBlocksCleared":
        parts.append(f"{record['num_blocks']} block(s)")
    if record["num_tokens"] is not None:
        parts.append(f"{record['num_tokens']} tokens")
    if record["medium"] is not None:
        parts.append(str(record["medium"]))
    if record["type"] == "BlockStored":
        parent = record["parent_block_hash"]
        parts.append(f"parent {parent if parent is not None else '-'}")
    hashes = [str(h) for h in record["block_hashes"]]
    if hashes:
        more = len(hashes) - _TEXT_HASHES
        shown = ", ".join(hashes[:_TEXT_HASHES]) + (f", ... +{more}" if more > 0 else "")
        parts.append(f"[{shown}]")
    if message.replayed:
        parts.append("(replayed)")
    return "  ".join(parts)
