"""Parsers of the operator commands' option values, light enough for `engined --help`.

They raise ValueError with a message naming what is wrong; the CLI turns that into typer's
"Invalid value for '--option'" and exit code 2, so every bad value is reported the same way.
"""

from __future__ import annotations

import math
from typing import Final

from engined.config import ConfigError, endpoint_for_rank

# The daemon's default control endpoint (`serve --control-endpoint`).
DEFAULT_CONTROL_ENDPOINT: Final = "tcp://127.0.0.1:5555"
# Long enough for a loaded daemon to answer, short enough that a missing one is noticed soon.
DEFAULT_TIMEOUT: Final = 10.0


def check_endpoint(text: str) -> str:
    """A `tcp://HOST:PORT` or `ipc://PATH` endpoint to connect to.

    The daemon's own parser judges it, so the commands accept exactly the endpoints `serve`
    binds; anything else would only fail later inside ZeroMQ with a less helpful message.
    """
    try:
        return endpoint_for_rank(text, 0)
    except ConfigError as error:
        raise ValueError(str(error).removeprefix("invalid endpoint ")) from None


def parse_token_list(text: str) -> list[int]:
    """`"1,2,3"` (spaces allowed) as token ids; the message names the bad item."""
    tokens: list[int] = []
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        try:
            tokens.append(int(item))
        except ValueError:
            raise ValueError(f"{item!r} is not a token id (expected e.g. 1,2,3)") from None
    if not tokens:
        raise ValueError("no token ids given (expected e.g. 1,2,3)")
    return tokens


def positive_float(value: str | float) -> float:
    """A finite number > 0 (seconds, rates, ratios)."""
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number") from None
    if not number > 0 or math.isinf(number):
        raise ValueError(f"{value!r} must be a finite number > 0")
    return number
