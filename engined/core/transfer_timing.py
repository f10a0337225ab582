"""The modelled KV transfer of a P/D handoff: one formula, one timing record.

Kept out of engined.core.types (which re-exports it) so that module stays within its size.
The record is also the control protocol's `transfer_timing` (engined.wire.messages
re-exports it): what the core holds is what a `source_held` event carries.
"""

from __future__ import annotations

import enum

import msgspec


class KvTransferTimingMode(enum.StrEnum):
    FULL_PROMPT = "full_prompt"
    DESTINATION_MISSING = "destination_missing"


class TransferTiming(msgspec.Struct, frozen=True):
    """How the coordinator models a held source's KV transfer (PROTOCOL.md §1.7).

    The delay is `tokens * kv_bytes_per_token / (bandwidth_gb_s * 1e9)` seconds, where
    `tokens` is `full_prompt_tokens` in `full_prompt` mode and the destination's
    `transferable_prompt_tokens` (what its prefix cache lacks) in `destination_missing`
    mode; no delay is modelled while either figure is null (or the bandwidth <= 0).
    """

    mode: KvTransferTimingMode
    full_prompt_tokens: int
    kv_bytes_per_token: int | None
    bandwidth_gb_s: float | None

    def delay_ms(self, destination_missing_tokens: int) -> float | None:
        """Transfer time for the tokens the mode says must move, or None when unmodelled.

        Upstream's `HandoffTransferTiming::delay_ms`: `full_prompt` moves the whole prompt,
        `destination_missing` the tokens the destination lacks (its reservation's
        `transferable_prompt_tokens`). The coordinator of a handoff calls it once it has
        both the source's `SourceHeld` and the destination's `DestinationReserved`.
        """
        tokens = (
            self.full_prompt_tokens
            if self.mode is KvTransferTimingMode.FULL_PROMPT
            else destination_missing_tokens
        )
        return kv_transfer_ms(tokens, self.kv_bytes_per_token, self.bandwidth_gb_s)


def kv_transfer_ms(
    tokens: int, kv_bytes_per_token: int | None, bandwidth_gb_s: float | None
) -> float | None:
    """The modeled time to move `tokens` of KV, or None when the transfer is unmodelled.

    The one formula of every KV transfer delay (upstream `compute_kv_transfer_delay`):
    `tokens * bytes_per_token / (GB/s * 1e9)`, in ms; None without `kv_bytes_per_token` or
    with a bandwidth unset or <= 0.
    """
    if kv_bytes_per_token is None or not bandwidth_gb_s or bandwidth_gb_s <= 0:
        return None
    return tokens * kv_bytes_per_token / (bandwidth_gb_s * 1e9) * 1000.0
