"""Disaggregated prefill/decode the llm-d way: vLLM's NIXL `kv_transfer_params` on handoffs.

llm-d's routing sidecar sends the prefill pod the request with `max_tokens: 1`, `stream:
false` and `kv_transfer_params: {"do_remote_decode": true}`, then sends the decode pod the
original request with the `kv_transfer_params` the prefill's response carried. vLLM's NIXL
connector answers the prefill with what the decode side needs to pull the prompt's blocks
(`remote_request_id`, `remote_host`, `remote_port`, ...). engined maps that onto its handoff
(protocol §1.7, engined.client.handoff_coordinator): the prefill runs as a handoff source, and the
`remote_*` keys name the handoff and the prefill daemon's control endpoint; the decode
reserves a destination, waits out the modelled transfer, releases the source and decodes.

What vLLM's keys cannot say (the source's transfer timing and speedup, the request whose
tokens the decode continues) travels under an extra key, `engined`, which vLLM's connector
never reads and routers forward untouched. The handoff id is `remote_request_id`: vLLM's
decode names the prefill's request by it when it tells the prefill to free the blocks,
which is what `release_source` does. It is a fresh uuid, since a handoff id is a
capability (§1.7) and request ids are the client's choice.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import zmq

from engined.client import EngineClient
from engined.client.handoff_coordinator import (
    Coordinator,
    DestinationRequest,
    HandoffFailed,
    held_source,
    transfer_wait_s,
)
from engined.config.endpoints import WILDCARD_HOSTS, parse_endpoint
from engined.model_clock import ModelClock
from engined.openai.api_errors import ApiError, validation_error
from engined.wire.control import (
    DestinationAccepted,
    Submitted,
    TransferTiming,
    WireLoraRequest,
)

# The extra key of engined's own parameters inside `kv_transfer_params`.
EXTRA_KEY: Final = "engined"
# vLLM's variable for the host a NIXL peer reaches this pod at (llm-d sets the pod's IP).
SIDE_CHANNEL_HOST_ENV: Final = "VLLM_NIXL_SIDE_CHANNEL_HOST"
# vLLM's default for it.
DEFAULT_SIDE_CHANNEL_HOST: Final = "localhost"
# How long a prefill daemon the decode side has not talked to yet gets to answer.
HANDSHAKE_TIMEOUT_S: Final = 5.0
_HANDOFF_ID_MAX: Final = 256


@dataclass(frozen=True, slots=True)
class Advertised:
    """Where another pod's API server reaches this daemon's control endpoint."""

    host: str
    port: int

    @property
    def endpoint(self) -> str:
        if self.host.startswith("ipc://"):
            return self.host
        return f"tcp://{self.host}:{self.port}"


def advertised(control_endpoint: str, env: Mapping[str, str] = os.environ) -> Advertised:
    """`VLLM_NIXL_SIDE_CHANNEL_HOST` and the control port, as vLLM advertises its side channel.

    Unset, a tcp endpoint's own host, or vLLM's `localhost` for a wildcard one; an ipc
    endpoint (one machine only) is given whole as the host, with port 0.
    """
    endpoint = parse_endpoint(control_endpoint)
    if endpoint.scheme == "ipc":
        return Advertised(str(endpoint), 0)
    host = env.get(SIDE_CHANNEL_HOST_ENV) or (
        DEFAULT_SIDE_CHANNEL_HOST if endpoint.where in WILDCARD_HOSTS else endpoint.where
    )
    return Advertised(host, endpoint.port)


@dataclass(frozen=True, slots=True)
class PrefillRole:
    """`do_remote_decode`: run the prompt as a handoff source and answer with the params."""

    handoff_id: str


@dataclass(frozen=True, slots=True)
class DecodeRole:
    """`do_remote_prefill`: pull the handoff from the prefill daemon, then decode."""

    handoff_id: str
    endpoint: str
    request_id: str | None
    timing: TransferTiming | None
    handoff_delay_ms: float
    speedup_ratio: float
    cached_tokens: int | None


Role = PrefillRole | DecodeRole


def _field(name: str) -> str:
    return f"kv_transfer_params.{name}"


def _refuse(name: str, expected: str, value: object) -> ApiError:
    shown = repr(value)
    if len(shown) > 100:
        shown = shown[:100] + "..."
    return validation_error(f"{_field(name)}: expected {expected}, got {shown}", param=_field(name))


def _flag(params: Mapping[str, Any], name: str) -> bool:
    value = params.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _refuse(name, "a boolean", value)
    return value


def parse_role(params: Mapping[str, Any] | None) -> Role | None:
    """The request's part in a handoff; None for an ordinary request (vLLM's reading: only
    `do_remote_decode` or `do_remote_prefill` make one)."""
    if not params:
        return None
    decode = _flag(params, "do_remote_decode")
    prefill = _flag(params, "do_remote_prefill")
    if decode and prefill:
        raise validation_error(
            f"{_field('do_remote_decode')} and {_field('do_remote_prefill')} cannot both be true",
            param=_field("do_remote_prefill"),
        )
    if decode:
        return PrefillRole(uuid.uuid4().hex)
    if not prefill:
        return None
    handoff_id = params.get("remote_request_id")
    if not isinstance(handoff_id, str) or not 0 < len(handoff_id.encode()) <= _HANDOFF_ID_MAX:
        raise _refuse("remote_request_id", "the prefill's handoff id (1-256 bytes)", handoff_id)
    host = params.get("remote_host")
    if not isinstance(host, str) or not host or len(host) > 1024:
        raise _refuse("remote_host", "the prefill daemon's host", host)
    port = params.get("remote_port")
    ipc = host.startswith("ipc://")
    if not isinstance(port, int) or isinstance(port, bool) or not (ipc or 0 < port < 65536):
        raise _refuse("remote_port", "the prefill daemon's control port", port)
    extra = params.get(EXTRA_KEY)
    if not isinstance(extra, dict):
        raise validation_error(
            f"{_field(EXTRA_KEY)}: missing; these kv_transfer_params come from a prefill "
            "server that is not engined",
            param=_field(EXTRA_KEY),
        )
    return DecodeRole(
        handoff_id=handoff_id,
        endpoint=Advertised(host, port).endpoint,
        request_id=_request_id(extra),
        timing=_timing(extra),
        handoff_delay_ms=_number(extra, "handoff_delay_ms"),
        speedup_ratio=_number(extra, "speedup_ratio"),
        cached_tokens=_cached(params),
    )


def _request_id(extra: Mapping[str, Any]) -> str | None:
    value = extra.get("request_id")
    if value is not None and (not isinstance(value, str) or not 0 < len(value.encode()) <= 256):
        raise _refuse(f"{EXTRA_KEY}.request_id", "a request id (1-256 bytes) or null", value)
    return value


def _timing(extra: Mapping[str, Any]) -> TransferTiming | None:
    raw = extra.get("transfer_timing")
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, TransferTiming)
    except msgspec.ValidationError as exc:
        name = _field(f"{EXTRA_KEY}.transfer_timing")
        raise validation_error(f"{name}: {exc}", param=name) from None


def _number(extra: Mapping[str, Any], name: str) -> float:
    value = extra.get(name)
    if value is None:
        return 0.0
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < 1e18:
        raise _refuse(f"{EXTRA_KEY}.{name}", "a number >= 0", value)
    return float(value)


def _cached(params: Mapping[str, Any]) -> int | None:
    """vLLM's decode reports the prefill's cached tokens when they are an int, else its own."""
    value = params.get("remote_prefill_cached_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def transfer_failed(reason: str) -> ApiError:
    """A KV pull that failed: vLLM's default `kv_load_failure_policy` ("fail") ends the
    request with an error, a 500; the message says why."""
    return ApiError(500, f"KV transfer failed: {reason}", "InternalServerError")


@dataclass(frozen=True, slots=True)
class Disaggregation:
    """What one API server process needs for handoffs: its coordinator and its address."""

    handoffs: Coordinator
    advertised: Advertised
    block_size: int
    # The daemon's, which the decode side divides the modelled transfer by.
    speedup_ratio: float

    async def start_prefill(
        self,
        client: EngineClient,
        role: PrefillRole,
        token_ids: list[int],
        *,
        request_id: str,
        seed: int | None,
        priority: int,
        cache_salt: str | None = None,
        lora_request: WireLoraRequest | None = None,
    ) -> Submitted:
        """The prompt as a handoff source, one token long (llm-d's prefill asks for one), with
        the request's salt and the adapter it names (its blocks are salted and the adapter's,
        as the decode's are)."""
        return await client.submit_handoff_prefill(
            role.handoff_id,
            token_ids,
            1,
            request_id=request_id,
            seed=seed,
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )

    async def finish_prefill(
        self,
        client: EngineClient,
        role: PrefillRole,
        submitted: Submitted,
        prompt_tokens: int,
        cached_tokens: int | None,
    ) -> dict[str, Any]:
        """The response's `kv_transfer_params`, once the source is held; vLLM's NIXL keys."""
        try:
            held = await held_source(client, role.handoff_id)
        except HandoffFailed as exc:
            raise transfer_failed(str(exc)) from None
        timing = None if held is None else held.transfer_timing
        blocks = -(-prompt_tokens // self.block_size)
        ours: dict[str, Any] = {
            "request_id": submitted.request_id,
            "dp_rank": submitted.dp_rank,
            "transfer_timing": None if timing is None else msgspec.to_builtins(timing),
            "speedup_ratio": self.speedup_ratio,
        }
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(blocks))],
            "remote_engine_id": self.advertised.endpoint,
            "remote_request_id": role.handoff_id,
            "remote_host": self.advertised.host,
            "remote_port": self.advertised.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_blocks_expiry_time": None,
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached_tokens or 0,
            EXTRA_KEY: ours,
        }

    def abandon_prefill(self, role: PrefillRole) -> None:
        self.handoffs.abandon_source(role.handoff_id)

    async def pull(self, role: DecodeRole, request: DestinationRequest) -> DestinationAccepted:
        """The destination of `role`'s handoff, activated; its outputs stream as any request's.

        Raises:
            ApiError: the prefill daemon did not answer, or holds no such source (a 500,
                vLLM's failed KV load), or this daemon refused the request.
        """
        try:
            peer = await self.handoffs.peer(role.endpoint, handshake_s=HANDSHAKE_TIMEOUT_S)
            accepted = await self.handoffs.pull(
                role.handoff_id,
                peer,
                request,
                lambda reserved: transfer_wait_s(
                    role.timing, role.handoff_delay_ms, ModelClock(role.speedup_ratio), reserved
                ),
                strict=True,
            )
        except HandoffFailed as exc:
            raise transfer_failed(str(exc)) from None
        except (TimeoutError, ConnectionError):
            raise transfer_failed(f"the prefill daemon at {role.endpoint} did not answer") from None
        except zmq.ZMQError as exc:
            raise validation_error(
                f"{_field('remote_host')}: {role.endpoint} cannot be connected to: {exc}",
                param=_field("remote_host"),
            ) from None
        if accepted is None:
            raise transfer_failed(f"the destination of handoff {role.handoff_id} was cancelled")
        return accepted
