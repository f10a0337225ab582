"""`vllm:lora_requests_info`: which LoRA adapters have requests in flight, as vLLM 0.33 says it.

vLLM keeps the gauge in its API server's output processor (`LoRARequestStates`,
vllm/v1/metrics/stats.py): a request joins its adapter's entry with the engine events of its
first output (queued, then scheduled: so it counts from its first token, never while it only
waits) and leaves it when it finishes; an adapter with no request left is dropped. At each
engine step it logs, vLLM sets the series labelled with the adapters' names joined by commas,
in the order they entered, to the current Unix time. `waiting_lora_adapters` and
`running_lora_adapters` are the keys of two dicts filled from the same entries, so they are
always the same list, whichever state each request is in: engined reproduces that, not the
labels' names. Every label set ever set stays exposed with the time it was last current
(prometheus_client keeps every child), which is how consumers such as the Gateway API
inference extension read it: the series with the greatest value is the current one.

Unlike vLLM, the series kept are bounded (`max_series`, the least recently current dropped
first): a daemon that runs for weeks with many adapters must not grow without limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Final

from engined.core.types import RequestOutput
from engined.server.ops.prometheus_render import Row

DEFAULT_MAX_SERIES: Final = 1024


class LoraRequestsInfo:
    """The adapters in use across the daemon's ranks, and the series they have labelled.

    Args:
        max_loras: `engine.max_loras`, the `max_lora` label.
        clock: Unix seconds (injectable for tests).
        max_series: label sets kept; beyond it the least recently current goes.
    """

    def __init__(
        self,
        max_loras: int,
        *,
        clock: Callable[[], float] = time.time,
        max_series: int = DEFAULT_MAX_SERIES,
    ) -> None:
        self._max_lora = str(max_loras)
        self._clock = clock
        self._max_series = max_series
        # (rank, request id) -> adapter name: submitted, and counted (had an output).
        self._submitted: dict[tuple[int, str], str] = {}
        self._counted: dict[tuple[int, str], str] = {}
        # Adapter name -> its counted requests, in the order the adapters entered, as
        # vLLM's defaultdict.
        self._requests: dict[str, set[tuple[int, str]]] = {}
        # The joined names -> Unix time it was last current, in the order first set.
        self._series: dict[str, float] = {}

    def submitted(self, rank: int, request_id: str, lora_name: str) -> None:
        self._submitted[rank, request_id] = lora_name

    def outputs(self, rank: int, outputs: Iterable[RequestOutput]) -> None:
        """A pass's outputs, in order: a request counts from its first one with tokens (whose
        engine events, queued and scheduled, are what vLLM counts it by)."""
        submitted = self._submitted
        if not submitted:
            return
        for out in outputs:
            key = (rank, out.request_id)
            if key in submitted and out.new_token_ids:
                name = self._counted[key] = submitted.pop(key)
                self._requests.setdefault(name, set()).add(key)

    def finished(self, rank: int, request_id: str) -> None:
        key = (rank, request_id)
        self._submitted.pop(key, None)
        name = self._counted.pop(key, None)
        if name is None:
            return
        requests = self._requests[name]
        requests.discard(key)
        if not requests:
            del self._requests[name]

    def logged(self) -> None:
        """A pass was logged (vLLM's `record` of a step): the current set is current now."""
        key = ",".join(self._requests)
        series = self._series
        if key not in series and len(series) >= self._max_series:
            del series[min(series, key=series.__getitem__)]
        series[key] = self._clock()

    def rows(self) -> list[Row]:
        max_lora = self._max_lora
        return [((max_lora, key, key), at) for key, at in self._series.items()]
