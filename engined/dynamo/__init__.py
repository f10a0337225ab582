"""`engined dynamo-worker`: an engined daemon behind NVIDIA Dynamo's frontend and KV router.

The worker is a Dynamo backend process (the classic `register_model` path, which needs only
`ai-dynamo-runtime`): it registers the model with the daemon's real limits, serves Dynamo's
`generate` endpoint by forwarding each request to the daemon over the control protocol, and
points Dynamo's KV event publisher, FPM relay and load publisher at the daemon's sockets, as
`dynamo.vllm` does for a vLLM engine. Nothing here is imported by the rest of engined, so a
plain install never needs Dynamo: only this package's modules import it, inside functions.
"""
