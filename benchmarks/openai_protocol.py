"""OpenAI protocol costs per request and per streamed token, on one core.

What an API server process spends in `engined.openai` alone: decoding a typical completion
and chat body, and building and encoding one SSE chunk of one token (the serving layer does
this once per engine pass per stream), with and without logprobs. Run by hand:

    .venv/bin/python benchmarks/openai_protocol.py [--rounds 200000]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from engined.openai.logprobs import chat_logprobs
from engined.openai.protocol import decode_chat_request, decode_completion_request
from engined.openai.protocol_responses import (
    ENCODE,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    sse,
)

COMPLETION_BODY = json.dumps(
    {
        "model": "Qwen/Qwen3-0.6B",
        "prompt": "word " * 200,
        "max_tokens": 128,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.7,
    }
).encode()
CHAT_BODY = json.dumps(
    {
        "model": "Qwen/Qwen3-0.6B",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "word " * 200},
        ],
        "max_completion_tokens": 128,
        "stream": True,
    }
).encode()


def completion_chunk() -> bytes:
    choice = CompletionResponseStreamChoice(index=0, text=" word")
    chunk = CompletionStreamResponse(
        id="cmpl-0123456789abcdef0123456789abcdef", created=1, model="m", choices=[choice]
    )
    return sse(ENCODE(chunk))


def chat_chunk() -> bytes:
    choice = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content=" word"))
    chunk = ChatCompletionStreamResponse(
        id="chatcmpl-0123456789abcdef0123456789abcdef", created=1, model="m", choices=[choice]
    )
    return sse(ENCODE(chunk))


def chat_chunk_logprobs() -> bytes:
    logprobs = chat_logprobs(
        [7], 3, 5, key=11, vocab_size=151_936, decode=lambda ids: [f" w{i}" for i in ids]
    )
    choice = ChatCompletionResponseStreamChoice(
        index=0, delta=DeltaMessage(content=" word"), logprobs=logprobs
    )
    chunk = ChatCompletionStreamResponse(
        id="chatcmpl-0123456789abcdef0123456789abcdef", created=1, model="m", choices=[choice]
    )
    return sse(ENCODE(chunk))


def measure(name: str, work: Callable[[], object], rounds: int) -> None:
    work()
    start = time.perf_counter()
    for _ in range(rounds):
        work()
    elapsed = time.perf_counter() - start
    print(f"{name:<36} {elapsed / rounds * 1e6:8.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200_000)
    rounds = parser.parse_args().rounds
    measure("decode completion body", lambda: decode_completion_request(COMPLETION_BODY), rounds)
    measure("decode chat body", lambda: decode_chat_request(CHAT_BODY), rounds)
    measure("completion chunk (build + encode)", completion_chunk, rounds)
    measure("chat chunk (build + encode)", chat_chunk, rounds)
    measure("chat chunk, top-5 logprobs", chat_chunk_logprobs, rounds // 10)


if __name__ == "__main__":
    main()
