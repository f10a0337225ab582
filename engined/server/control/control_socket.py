"""The control ROUTER the daemon binds: its limits, and the operator endpoint bound beside it.

Every bind goes through the registry, which refuses an ipc:// path a live socket owns
(libzmq would silently take it over) and claims it (`engined.zmq_sockets`).
"""

from __future__ import annotations

import zmq
import zmq.asyncio

from engined.config import DaemonConfig
from engined.server.control.budgets import control_max_message_bytes
from engined.server.security.access import OperatorEndpoint, operator_endpoint
from engined.server.security.gatekeeper import Domain, Gatekeeper
from engined.zmq_sockets import SocketRegistry

# Messages one control client may leave unread (its ZeroMQ pipe and its backlog together),
# and the pipe's own size: small, so that what it holds beyond the backlog's counted bytes
# stays small too (256 of the largest `welcome`, 41 KB, are 10.5 MB).
CONTROL_HWM = 100_000
CONTROL_PIPE_HWM = 256


def bind_control(
    ctx: zmq.asyncio.Context, registry: SocketRegistry, gate: Gatekeeper, cfg: DaemonConfig
) -> tuple[zmq.asyncio.Socket, OperatorEndpoint, int]:
    """The bound ROUTER (and the operator endpoint, bound on it too when it has one), the
    endpoint the `welcome` advertises, and the largest message it takes.

    Raises zmq.ZMQError, OSError or AccessError when it cannot be bound.
    """
    max_message_bytes = control_max_message_bytes(cfg.engine)
    sock = registry.make(
        ctx,
        zmq.ROUTER,
        cfg.control_endpoint,
        bind=True,
        sndhwm=CONTROL_PIPE_HWM,
        rcvhwm=CONTROL_HWM,
        linger=1000,
        maxmsgsize=max_message_bytes,
        router_mandatory=True,
        **gate.options(Domain.CONTROL),
    )
    operator = operator_endpoint(cfg)
    if operator.bind is not None:
        registry.bind_also(sock, operator.bind)
    return sock, operator, max_message_bytes
