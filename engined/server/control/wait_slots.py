"""Replies a client may keep waiting, bounded per client and in all (`wait_idle`, `pause`).

A waiting reply holds a future, not a deadline (vLLM's calls that wait have none), so the
bound is a count: one client cannot hold more than `per_client`, and all together not more
than `total`, so it takes many clients, not one, to have a bystander's wait refused. A
client that disconnects while waiting holds its slots until its waits end.
"""

from __future__ import annotations

from engined.wire import control as wire


class WaitSlots:
    """The waits held now, by client identity; an identity leaves with its last wait.

    Args:
        per_client: waits one identity may hold at once.
        total: waits all identities may hold at once.
        what: the waits' name in a refusal ("wait_idle messages").
    """

    def __init__(self, *, per_client: int, total: int, what: str) -> None:
        self._per_client = per_client
        self._total = total
        self._what = what
        self._held = 0
        self._of: dict[bytes, int] = {}

    def admit(self, identity: bytes) -> tuple[wire.ErrorCode, str] | None:
        """Hold a slot for `identity` and return None, or return why it cannot wait."""
        mine = self._of.get(identity, 0)
        if mine >= self._per_client:
            return "overloaded", f"this client has {self._per_client} {self._what} waiting already"
        if self._held >= self._total:
            return "overloaded", f"{self._total} {self._what} are already waiting"
        self._held += 1
        self._of[identity] = mine + 1
        return None

    def release(self, identity: bytes) -> None:
        """Give back one slot `admit` held for `identity`."""
        self._held -= 1
        left = self._of[identity] - 1
        if left:
            self._of[identity] = left
        else:
            del self._of[identity]

    @property
    def clients(self) -> int:
        """Identities holding a slot (tests: the per-client counts are freed)."""
        return len(self._of)
