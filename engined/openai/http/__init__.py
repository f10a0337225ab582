"""The API server's HTTP/1.1 server (issue 22, part a): see server.py for why it is our own."""

from engined.openai.http.http_messages import (
    ClosingBody,
    ErrorFactory,
    Handler,
    HttpRequest,
    HttpResponse,
    StreamingResponse,
)
from engined.openai.http.limits import HttpLimits
from engined.openai.http.server import HttpServer

__all__ = [
    "ClosingBody",
    "ErrorFactory",
    "Handler",
    "HttpLimits",
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
    "StreamingResponse",
]
