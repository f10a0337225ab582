"""A pass's outputs routed to their owners, each owner's `output` message written as bytes.

Why bytes: a decoding pass streams one entry per running request, and building an
`OutputEntry` Struct (and its one-token list) per token, encoding it and freeing it was the
largest part of delivering a token. A plain decode entry differs from the next only in its
request id and its token, so `OutputWriter` writes it as two pieces: the request's lead (the
entry's encoding up to its token, kept while the request lives) and the token's encoding,
then one fixed tail; entries that carry more (a request's first, its last, a burst) are
encoded from their Struct. The fixed segments are cut, at construction, from encodings of
sentinel messages built with the wire Structs themselves, so the bytes stay msgspec's;
tests/wire/test_output_bytes.py holds whole messages to the Struct path. A rank whose
outputs carry a weight version (`set_weight_version`) has leads and a tail of their own,
cut from a sentinel entry with a version: its tail ends with the version's encoding.

Compiled with the core (`engined.core.COMPILED_MODULES`): it runs for every streamed token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import msgspec

from engined.core import types as core
from engined.wire.control import Output, OutputEntry
from engined.wire.convert import to_output_entry
from engined.wire.kv_event_bytes import array_head, cut

_REQUEST_ID: Final = "engined-sentinel-request-id"
_TOKEN: Final = 0xC1C2C3C4
_RANK: Final = 0xD1D2D3D4
_VERSION: Final = "engined-sentinel-weight-version"
_EMPTY_ARRAY: Final = b"\x90"
_ONE_ELEMENT: Final = b"\x91"
# Where a message's pieces hold the array head of its entries, known once they are counted.
_ARRAY_HEAD: Final = 3
# A bound on the leads kept: a request's is dropped with its last entry, so only requests
# that end unseen (none today) would stay; past this many the cache starts again.
MAX_LEADS: Final = 1 << 16


class OutputWriter:
    """Routes a pass's outputs to their owners as encoded `output` messages.

    Args:
        name_of: the request id its owner knows a core request id by (an alias's client
            name, `RequestIds.client_id`); asked once per request and for every entry
            encoded from its Struct.
    """

    __slots__ = (
        "_encode",
        "_entry_tail",
        "_head",
        "_leads",
        "_name_of",
        "_rank_tail",
        "_to_token",
        "_versioned",
    )

    def __init__(self, name_of: Callable[[str], str]) -> None:
        encode = msgspec.msgpack.Encoder().encode
        self._encode = encode
        self._name_of = name_of
        sentinel = OutputEntry(
            request_id=_REQUEST_ID, token_ids=[_TOKEN], finished=False, finish_reason=None
        )
        head, to_token, tail = cut(encode(sentinel), [encode(_REQUEST_ID), encode([_TOKEN])])
        self._head = head
        self._to_token = to_token + _ONE_ELEMENT
        self._entry_tail = tail
        labelled = msgspec.structs.replace(sentinel, weight_version=_VERSION)
        pieces = cut(encode(labelled), [encode(_REQUEST_ID), encode([_TOKEN]), encode(_VERSION)])
        if pieces[3]:
            raise RuntimeError(f"unexpected encoding of a labelled entry: {pieces!r}")
        # (lead head, to the token, tail up to the version, leads by request id)
        self._versioned = _Versioned(pieces[0], pieces[1] + _ONE_ELEMENT, pieces[2])
        message_head, rank_tail = cut(encode(Output(dp_rank=_RANK, outputs=[])), [encode(_RANK)])
        if not rank_tail.endswith(_EMPTY_ARRAY):
            raise RuntimeError(f"unexpected encoding of an empty output: {rank_tail!r}")
        # (message head, what follows the rank up to the entries' array head)
        self._rank_tail = (message_head, rank_tail[: -len(_EMPTY_ARRAY)])
        self._leads: dict[str, bytes] = {}

    def route(
        self,
        outputs: list[core.RequestOutput],
        decodes: core.Decodes,
        owners: dict[str, bytes],
        rank: int,
        weight_version: str | None = None,
    ) -> tuple[dict[bytes, bytes], list[str]]:
        """Each owner's `output` message of this pass (its entries in emission order), and the
        owned requests the pass ended; every entry labelled `weight_version` when given.

        Outputs of requests nobody owns are dropped. `owners` is a dict, not a Mapping, so
        the compiled lookup is the dict's own; consecutive entries of one owner (a single
        client's whole pass) find its pieces without another lookup.
        """
        messages: dict[bytes, _Message] = {}
        ended: list[str] = []
        last_owner: bytes | None = None
        message = _NOBODY
        step_ids = decodes.request_ids
        step_tokens = decodes.token_ids
        # The decode steps emitted before each output, and after the last one, the rest.
        bounds = [*decodes.before, len(step_ids)]
        num_outputs = len(outputs)
        assert len(bounds) == num_outputs + 1, "Decodes.before needs one entry per output"
        encode = self._encode
        versioned = self._versioned if weight_version is not None else None
        if versioned is None:
            leads = self._leads
            tail = self._entry_tail
        else:
            leads = versioned.leads
            tail = versioned.tail + encode(weight_version)
        if len(leads) > MAX_LEADS:
            leads.clear()
        taken = 0
        for index, stop in enumerate(bounds):
            while taken < stop:
                request_id = step_ids[taken]
                owner = owners.get(request_id)
                if owner is not None:
                    if last_owner is None or owner != last_owner:
                        message, last_owner = self._message_of(messages, owner, rank), owner
                    lead = leads.get(request_id)
                    if lead is None:
                        lead = leads[request_id] = self._lead(request_id, versioned)
                    pieces = message.pieces
                    pieces.append(lead)
                    pieces.append(encode(step_tokens[taken]))
                    pieces.append(tail)
                    message.count += 1
                taken += 1
            if index == num_outputs:
                break
            output = outputs[index]
            request_id = output.request_id
            finished = output.finish_reason is not None
            if finished:
                self._leads.pop(request_id, None)
                self._versioned.leads.pop(request_id, None)
            owner = owners.get(request_id)
            if owner is None:
                continue
            if finished:
                ended.append(request_id)
            if last_owner is None or owner != last_owner:
                message, last_owner = self._message_of(messages, owner, rank), owner
            name = self._name_of(request_id)
            entry = to_output_entry(output, None if name == request_id else name, weight_version)
            message.pieces.append(encode(entry))
            message.count += 1
        written: dict[bytes, bytes] = {}
        for owner, owned in messages.items():
            owned.pieces[_ARRAY_HEAD] = array_head(owned.count)
            written[owner] = b"".join(owned.pieces)
        return written, ended

    def _lead(self, request_id: str, versioned: _Versioned | None) -> bytes:
        name = self._encode(self._name_of(request_id))
        if versioned is None:
            return self._head + name + self._to_token
        return versioned.head + name + versioned.to_token

    def _message_of(self, messages: dict[bytes, _Message], owner: bytes, rank: int) -> _Message:
        """The owner's message so far, begun with its head (the entries' array head blank)."""
        found = messages.get(owner)
        if found is None:
            message_head, rank_tail = self._rank_tail
            head = [message_head, self._encode(rank), rank_tail, b""]
            found = messages[owner] = _Message(head)
        return found


class _Versioned:
    """The pieces of entries labelled with a weight version, and their requests' leads."""

    __slots__ = ("head", "leads", "tail", "to_token")

    def __init__(self, head: bytes, to_token: bytes, tail: bytes) -> None:
        self.head = head
        self.to_token = to_token
        self.tail = tail
        self.leads: dict[str, bytes] = {}


class _Message:
    """One owner's message being written: its pieces and how many entries they hold."""

    __slots__ = ("count", "pieces")

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.count = 0


# A placeholder before the first owned entry: never written to.
_NOBODY: Final = _Message([])
