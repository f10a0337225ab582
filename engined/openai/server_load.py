"""vLLM's `--enable-server-load-tracking` and `GET /load`.

vLLM counts, per API server process, the generation requests being served: from the moment a
handler starts until its response is sent (a stream's last chunk, or the client leaving), and
answers `GET /load` with `{"server_load": N}`; routers read it to balance. Without the flag the
count is never kept and `/load` answers 0, as vLLM's does.
"""

from __future__ import annotations

import dataclasses

import msgspec

from engined.openai.http.http_messages import (
    ClosingBody,
    Handler,
    HttpRequest,
    HttpResponse,
    StreamingResponse,
)


class ServerLoad:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.requests = 0

    def track(self, route: Handler) -> Handler:
        """`route`, counted while it serves a request (when tracking is on)."""
        if not self.enabled:
            return route

        async def tracked(request: HttpRequest) -> HttpResponse | StreamingResponse:
            self.requests += 1
            try:
                reply = await route(request)
            except BaseException:
                self.requests -= 1
                raise
            if isinstance(reply, StreamingResponse):
                return dataclasses.replace(reply, chunks=ClosingBody(reply.chunks, self._done))
            self.requests -= 1
            return reply

        return tracked

    async def _done(self) -> None:
        self.requests -= 1

    async def load(self, http: HttpRequest) -> HttpResponse:
        return HttpResponse(200, msgspec.json.encode({"server_load": self.requests}))
