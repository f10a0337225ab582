"""The indexer log check of `peers.DynamoIndexer` on hand-written logs (no peers needed).

The lines copy the shape of Dynamo 1.6.1's JSONL log (`DYN_LOGGING_JSONL=1`), including the
listener's `self.worker_id` field names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.interop.peers import DynamoIndexer


def line(level: str, message: str, **fields: Any) -> str:
    return json.dumps({"time": "t", "level": level, "message": message, **fields})


def gap(expected: int, got: int, rank: int = 0) -> str:
    return line(
        "WARN",
        f"Gap detected: expected seq {expected}, got {got}",
        expected=expected,
        got=got,
        **{"self.dp_rank": rank, "self.worker_id": 1},
    )


def request(start: int, end: int, rank: int = 0) -> str:
    return line(
        "INFO",
        "Requesting replay from engine",
        start_seq=start,
        end_seq=end,
        **{"self.dp_rank": rank, "self.worker_id": 1},
    )


def complete(replayed: int, rank: int = 0) -> str:
    return line("INFO", "Replay complete", dp_rank=rank, replayed=replayed, worker_id=1)


def problems(tmp_path: Path, *lines: str) -> list[str]:
    indexer = DynamoIndexer(Path("unused"), tmp_path, "ix", block_size=16)
    indexer.log_path.write_text("\n".join(lines) + "\n")
    return indexer.log_problems()


def test_recovered_gaps_are_clean(tmp_path: Path) -> None:
    log = [
        line("INFO", "ZMQ listener starting", dp_rank=0, worker_id=1),
        gap(0, 18),
        request(0, 18),
        complete(45),
        gap(0, 9, rank=1),
        request(0, 9, rank=1),
        complete(9, rank=1),
    ]
    assert problems(tmp_path, *log) == []
    indexer = DynamoIndexer(Path("unused"), tmp_path, "ix", block_size=16)
    assert indexer.recovered_gaps() == [(0, 0, 18), (1, 0, 9)]


@pytest.mark.parametrize(
    "log",
    [
        [gap(3, 5)],  # no replay at all
        [gap(3, 5), request(3, 5)],  # replay never completed
        [gap(3, 5), request(3, 5), complete(1)],  # replay short of the gap
        [gap(3, 5), gap(6, 8), request(6, 8), complete(2)],  # first gap never recovered
        [complete(2)],  # a replay nobody asked for
        [line("WARN", "Replay incomplete: requested=[3,5), first=none, last=none")],
        [line("WARN", "Block not published. token_ids too short: need 8, got 6")],
        [line("WARN", "Failed to find parent block; skipping store operation")],
        [line("WARN", "Failed to decode KvEventBatch: data did not match any variant")],
        [line("INFO", "No replay endpoint configured; batches lost")],
        [line("ERROR", "ZMQ listener failed", error="boom")],
        [line("WARN", "something else entirely")],
        ["Traceback (most recent call last):"],
    ],
)
def test_refused_or_lost_events_are_problems(tmp_path: Path, log: list[str]) -> None:
    assert problems(tmp_path, *log)
