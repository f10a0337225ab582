"""An OpenAI request's engine requests, closed before their outputs were read (its client
left, or a stream stopped early): the API server process keeps nothing of them. Against a
real daemon (unpaced, so that the requests finish with their outputs still queued)."""

from __future__ import annotations

from pathlib import Path

from engined.client import EngineClient
from engined.openai.generation import Generation, Sample
from tests.server.daemon_harness import start_daemon
from tests.support import run


def test_a_generation_closed_unread_leaves_no_outputs_behind(tmp_path: Path) -> None:
    """Both samples finish in the daemon while nobody reads them; their cancels then find
    nothing to cancel (`noop`), and the queued outputs are dropped all the same."""

    async def scenario(control: str) -> None:
        async with await EngineClient.connect(control) as client:
            samples = [
                Sample(request_id=f"{j}_unread", choice_index=j, prompt_ids=[1] * 20, max_tokens=8)
                for j in range(2)
            ]
            generation = Generation(client, samples)
            await generation.start()
            await client.wait_idle(timeout=30)
            assert client.open_streams == 2
            await generation.close()
            assert client.open_streams == 0
            # A generation read to its end leaves nothing either.
            read = Generation(client, [Sample("read", 0, [2] * 20, 4)])
            await read.start()
            deltas = [delta async for batch in read.deltas() for delta in batch]
            assert deltas[-1].finished and client.open_streams == 0
            await read.close()

    with start_daemon(tmp_path, "--speedup-ratio", "0") as daemon:
        run(scenario(daemon.control))
