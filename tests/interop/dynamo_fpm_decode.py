"""Decode FPM payloads with Dynamo's own decoder; runs in the PEERS venv, not ours.

stdin: a JSON array of hex-encoded payloads. stdout: `{"fpm_version": FPM_VERSION, "results":
[...]}` with one result per payload: `{"metrics": <the decoded ForwardPassMetrics as builtins,
or null when decode() refused it>, "reencoded": <hex of Dynamo's encode() of it, or null>}`.

`dynamo.common.forward_pass_metrics.decode` returns None (and logs a warning) for a payload
that does not fit its schema or carries another version; that is what the planner and
`recv_forward_pass_metrics` do with every frame.
"""

import json
import sys

import msgspec
from dynamo.common.forward_pass_metrics import FPM_VERSION, decode, encode


def main() -> int:
    payloads = [bytes.fromhex(h) for h in json.load(sys.stdin)]
    out = []
    for payload in payloads:
        metrics = decode(payload)
        if metrics is None:
            out.append({"metrics": None, "reencoded": None})
        else:
            out.append(
                {"metrics": msgspec.to_builtins(metrics), "reencoded": encode(metrics).hex()}
            )
    json.dump({"fpm_version": FPM_VERSION, "results": out}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
