"""`priority` through the `openai` client under `--scheduling-policy priority` (issue 22).

One request slot (`--max-num-seqs 1`) on a paced rank: a long stream holds it while a
low-priority and then a high-priority request queue behind it; when the stream's client goes
away (its request is cancelled), vLLM's priority policy runs the lower value first, whatever
the arrival order. About 3 s.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai

from engined.client import EngineClient
from tests.openai.api_harness import start_api
from tests.support import run

HOLD_TOKENS = 30_000


def test_priority_orders_the_queue(tmp_path: Path) -> None:
    flags = ("--speedup-ratio", "1", "--scheduling-policy", "priority", "--max-num-seqs", "1")
    with start_api(tmp_path, *flags) as api:

        async def scenario() -> list[str]:
            finished: list[str] = []
            client = openai.AsyncOpenAI(base_url=api.base_url, api_key="x", max_retries=0)
            async with client, await EngineClient.connect(api.daemon.control) as engine:
                model = (await client.models.list()).data[0].id

                async def ask(name: str, priority: int) -> None:
                    done = await client.completions.create(
                        model=model,
                        prompt=[40, 41, priority + 50],
                        max_tokens=2,
                        extra_body={"priority": priority},
                    )
                    assert done.usage is not None and done.usage.completion_tokens == 2
                    finished.append(name)

                hold = await client.completions.create(
                    model=model, prompt=[30, 31, 32], max_tokens=HOLD_TOKENS, stream=True
                )
                first = await anext(aiter(hold))
                assert first.choices[0].text
                low = asyncio.ensure_future(ask("low", 5))
                await until_waiting(engine, 1)
                high = asyncio.ensure_future(ask("high", -5))
                await until_waiting(engine, 2)
                await hold.close()
                await asyncio.gather(low, high)
                stats = await engine.wait_idle(timeout=20)
                assert [(r.running, r.waiting) for r in stats.ranks] == [(0, 0)]
            return finished

        assert run(scenario()) == ["high", "low"]


async def until_waiting(engine: EngineClient, count: int) -> None:
    """Until the rank's queue holds `count` requests (the daemon's state, polled, bounded)."""
    for _ in range(4000):
        if (await engine.stats()).ranks[0].waiting == count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the queue never held {count} requests")
