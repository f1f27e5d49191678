"""API keys of the HTTP API: a bearer token on every protected route."""
from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError

PROTECTED = ("/v1", "/tokenize", "/detokenize")  # behind the API keys; /health stays open, for probes


class APIKeys:
    """Bearer-token check of the PROTECTED routes."""

    def __init__(self, app: ASGIApp, keys: frozenset[str]):
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED) and scope["method"] != "OPTIONS":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            token = token.strip()
            ok = scheme.lower() == b"bearer" and any(hmac.compare_digest(token, k) for k in self.keys)
            if not ok:
                error = APIError(401, "Incorrect or missing API key: send it as `Authorization: Bearer KEY`.",
                                 "invalid_request_error", None, "invalid_api_key")
                await JSONResponse(error.body(), 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)

