"""What an HTTP API key may be, and reading keys from `api_key_file`.

A key must be something a request can carry in `Authorization: Bearer KEY`: printable ASCII
(the HTTP server refuses any other byte in a request head), no space at either end (header
values are trimmed) and short enough for the 16 KiB head. A key no request could send would
lock the API for good, so it is refused at start-up instead. Messages name a key by its
position and never quote it: they reach terminals and journals.

The file is refused when other users may read it (the point of a file is that the secret is
not on a command line or in the world-readable config file the units need) or write it (they
could put in a key of their own), and when it is not a regular file, so that neither a FIFO
nor a device can stall or flood start-up.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

MAX_KEY_CHARS = 4096
MAX_KEY_FILE_BYTES = 64 * 1024


def key_problem(key: str) -> str | None:
    """Why no request could carry `key`, or None when one can."""
    if not key:
        return "is empty"
    if len(key) > MAX_KEY_CHARS:
        return f"is {len(key)} characters long, more than {MAX_KEY_CHARS}"
    if not all(" " <= char <= "~" for char in key):
        return "has a character a request header cannot carry (printable ASCII only)"
    if key[0] == " " or key[-1] == " ":
        return "starts or ends with a space, which request headers lose"
    return None


def read_key_file(path: str) -> tuple[str, ...]:
    """The keys of `path`, one per non-blank line (surrounding white space dropped).

    Raises:
        ValueError: why the file cannot be used, naming the path (and the line).
    """
    try:
        data = read_private(path)
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"{path} is larger than {MAX_KEY_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key:
            continue
        problem = key_problem(key)
        if problem is not None:
            raise ValueError(f"{path} line {number}: the key {problem}")
        keys.append(key)
    if not keys:
        raise ValueError(f"{path} holds no key")
    return tuple(keys)


def read_private(path: str) -> bytes:
    """Up to one byte more than `MAX_KEY_FILE_BYTES` of `path`, judged by the opened file
    itself (not the name, which could be swapped between a check and the read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
        others = [
            what
            for bit, what in ((stat.S_IROTH, "read"), (stat.S_IWOTH, "written"))
            if info.st_mode & bit
        ]
        if others:
            raise ValueError(
                f"{path} can be {' and '.join(others)} by every user "
                f"(mode {stat.S_IMODE(info.st_mode):04o}); make it 0600 or 0640"
            )
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_KEY_FILE_BYTES:
            chunk = os.read(fd, MAX_KEY_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


# vLLM's guarded paths (`vllm/entrypoints/serve/middleware/authenticate.py` in 0.33): plain
# string prefixes of the decoded path, so `/v1x` is one too.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


class BearerKeys:
    """vLLM's API key rule, for every HTTP server engined runs (/metrics, the OpenAI API).

    A guarded path needs `Authorization: Bearer KEY` with one of the keys, whatever the
    method but OPTIONS (CORS preflights); `/metrics` only with `guard_metrics` (an engined
    extension: vLLM leaves it open). Keys are kept as digests and every one is compared in
    constant time, so the time taken tells neither which key nor how much of one matched.
    """

    def __init__(self, keys: tuple[str, ...] | list[str], *, guard_metrics: bool = False):
        self._digests = tuple(hashlib.sha256(key.encode()).digest() for key in keys)
        self.guard_metrics = guard_metrics and bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def authorized(self, method: str, path: str, authorization: str) -> bool:
        """Whether a request may proceed; `path` percent-decoded, without its query."""
        if not self._digests or method == "OPTIONS":
            return True
        guarded = path.startswith(GUARDED_PREFIXES) or (self.guard_metrics and path == "/metrics")
        return not guarded or self._matches(authorization)

    def _matches(self, authorization: str) -> bool:
        """`Bearer KEY`: the scheme in any case, one space, the rest verbatim."""
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(credentials.encode()).digest()
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(digest, known)
        return matched
