"""vLLM's admission control in the API server: `--max-num-queued-reqs` and
`--max-num-queued-tokens`, each answered with HTTP 503 so that a client or load balancer
retries elsewhere (`AsyncLLM.check_admission` in vLLM 0.33).

Requests are counted as vLLM's output processor counts them: one per engine request (a
request with `n` samples is `n`), from the moment it is added until it finishes or is
aborted, summed over every API server process (engined.admission_counters). Prompt tokens
are this process's own, a request's whole prompt from its addition until its first output
arrives, as vLLM counts them: the scheduler's progress through a chunked prefill is not
seen, so the count is conservative. The check runs twice, as vLLM's does: before the
prompt is rendered (`check`), and as the engine requests are added (`admit`), so a request
that passed the first may still be refused by the second when others were added meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engined.admission_counters import AdmissionCounters
from engined.openai.api_errors import engine_overloaded, prefill_backlog_full


class Admission:
    """One API server process's admission: its limits, its counts, the shared slots."""

    def __init__(
        self, *, max_requests: int | None, max_tokens: int | None, counters: AdmissionCounters
    ) -> None:
        self._max_requests = max_requests
        self._max_tokens = max_tokens
        self._counters = counters
        # This process's engine requests not finished, and the prompt tokens of those of
        # them that have had no output yet.
        self._requests = 0
        self._prefill_tokens = 0

    @property
    def requests(self) -> int:
        return self._requests

    @property
    def prefill_tokens(self) -> int:
        return self._prefill_tokens

    def check(self, n: int) -> None:
        """Refuse a request of `n` engine requests if the limits are reached (vLLM's order:
        requests first, then tokens; a refusal is counted once, by its reason).

        Raises:
            ApiError: 503, vLLM's `QueueOverflowError` or `MaxQueuedTokensError`.
        """
        limit = self._max_requests
        if limit is not None and self._counters.requests() + n > limit:
            self._counters.count_rejection(0)
            raise engine_overloaded()
        limit = self._max_tokens
        if limit is not None and self._prefill_tokens >= limit:
            self._counters.count_rejection(1)
            raise prefill_backlog_full()

    def admit(self, prompt_lengths: Sequence[int], n: int) -> list[Ticket]:
        """Add the engine requests of a request, `n` per prompt, prompt by prompt, each
        prompt's checked first as vLLM adds them; on a refusal, none of them stays added.

        Raises:
            ApiError: 503, as `check`.
        """
        tickets: list[Ticket] = []
        try:
            for length in prompt_lengths:
                self.check(n)
                tickets.extend(self._enter(length) for _ in range(n))
        except BaseException:
            for ticket in tickets:
                ticket.leave()
            raise
        return tickets

    def _enter(self, prompt_tokens: int) -> Ticket:
        self._requests += 1
        self._prefill_tokens += prompt_tokens
        self._counters.set_requests(self._requests)
        return Ticket(self, prompt_tokens)

    def _prefilled(self, ticket: Ticket) -> None:
        self._prefill_tokens -= ticket.prompt_tokens

    def _left(self) -> None:
        self._requests -= 1
        self._counters.set_requests(self._requests)


@dataclass(slots=True)
class Ticket:
    """One admitted engine request, until it leaves; each step happens once."""

    admission: Admission
    prompt_tokens: int
    prefilling: bool = True
    left: bool = False

    def output(self) -> None:
        """Its first output arrived: its prompt no longer waits for prefill."""
        if self.prefilling:
            self.prefilling = False
            self.admission._prefilled(self)

    def leave(self) -> None:
        """It finished or was aborted."""
        if not self.left:
            self.output()
            self.left = True
            self.admission._left()
