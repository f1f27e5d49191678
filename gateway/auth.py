"""API keys of the HTTP API: a bearer token on every route but the open ones."""
from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError

# Probes, the version, Prometheus and the API's own document stay open; every other route (the model's work: /v1,
# /classify, /score, /rerank, /invocations, /tokenize, ...) is behind the API keys, whatever routes are added.
OPEN = frozenset({"/health", "/ping", "/version", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                  "/redoc"})


class APIKeys:
    """Bearer-token check of every route but the OPEN ones."""

    def __init__(self, app: ASGIApp, keys: frozenset[str]):
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN and scope["method"] != "OPTIONS":
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

