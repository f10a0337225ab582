"""The worker's command line, named as Dynamo's own workers name their flags.

Users move between `python -m dynamo.vllm`, `python -m dynamo.mocker` and this worker, so the
flags, their defaults and their environment variables are Dynamo 1.6.1's
(`dynamo/common/configuration/groups/runtime_args.py`); only `--control-endpoint` is ours,
with the same default and variable as every other engined command, and
`--daemon-liveness`, the bound within which a lost daemon is noticed. The LoRA flags are the
vLLM engine arguments `python -m dynamo.vllm` takes for them (`--enable-lora`, `--max-loras`,
vLLM's defaults): the daemon has its own, which schedule; the worker's serve the adapters.
"""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engined.client.liveness import DEFAULT_LIVENESS_S, heartbeat_ms
from engined.tools.option_values import DEFAULT_CONTROL_ENDPOINT, check_endpoint


class DisaggregationMode(enum.StrEnum):
    AGG = "agg"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    control_endpoint: str
    model_path: Path
    served_model_name: str | None
    disaggregation_mode: DisaggregationMode
    namespace: str
    component: str
    endpoint: str
    discovery_backend: str
    request_plane: str
    event_plane: str | None
    connect_timeout: float
    worker_per_rank: bool = False
    daemon_liveness: float = DEFAULT_LIVENESS_S
    enable_lora: bool = False
    max_loras: int = 1

    @property
    def endpoint_path(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"


def _endpoint_arg(text: str) -> str:
    try:
        return check_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _liveness(text: str) -> float:
    value = _positive(text)
    try:
        heartbeat_ms(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return value


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="engined dynamo-worker",
        description=(
            "Serve an engined daemon behind NVIDIA Dynamo: register the model, forward "
            "generate requests, relay KV events, forward-pass metrics and load."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--control-endpoint",
        type=_endpoint_arg,
        default=env("ENGINED_CONTROL_ENDPOINT", DEFAULT_CONTROL_ENDPOINT),
        help="the daemon's control endpoint [env ENGINED_CONTROL_ENDPOINT]",
    )
    parser.add_argument(
        "--model-path",
        type=Path,
        required=True,
        help="local directory with the model's tokenizer and config (no weights needed)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="name the frontend serves the model under (default: the daemon's model_name)",
    )
    parser.add_argument(
        "--disaggregation-mode",
        type=DisaggregationMode,
        choices=list(DisaggregationMode),
        default=DisaggregationMode.AGG,
        help="agg serves whole requests; prefill and decode split them across two daemons",
    )
    parser.add_argument(
        "--namespace", default=env("DYN_NAMESPACE", "dynamo"), help="[env DYN_NAMESPACE]"
    )
    parser.add_argument(
        "--component",
        default=None,
        help="Dynamo component (default: prefill for --disaggregation-mode prefill, else backend)",
    )
    parser.add_argument(
        "--endpoint",
        default=env("DYN_ENDPOINT", "generate"),
        help="endpoint name, or a full dyn://namespace.component.endpoint [env DYN_ENDPOINT]",
    )
    parser.add_argument(
        "--discovery-backend",
        choices=["kubernetes", "etcd", "file", "mem"],
        default=env("DYN_DISCOVERY_BACKEND", "etcd"),
        help="[env DYN_DISCOVERY_BACKEND]; file needs no etcd (root dir: DYN_FILE_KV)",
    )
    parser.add_argument(
        "--request-plane",
        choices=["tcp", "nats"],
        default=env("DYN_REQUEST_PLANE", "tcp"),
        help="[env DYN_REQUEST_PLANE]",
    )
    parser.add_argument(
        "--event-plane",
        choices=["nats", "zmq"],
        default=env("DYN_EVENT_PLANE"),
        help="[env DYN_EVENT_PLANE] (Dynamo's default: zmq)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=_positive,
        default=10.0,
        help=(
            "seconds to wait at start-up for the daemon's welcome, and for etcd and NATS "
            "(unless ETCD_/NATS_STARTUP_CONNECT_TIMEOUT_SECONDS say otherwise)"
        ),
    )
    parser.add_argument(
        "--worker-per-rank",
        action="store_true",
        help=(
            "register each data-parallel rank of the daemon as a Dynamo worker of its own "
            "(its own instance id, KV events, load and FPM worker id), as dynamo.mocker "
            "--num-workers does: one daemon with --data-parallel-size N and this one "
            "process simulate N workers"
        ),
    )
    parser.add_argument(
        "--daemon-liveness",
        type=_liveness,
        default=DEFAULT_LIVENESS_S,
        help="seconds within which a dead, hung or unreachable daemon is noticed (ZMTP "
        "heartbeats; at least 0.1): its streams then end with EngineShutdown, which the "
        "frontend migrates with --migration-limit",
    )
    parser.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve LoRA adapters as dynamo.vllm does: the load_lora, unload_lora and "
        "list_loras endpoints (loading needs DYN_LORA_ENABLED=true, as Dynamo's; with "
        "--worker-per-rank, each rank's own); the daemon needs --enable-lora too",
    )
    parser.add_argument(
        "--max-loras",
        type=_positive_int,
        default=1,
        help="adapters one batch may use, as the daemon's --max-loras: advertised on the "
        "model cards (max_gpu_lora_count), as dynamo.vllm does",
    )
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def parse_args(argv: Sequence[str]) -> WorkerArgs:
    """Parse `argv`; a bad command line exits 2 with argparse's message naming the flag."""
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    mode = DisaggregationMode(ns.disaggregation_mode)
    namespace, component, endpoint = ns.namespace, ns.component, ns.endpoint
    if endpoint.startswith("dyn://") or endpoint.count(".") == 2:
        parts = endpoint.removeprefix("dyn://").split(".")
        if len(parts) != 3 or not all(parts):
            parser.error(f"--endpoint {endpoint!r}: expected dyn://namespace.component.endpoint")
        namespace, component, endpoint = parts
    if component is None:
        component = "prefill" if mode is DisaggregationMode.PREFILL else "backend"
    return WorkerArgs(
        control_endpoint=ns.control_endpoint,
        model_path=ns.model_path,
        served_model_name=ns.served_model_name,
        disaggregation_mode=mode,
        namespace=namespace,
        component=component,
        endpoint=endpoint,
        discovery_backend=ns.discovery_backend,
        request_plane=ns.request_plane,
        event_plane=ns.event_plane,
        connect_timeout=ns.connect_timeout,
        worker_per_rank=ns.worker_per_rank,
        daemon_liveness=ns.daemon_liveness,
        enable_lora=ns.enable_lora,
        max_loras=ns.max_loras,
    )
