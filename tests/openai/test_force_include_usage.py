"""vLLM's `--enable-force-include-usage` in a real `engined serve`, through the official
`openai` client: every streamed response ends with a usage chunk and carries usage on every
chunk, as `stream_options` with `include_usage` and `continuous_usage_stats` would, whatever
the request's own `stream_options` say (vLLM's `should_include_usage`)."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.openai.api_harness import start_api


def test_streams_carry_usage_whatever_they_ask(tmp_path: Path) -> None:
    with (
        start_api(tmp_path, "--speedup-ratio", "0", "--enable-force-include-usage") as api,
        openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client,
    ):
        for options in (None, {"include_usage": False}):
            extra = {} if options is None else {"stream_options": options}
            *deltas, last = client.completions.create(
                model="engined", prompt=[1, 2, 3, 4], max_tokens=5, stream=True, extra_body=extra
            )
            assert last.choices == [] and last.usage is not None
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 5)
            counts = [c.usage.completion_tokens for c in deltas if c.usage is not None]
            assert len(counts) == len(deltas) and counts[-1] == 5, counts
        *chunks, tail = client.chat.completions.create(
            model="engined",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
        )
        assert tail.choices == [] and tail.usage is not None
        assert tail.usage.completion_tokens == 4
        assert all(c.usage is not None for c in chunks)
        assert chunks[0].usage is not None and chunks[0].usage.completion_tokens == 0


def test_without_the_flag_a_stream_asks_for_usage(tmp_path: Path) -> None:
    with (
        start_api(tmp_path, "--speedup-ratio", "0") as api,
        openai.OpenAI(base_url=api.base_url, api_key="x", max_retries=0) as client,
    ):
        chunks = list(
            client.completions.create(model="engined", prompt=[1, 2], max_tokens=3, stream=True)
        )
        assert all(c.usage is None for c in chunks)
