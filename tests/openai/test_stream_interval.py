"""vLLM's stream interval through the official `openai` client against a real daemon
(`engined serve --stream-interval 3`): a streamed choice's first output is sent at once,
then each waits until it has the interval's tokens, and its last is sent whatever it has;
a request's `stream_interval` counts only where it is above the server's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.openai.api_harness import ApiDaemon, start_api
from tests.server.daemon_harness import PACED_FLAGS

SERVER_INTERVAL = 3


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    # Paced, a token a pass every 10 ms: unpaced, a client reads many passes at once, and
    # chunks would be large with or without an interval.
    flags = [*PACED_FLAGS, "--block-size", "16", "--fixed-prefill-ms-per-token", "0"]
    tmp: Path = tmp_path_factory.mktemp("stream-interval")
    daemon: ApiDaemon
    with (
        start_api(tmp, *flags, "--stream-interval", str(SERVER_INTERVAL)) as daemon,
        openai.OpenAI(base_url=daemon.base_url, api_key="x", max_retries=0) as c,
    ):
        yield c


def streamed_sizes(
    client: openai.OpenAI, max_tokens: int, n: int = 1, **body: object
) -> dict[int, list[int]]:
    """Per choice, the tokens of each chunk (its logprobs name one entry a token)."""
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=list(range(100, 110)),
        max_tokens=max_tokens,
        n=n,
        seed=1,
        logprobs=0,
        stream=True,
        extra_body=body,
    )
    sizes: dict[int, list[int]] = {}
    for chunk in stream:
        (choice,) = chunk.choices
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        sizes.setdefault(choice.index, []).append(len(choice.logprobs.tokens))
    return sizes


def assert_paced(sizes: list[int], interval: int, total: int) -> None:
    assert sum(sizes) == total
    assert sizes[0] >= 1
    assert all(size >= interval for size in sizes[1:-1]), sizes
    # Nothing waits longer than its interval: at most one chunk per interval after the first.
    assert len(sizes) <= 1 + -(-(total - sizes[0]) // interval), sizes


@pytest.mark.parametrize(
    ("body", "interval"),
    [
        ({}, SERVER_INTERVAL),
        ({"stream_interval": 5}, 5),
        ({"stream_interval": 2}, SERVER_INTERVAL),
        # Longer than the answer: the first output, then the rest at the end.
        ({"stream_interval": 10**9}, 10**9),
    ],
)
def test_a_stream_is_sent_by_the_interval(
    client: openai.OpenAI, body: dict[str, int], interval: int
) -> None:
    (sizes,) = streamed_sizes(client, 20, **body).values()
    assert_paced(sizes, interval, 20)


def test_each_choice_keeps_its_own_interval(client: openai.OpenAI) -> None:
    by_choice = streamed_sizes(client, 13, n=2)
    assert sorted(by_choice) == [0, 1]
    for sizes in by_choice.values():
        assert_paced(sizes, SERVER_INTERVAL, 13)


def test_a_short_answer_is_sent_whole(client: openai.OpenAI) -> None:
    (sizes,) = streamed_sizes(client, 2).values()
    assert sum(sizes) == 2 and len(sizes) <= 2


def test_the_text_is_the_same_streamed_or_not(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    prompt = list(range(300, 310))
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=17, seed=4)
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=17, seed=4, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text
