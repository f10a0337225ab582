"""The pause parity scenarios: vLLM's `pause_generation` in each mode, requests submitted
while paused, and `resume_scheduler` mid-run (EngineCoreProc's pause, vllm/v1/engine/core.py).

`abort` ends every request and sets PAUSED_NEW; `wait` sets PAUSED_NEW, so the running
requests drain while the queued ones (and those arriving) stay queued; `keep` sets
PAUSED_ALL, so nothing is scheduled. A pause completes when the engine has no work (at once
when idle), and with `clear_cache` then preempts the running requests and resets the prefix
cache: after `resume` the same prompts find nothing cached.
"""

from __future__ import annotations

import random

from parity.random_mix import random_tokens
from parity.scenario import Config, Control, Scenario, ScenarioRequest, asynchronous

_CONFIG = Config(num_gpu_blocks=96, max_num_batched_tokens=128, max_num_seqs=4)


def _requests(seed: int, prefix: list[int], arrivals: list[int]) -> list[ScenarioRequest]:
    """Requests sharing `prefix` (so a cleared cache shows), one per arrival step."""
    rng = random.Random(seed)
    return [
        ScenarioRequest(
            id=f"r{i}",
            arrival=arrival,
            prompt=prefix + random_tokens(rng, 24 + 8 * (i % 3)),
            max_tokens=12 + 4 * (i % 4),
        )
        for i, arrival in enumerate(arrivals)
    ]


def pause(mode: str, *, clear_cache: bool = True, resume_at: int = 30) -> Scenario:
    """Eight requests (at most 4 running), paused at step 6 with some running and some
    queued, two more arriving while paused, resumed at `resume_at`; with `resume_at` early
    (`wait`), the resume comes before the running requests drained, and the pause still
    completes (clears the cache) once they have."""
    name = f"pause-{mode}" + ("" if clear_cache else "-keep-cache")
    if resume_at < 20:
        name += "-early-resume"
    what = {
        "abort": "ends every request",
        "wait": "lets the running drain",
        "keep": "freezes everything",
    }[mode]
    return _scenario(
        name,
        f"pause {mode} at step 6 ({what}"
        + (", cache kept" if not clear_cache else ", cache cleared")
        + f"), 2 arrivals while paused, resume at step {resume_at}",
        seed=30,
        prefix_len=32,
        arrivals=[0, 0, 0, 1, 2, 3, 4, 5, 8, 9],
        controls=[
            Control(step=6, kind="pause", mode=mode, clear_cache=clear_cache),
            Control(step=resume_at, kind="resume"),
        ],
    )


def _scenario(
    name: str,
    description: str,
    *,
    seed: int,
    prefix_len: int,
    arrivals: list[int],
    controls: list[Control],
) -> Scenario:
    """Requests sharing a prefix of `prefix_len` tokens drawn with `seed` (their own with
    seed + 1), one per arrival step, under `controls`."""
    prefix = random_tokens(random.Random(seed), prefix_len)
    return Scenario(
        name=name,
        description=description,
        config=_CONFIG,
        requests=_requests(seed + 1, prefix, arrivals),
        controls=controls,
    )


def pause_idle() -> Scenario:
    """A pause of an idle engine completes at once: its cache is cleared before the next
    request arrives, and that request queues until the resume."""
    return _scenario(
        "pause-idle",
        "4 requests, idle pause (wait) at step 40 clears the cache, "
        "2 arrivals queue until resume at step 45",
        seed=40,
        prefix_len=48,
        arrivals=[0, 0, 1, 2, 42, 43],
        controls=[
            Control(step=40, kind="pause", mode="wait"),
            Control(step=45, kind="resume"),
        ],
    )


def reset_running() -> Scenario:
    """vLLM's `reset_prefix_cache(reset_running_requests=True)` mid-run, unpaused: every
    running request preempted (last first) and the cache cleared, then re-admitted in order
    and recomputed from nothing cached."""
    return _scenario(
        "reset-running",
        "reset_prefix_cache(reset_running_requests=True) at step 7, 4 running and 4 queued",
        seed=50,
        prefix_len=32,
        arrivals=[0, 0, 0, 1, 2, 3, 4, 5, 9],
        controls=[Control(step=7, kind="reset_running")],
    )


def release_kv_cache() -> Scenario:
    """`release_kv_cache_memory()` after a `keep` pause that kept the cache: the frozen
    running requests preempted and the cache cleared, then `wake_up(["kv_cache"])` resumes."""
    return _scenario(
        "release-kv-cache",
        "pause keep at step 6 (cache kept), release_kv_cache_memory at step 8, "
        "wake_up kv_cache at step 12",
        seed=60,
        prefix_len=32,
        arrivals=[0, 0, 0, 1, 2, 3, 9, 10],
        controls=[
            Control(step=6, kind="pause", mode="keep", clear_cache=False),
            Control(step=8, kind="release"),
            Control(step=12, kind="wake_up"),
        ],
    )


def pause_scenarios() -> list[Scenario]:
    return [
        pause("abort"),
        pause("wait"),
        pause("keep"),
        pause("keep", clear_cache=False),
        pause("wait", clear_cache=False),
        pause("wait", resume_at=10),
        pause_idle(),
        reset_running(),
        release_kv_cache(),
        # Under the AsyncScheduler: a pause also waits for the batch in flight.
        asynchronous(pause("abort")),
        asynchronous(pause("wait")),
        asynchronous(pause("keep")),
        asynchronous(pause("wait", resume_at=10)),
        asynchronous(pause_idle()),
        asynchronous(release_kv_cache()),
        asynchronous(reset_running()),
    ]
