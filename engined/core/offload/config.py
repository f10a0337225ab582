"""Offload tier configuration: upstream `KvbmOffloadConfig` (dynamo-mocker 1.3.0, `config.rs`).

Defaults are upstream's. `from_args` reproduces upstream's rule for when an engine gets an
offload tier at all, and its two refusals verbatim. G4 (object storage) is not modelled: a
configuration asking for it is refused rather than silently run without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engined.core.args import EngineArgs
from engined.core.errors import InvalidArgsError

DEFAULT_NUM_G2_BLOCKS = 100_000
DEFAULT_BLOCK_SIZE_TOKENS = 64
DEFAULT_OFFLOAD_BATCH_SIZE = 32
DEFAULT_G1_G2_GBPS = 14.0
DEFAULT_G2_G3_GBPS = 7.0

G3_NEEDS_G2 = "G3/G4 offload requires num_g2_blocks because mocker stages lower tiers through G2"
G3_NEEDS_BYTES = "G3/G4 offload requires kv_bytes_per_token so mocker can size lower-tier transfers"
G4_UNSUPPORTED = (
    "enable_g4_storage is not supported: engined models the G2 (host) and G3 (disk) tiers only"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class OffloadConfig:
    """Shape and speed of the lower tiers of one engine.

    `block_size_bytes` None means upstream's sentinel 0: every transfer carries no bytes and
    completes at the first tick at or after its start. A bandwidth <= 0 is infinite.
    `offload_batch_size` is both the G1->G2 batch size and the number of G1->G2 batches that
    may be in flight at once, as upstream wires its pipeline.
    """

    num_g2_blocks: int = DEFAULT_NUM_G2_BLOCKS
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
    offload_batch_size: int = DEFAULT_OFFLOAD_BATCH_SIZE
    num_g3_blocks: int | None = None
    block_size_bytes: int | None = None
    bandwidth_g1_to_g2_gbps: float = DEFAULT_G1_G2_GBPS
    bandwidth_g2_to_g1_gbps: float = DEFAULT_G1_G2_GBPS
    bandwidth_g2_to_g3_gbps: float = DEFAULT_G2_G3_GBPS
    bandwidth_g3_to_g2_gbps: float = DEFAULT_G2_G3_GBPS

    def __post_init__(self) -> None:
        # `key` is the EngineArgs field `from_args` fills each one from.
        for name, key in (
            ("num_g2_blocks", "num_g2_blocks"),
            ("block_size_tokens", "block_size"),
            ("offload_batch_size", "offload_batch_size"),
        ):
            if getattr(self, name) < 1:
                raise InvalidArgsError(
                    f"offload {name} must be >= 1, got {getattr(self, name)}", key=key
                )
        if self.num_g3_blocks is not None and self.num_g3_blocks < 1:
            raise InvalidArgsError(
                f"offload num_g3_blocks must be >= 1, got {self.num_g3_blocks}",
                key="num_g3_blocks",
            )
        if self.block_size_bytes is not None and self.block_size_bytes < 0:
            # NOTE: block_size * kv_bytes_per_token, and block_size is >= 1 by then.
            raise InvalidArgsError(
                f"offload block_size_bytes must be >= 0, got {self.block_size_bytes}",
                key="kv_bytes_per_token",
            )
        for link in ("g1_to_g2", "g2_to_g1", "g2_to_g3", "g3_to_g2"):
            name = f"bandwidth_{link}_gbps"
            if math.isnan(getattr(self, name)):
                raise InvalidArgsError(f"offload {name} must be a number", key=name)

    @property
    def block_bytes(self) -> int:
        """Bytes moved per block; upstream's `block_size_bytes.unwrap_or(0)`."""
        return self.block_size_bytes or 0

    @classmethod
    def from_args(cls, args: EngineArgs) -> OffloadConfig | None:
        """The offload tiers `args` ask for, or None when the engine runs without them.

        Upstream attaches an offload engine only when `num_g2_blocks > 0` and
        `kv_bytes_per_token` is set; G3 without either of them is an error, not a silent
        downgrade. `args` should be `normalized()` (its `block_size` is the block size).

        Raises:
            InvalidArgsError: G3 without G2 or without `kv_bytes_per_token` (upstream's
                messages), or `enable_g4_storage`, which engined does not model.
        """
        num_g3_blocks = args.num_g3_blocks if args.num_g3_blocks else None
        lower_tier = num_g3_blocks is not None or args.enable_g4_storage
        if args.num_g2_blocks is None:
            if lower_tier:
                raise InvalidArgsError(G3_NEEDS_G2, key="num_g2_blocks")
            return None
        if args.num_g2_blocks == 0:
            return None
        if args.kv_bytes_per_token is None:
            if lower_tier:
                raise InvalidArgsError(G3_NEEDS_BYTES, key="kv_bytes_per_token")
            return None
        if args.enable_g4_storage:
            raise InvalidArgsError(G4_UNSUPPORTED, key="enable_g4_storage")

        def bandwidth(value: float | None, default: float) -> float:
            return default if value is None else value

        return cls(
            num_g2_blocks=args.num_g2_blocks,
            block_size_tokens=args.block_size,
            offload_batch_size=args.offload_batch_size or DEFAULT_OFFLOAD_BATCH_SIZE,
            num_g3_blocks=num_g3_blocks,
            block_size_bytes=args.block_size * args.kv_bytes_per_token,
            bandwidth_g1_to_g2_gbps=bandwidth(args.bandwidth_g1_to_g2_gbps, DEFAULT_G1_G2_GBPS),
            bandwidth_g2_to_g1_gbps=bandwidth(args.bandwidth_g2_to_g1_gbps, DEFAULT_G1_G2_GBPS),
            bandwidth_g2_to_g3_gbps=bandwidth(args.bandwidth_g2_to_g3_gbps, DEFAULT_G2_G3_GBPS),
            bandwidth_g3_to_g2_gbps=bandwidth(args.bandwidth_g3_to_g2_gbps, DEFAULT_G2_G3_GBPS),
        )
