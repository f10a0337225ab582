"""`/metrics` shows a worker's replay counters as of the scrape, not as of its last heartbeat.

The unit tests drive `HttpServer`, and `Refresh` over a `RankProxy` of a stand-in worker
link (the proxy shares one request among the scrapes meanwhile); the last test runs a real
daemon with two worker processes whose heartbeats are an hour apart, so that only the
scrape's own refresh can bring the counters across.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from engined.core.types import EngineMetrics
from engined.model_clock import ModelClock
from engined.server.control.reports import Refresh
from engined.server.ops import exposition as exposition_module
from engined.server.ops.http_endpoint import HttpServer
from engined.server.ranks import rank_layouts
from engined.server.ranks import rank_wire as w
from engined.server.ranks.rank_proxy import RankProxy
from engined.wire.kv_events import seq_bytes
from tests.server.test_metrics import http_get
from tests.server.test_rank_processes import config, run, serving
from tests.support import free_tcp_port, until


class Link:
    """A rank worker as its proxy sees it: each refresh waits until `answer` is set (the
    worker's `Done`), and counts as one request sent to the worker."""

    def __init__(self) -> None:
        self.refreshes = 0
        self.answer = asyncio.Event()

    async def refresh(self, rank: int) -> None:
        self.refreshes += 1
        await self.answer.wait()


def remote(link: Link) -> RankProxy:
    ready = w.RankReady(0, None, None, None, 64, 16, 1, 1, EngineMetrics(0, 0, 0, 64, 0.0, 0, 0, 0))
    return RankProxy(link, ready, model_clock=ModelClock(0.0))  # type: ignore[arg-type]


def test_scrapes_meanwhile_share_one_refresh_and_a_later_one_asks_again() -> None:
    async def scenario() -> None:
        link = Link()
        refresh = Refresh([remote(link)])
        first = asyncio.ensure_future(refresh())
        second = asyncio.ensure_future(refresh())
        await until(lambda: link.refreshes == 1)
        assert not first.done() and not second.done()
        link.answer.set()
        await asyncio.gather(first, second)
        assert link.refreshes == 1
        await refresh()
        assert link.refreshes == 2

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_caller_that_gives_up_leaves_the_refresh_to_the_others() -> None:
    async def scenario() -> None:
        link = Link()
        refresh = Refresh([remote(link)])
        impatient = asyncio.ensure_future(asyncio.wait_for(refresh(), 0.01))
        patient = asyncio.ensure_future(refresh())
        with pytest.raises(TimeoutError):
            await impatient
        link.answer.set()
        await patient
        assert link.refreshes == 1

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_only_metrics_waits_for_the_refresh_and_never_longer_than_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A refresh that never ends (a worker that does not answer) delays a scrape by the
    bound and no more; `/health` never waits for it."""
    monkeypatch.setattr(exposition_module, "SCRAPE_REFRESH_S", 0.05)
    calls: list[str] = []
    hung = asyncio.Event()

    async def before_scrape() -> None:
        calls.append("refresh")
        await hung.wait()

    async def scenario() -> None:
        server = HttpServer(
            CollectorRegistry(), health=lambda: "serving", before_scrape=before_scrape
        )
        await server.start("127.0.0.1", 0)
        try:
            assert (await http_get(server.port, "/health")).status == 200
            assert calls == []
            assert (await http_get(server.port, "/metrics")).status == 200
            assert (await http_get(server.port, "/metrics", method="HEAD")).status == 200
            assert calls == ["refresh", "refresh"]
            assert (await http_get(server.port, "/metrics", method="POST")).status == 405
            assert calls == ["refresh", "refresh"]
        finally:
            await server.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


FLOOD = 500


def replay_refused(body: bytes, rank: int) -> int:
    match = re.search(
        rf'^engined:kv_replay_refused_total{{engine="{rank}",[^}}]*}} (\S+)$',
        body.decode(),
        re.MULTILINE,
    )
    assert match is not None, body.decode()
    return int(float(match.group(1)))


def test_a_scrape_counts_replay_refusals_made_since_the_last_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One client floods rank 0's replay ROUTER (in a worker) with requests. Each is either
    answered (an end marker: nothing is buffered) or refused, since a client may have only a
    few queued. The scrapes must account for every request, and some must be refused."""
    monkeypatch.setattr(rank_layouts, "WORKER_HEARTBEAT_S", 3600.0)
    port = free_tcp_port()

    async def scenario() -> None:
        cfg = config(tmp_path, 2, http_port=port)
        async with serving(cfg, 2) as running:
            assert running.daemon.workers
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(cfg.kv_replay_endpoint or "")
            try:
                for _ in range(FLOOD):
                    await sock.send_multipart([b"", seq_bytes(0)])
                answered = refused = 0
                while answered + refused != FLOOD:
                    while await sock.poll(0):
                        await sock.recv_multipart()
                        answered += 1
                    refused = replay_refused((await http_get(port, "/metrics")).body, 0)
                    assert answered + refused <= FLOOD
                    await asyncio.sleep(0.005)  # between looks; the loop's bound is run()'s
                assert refused > 0
                assert replay_refused((await http_get(port, "/metrics")).body, 1) == 0
            finally:
                sock.close()
                ctx.destroy(linger=0)

    run(scenario(), timeout=45)
