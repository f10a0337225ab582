"""`engined dynamo-worker`: `python -m engined.dynamo` as a subcommand."""

from __future__ import annotations

import typer


def dynamo_worker(ctx: typer.Context) -> None:
    """Serve an engined daemon behind NVIDIA Dynamo (needs engined[dynamo]; --help for flags).

    The flags are Dynamo's own workers' (--model-path, --served-model-name,
    --disaggregation-mode, --namespace, --component, --endpoint, --discovery-backend,
    --request-plane, --event-plane), plus --control-endpoint.
    """
    # NOTE: the worker parses its own flags with argparse, as Dynamo's workers do, so this
    # command only passes them on; `python -m engined.dynamo` is the same program.
    from engined.dynamo.cluster import serve_per_rank
    from engined.dynamo.worker import main as worker_main

    raise typer.Exit(worker_main(ctx.args, serve_per_rank=serve_per_rank))
