"""A Dynamo runtime client calling a worker's endpoint, as a Dynamo user loads LoRA adapters;
runs in the PEERS venv, not ours.

`python dynamo_lora_client.py call PATH JSON [INSTANCE]`: one request to the endpoint PATH
(`namespace.component.endpoint`, e.g. `dynamo.backend.load_lora`) through Dynamo's own
`Client` (file discovery under $DYN_FILE_KV, the TCP request plane, as the test cluster
runs), round robin or to the instance INSTANCE, each response's data printed as one JSON
line; a stream that fails prints `{"error": message}` instead. It waits for an instance of
PATH (INSTANCE, when given) at most 30 s (exit 3).
`python dynamo_lora_client.py id NAME`: Dynamo's `lora_name_to_id(NAME)`.
"""

import asyncio
import json
import sys

from dynamo.llm import lora_name_to_id
from dynamo.runtime import DistributedRuntime

INSTANCE_TIMEOUT_S = 30.0


async def call(path: str, body: object, instance: int | None = None) -> int:
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    try:
        client = await runtime.endpoint(path).client()
        try:
            async with asyncio.timeout(INSTANCE_TIMEOUT_S):
                while instance not in (None, *await client.wait_for_instances()):
                    await asyncio.sleep(0.05)
        except TimeoutError:
            print(json.dumps({"error": f"no instance of {path}"}), flush=True)
            return 3
        try:
            stream = (
                await client.round_robin(body)
                if instance is None
                else await client.direct(body, instance)
            )
            async for response in stream:
                print(json.dumps(response.data()), flush=True)
        except Exception as exc:  # the worker's error, as Dynamo's client raises it
            print(json.dumps({"error": str(exc)}), flush=True)
        return 0
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "id":
        print(lora_name_to_id(sys.argv[2]))
        sys.exit(0)
    target = int(sys.argv[4]) if len(sys.argv) > 4 else None
    sys.exit(asyncio.run(call(sys.argv[2], json.loads(sys.argv[3]), target)))
