"""The API server processes' admission counters, in memory the daemon shares with them.

vLLM's `--max-num-queued-reqs` bounds a server's in-flight requests across all its API server
processes: each process writes its own count into a slot of a shared array, the slots a cache
line apart (no lock, and no process's writes invalidate another's line), and sums every slot
to decide (`vllm/v1/engine/admission_control.py`). engined does the same with memory the
daemon maps before it starts its API servers and each inherits as a file descriptor. A slot
also holds its process's admission rejections by reason, so that the daemon's `/metrics`
totals what every process refused (`vllm:admission_rejections`), whichever process a scrape
reaches. Every word has one writer, its process; readers may see a count a moment old, as
vLLM's do.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from typing import Final

# One slot a process: 64 bytes, a cache line, of signed 64-bit words.
SLOT_BYTES: Final = 64
_WORDS_PER_SLOT: Final = SLOT_BYTES // 8
# The words of a slot.
_REQUESTS: Final = 0
_REJECTED: Final = (1, 2)  # by reason: max_num_queued_reqs, max_num_queued_tokens


def _shared_file(size: int) -> int:
    """A descriptor of `size` zeroed bytes that no path names: a memfd where Linux has one."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None:
        fd: int = memfd_create("engined-admission")
    else:
        fd, path = tempfile.mkstemp(prefix="engined-admission-")
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd


class AdmissionCounters:
    """The slots of `processes` API server processes; this process writes slot `index`."""

    def __init__(self, fd: int, processes: int, index: int) -> None:
        if not 0 <= index < processes:
            raise ValueError(f"slot {index} of {processes}")
        self._fd = fd
        self._map = mmap.mmap(fd, processes * SLOT_BYTES)
        self._words = memoryview(self._map).cast("q")
        self._processes = processes
        self._own = index * _WORDS_PER_SLOT
        # What `rejections` answers once the memory is unmapped (a scrape during shutdown).
        self._final: tuple[int, int] | None = None

    @classmethod
    def create(cls, processes: int) -> AdmissionCounters:
        """New zeroed slots, owned by the caller (the daemon), which hands out `fd`."""
        fd = _shared_file(processes * SLOT_BYTES)
        return cls(fd, processes, 0)

    @classmethod
    def attach(cls, fd: int, processes: int, index: int) -> AdmissionCounters:
        """The slots an inherited descriptor maps, writing slot `index`."""
        return cls(fd, processes, index)

    @property
    def fd(self) -> int:
        return self._fd

    def set_requests(self, count: int) -> None:
        self._words[self._own + _REQUESTS] = count

    def requests(self) -> int:
        """In-flight requests of every process."""
        return sum(self._words[s * _WORDS_PER_SLOT + _REQUESTS] for s in range(self._processes))

    def count_rejection(self, reason: int) -> None:
        """One more refusal for `reason` (0: too many requests, 1: too many prompt tokens)."""
        word = self._own + _REJECTED[reason]
        self._words[word] += 1

    def rejections(self) -> tuple[int, int]:
        """Every process's refusals, by reason."""
        if self._final is not None:
            return self._final
        slots = range(self._processes)
        return (
            sum(self._words[s * _WORDS_PER_SLOT + _REJECTED[0]] for s in slots),
            sum(self._words[s * _WORDS_PER_SLOT + _REJECTED[1]] for s in slots),
        )

    def close(self) -> None:
        if self._final is not None:
            return
        self._final = self.rejections()
        self._words.release()
        self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
