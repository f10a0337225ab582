"""Dynamo's FPM path as a planner sees it; runs in the PEERS venv, not ours.

`python dynamo_fpm_relay.py ZMQ_ENDPOINT...`: one `FpmEventRelay` per endpoint (a SUB on an
engine's raw FPM PUB, forwarding to Dynamo's event plane, as the vLLM backend's parent process
does) and one `FpmEventSubscriber` on the same component (auto-discovered, as the planner
does). Every message the subscriber receives goes through `forward_pass_metrics.decode` and is
printed as one JSON line: `{"raw": <hex>, "metrics": <builtins, or null if decode() refused
it>}`. Runs until killed. Discovery is file-based under $DYN_FILE_KV, the event plane ZMQ on
the loopback (the caller sets the DYN_*_HOST variables).
"""

import asyncio
import json
import sys

import msgspec
from dynamo.common.forward_pass_metrics import decode
from dynamo.llm import FpmEventRelay, FpmEventSubscriber
from dynamo.runtime import DistributedRuntime


async def main(zmq_endpoints: list[str]) -> None:
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint("enginedinterop.backend.generate")
    relays = [FpmEventRelay(endpoint, zmq_endpoint) for zmq_endpoint in zmq_endpoints]
    subscriber = FpmEventSubscriber(endpoint)
    try:
        while True:
            data = await asyncio.to_thread(subscriber.recv)
            if data is None:
                return
            metrics = decode(data)
            line = {
                "raw": data.hex(),
                "metrics": None if metrics is None else msgspec.to_builtins(metrics),
            }
            print(json.dumps(line), flush=True)
    finally:
        subscriber.shutdown()
        for relay in relays:
            relay.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
