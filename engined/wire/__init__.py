"""Every external format of engined as msgspec Structs plus their codecs: pure, no sockets.

`control` is engined's own request protocol (v1), `kv_events` the vLLM KV-cache event formats,
`fpm` Dynamo's forward-pass metrics. The server builds one encoder/decoder per socket at
start-up and calls into these modules once per message; nothing here reads a clock or does I/O.
"""
