"""What `engined bench` and its report share: the run's options and one request's result.

Their own module so that `engined.tools.bench` (which runs the load) and
`engined.tools.bench_report` (which summarises it) both import them and neither imports the
other's types back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engined.tools.distributions import DEFAULT_OUTPUT_LEN, DEFAULT_PROMPT_LEN, Distribution


@dataclass(frozen=True, slots=True)
class BenchOptions:
    control_endpoint: str
    concurrency: int | None = None
    rate: float | None = None
    requests: int | None = None
    duration: float | None = None
    prompt_len: Distribution = DEFAULT_PROMPT_LEN
    output_len: Distribution = DEFAULT_OUTPUT_LEN
    shared_prefix_ratio: float = 0.0
    prefix_groups: int = 1
    seed: int = 0
    # None: the daemon's, as its `welcome` announces it (1 for one at speedup 0, which has no
    # modeled clock, or one that does not say).
    speedup_ratio: float | None = None
    dp_rank: int | None = None
    timeout: float = 60.0


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it (wall seconds)."""

    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    finish_reason: str | None = None
    # None when the request completed; else the error code, `rejected` or `timeout`.
    error: str | None = None
