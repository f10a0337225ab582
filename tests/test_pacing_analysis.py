"""The pacing benchmark's split of lateness into phases and its run-queue attribution.

`benchmarks/e2e_throughput.py --pacing` is run by hand; its analysis of the pass record is
pure and checked here on a synthetic record, so its printed verdicts can be trusted.
"""

from __future__ import annotations

from benchmarks.e2e_throughput import phases, queue_waits

MS = 1e6  # schedstat counts nanoseconds


def row(rank: int, at: float, late_ms: float, run_queue_ms: float, pid: int) -> list[float]:
    return [rank, at, late_ms, run_queue_ms * MS, pid]


def record() -> dict[str, list[list[float]]]:
    # Steady state starts after t=1.0 (each rank's first pass after it is still start-up) and
    # ends at t=3.0. Process 10 runs ranks 0 and 1, process 20 rank 2.
    lateness = [
        row(0, 0.5, 9.0, 0.0, 10),  # start-up
        row(0, 1.1, 0.1, 1.0, 10),  # first after t0: start-up
        row(1, 1.2, 0.1, 1.0, 10),  # first after t0: start-up
        row(2, 1.3, 0.1, 0.0, 20),  # first after t0: start-up
        row(0, 2.000, 0.2, 1.0, 10),  # on time
        # Late by 3 ms; its deadline was 1.997; the last reading before it (t=2.000 is after
        # the deadline, so t=1.2) shows 1.0 ms; 3.0 ms now: 2.0 >= 1.5, the machine's.
        row(1, 2.000 + 1e-6, 3.0, 3.0, 10),
        # Late by 4 ms in process 20, which waited 0.5 ms: the daemon's own.
        row(2, 2.100, 4.0, 0.5, 20),
        row(0, 3.500, 5.0, 50.0, 10),  # drain: not counted
    ]
    states = [[0, 1.0, 4, 0], [1, 1.0, 4, 0], [2, 1.0, 4, 0]]
    return {"lateness": lateness, "states": states}


def test_late_steady_passes_are_split_by_their_run_queue_wait() -> None:
    log = record()
    t0, split = phases(log, target=12, drain=3.0)
    assert t0 == 1.0
    assert split["steady"] == {0: [0.2], 1: [3.0], 2: [4.0]}
    assert split["start-up"] == {0: [9.0, 0.1], 1: [0.1], 2: [0.1]}
    assert split["drain"] == {0: [5.0], 1: [], 2: []}
    assert queue_waits(log, t0, 3.0) == (2, 1)


def test_a_late_pass_with_no_reading_before_its_deadline_is_not_attributed() -> None:
    # Its deadline is 1.997; the process's only earlier reading (1.998, its first pass after
    # t0) is after it, so the wait cannot be placed before the pass.
    log = {
        "lateness": [row(0, 1.998, 0.1, 0.0, 10), row(0, 2.0, 3.0, 99.0, 10)],
        "states": [[0, 1.0, 1, 0]],
    }
    assert queue_waits(log, 1.0, 3.0) == (1, 0)


def test_records_without_run_queue_readings_give_no_verdict() -> None:
    old = {"lateness": [[0, 2.0, 3.0]], "states": [[0, 1.0, 1, 0]]}
    assert queue_waits(old, 1.0, 3.0) is None
    no_schedstat = {"lateness": [row(0, 2.0, 3.0, -1e-6, 10)], "states": []}
    assert queue_waits(no_schedstat, 1.0, 3.0) is None
