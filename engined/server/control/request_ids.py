"""Request ids are each client's own: another client's request of the same name does not
keep a client from using it.

A client names its requests (`request.request_id`), and the core needs names unique per rank.
Before, the first client to use a name held it, so one client could keep another's ids
from it (issue 21: squatting). Now, when a client submits a name another client holds on
that rank, the request runs in the core under an alias (`name` + `\\x1f` + a number) that
the client never sees: its `submitted`, outputs, terminal and `cancel` all use its own name.
Aliases are rare (a collision), so the common path pays one empty-dict test per pass.

Handoff requests (`submit_handoff_prefill`, `reserve_destination`) are not aliased: their
parties find them by handoff id across connections (protocol §1.7).
"""

from __future__ import annotations

import itertools
from typing import Final

SEPARATOR: Final = "\x1f"


class RequestIds:
    """The aliases in use: (owner, its name) <-> the core's name, while the request lives."""

    def __init__(self) -> None:
        self._core: dict[tuple[bytes, str], str] = {}
        self._client: dict[str, tuple[bytes, str]] = {}
        self._numbers = itertools.count(1)

    def __len__(self) -> int:
        return len(self._client)

    def alias(self, identity: bytes, request_id: str) -> str:
        """A core name for `identity`'s `request_id`, which another client holds."""
        core_id = f"{request_id}{SEPARATOR}{next(self._numbers)}"
        self._core[(identity, request_id)] = core_id
        self._client[core_id] = (identity, request_id)
        return core_id

    def core_id(self, identity: bytes, request_id: str) -> str:
        """The core's name of `identity`'s request `request_id`."""
        return self._core.get((identity, request_id), request_id)

    def client_id(self, core_id: str) -> str:
        found = self._client.get(core_id)
        return core_id if found is None else found[1]

    def forget(self, core_id: str) -> None:
        """The request ended (its terminal is being sent)."""
        found = self._client.pop(core_id, None)
        if found is not None:
            del self._core[found]
