"""The imperative shell around the core: asyncio, sockets, time, pacing, signals, processes.

`daemon.py` assembles the daemon from the sub-packages, each one concern:
`security` (who may connect), `publish` (KV events and FPM out to routers), `ranks` (where and
when each rank's core runs), `control` (the control protocol's clients and their commands),
`ops` (what operators and the host see: Prometheus, HTTP health, systemd, logs, the heap);
`observability.py` puts the metrics on their ways out (`/metrics`, `metrics`) for the daemon.
"""
