"""The capacity generation of one engine: bumped whenever KV capacity may have improved.

A pending destination that failed to reserve its KV is retried only after the generation
moved (engined/core/commands.py), so a decode worker neither spins on a full pool nor waits a
pass once room appears. The parts that free capacity (completion, drops, preemption,
releases, landed onboards) share one instance.
"""

from __future__ import annotations


class CapacityGeneration:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1
