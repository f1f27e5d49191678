"""The scheduler as the gateway sees it: the gateway's configuration, and one asyncio gRPC client with the model
information it caches."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import grpc

from client.channel import ChannelSecurity
from client.client import AsyncClient
from gateway import harmony
from gateway.errors import APIError
from gateway.tokens import TokenRenderer

log = logging.getLogger("splitserve.gateway")


@dataclass(frozen=True)
class GatewayConfig:
    scheduler: str = "127.0.0.1:50051"
    scheduler_security: ChannelSecurity = ChannelSecurity()  # TLS and API key towards the scheduler
    api_keys: frozenset[str] = frozenset()  # of this HTTP API
    served_model_names: tuple[str, ...] = ()  # empty: the scheduler's model name
    tokenizer: str | None = None  # checkpoint folder or tokenizer.json, for logprob token strings
    # "qwen3" or "deepseek_r1": thinking apart (gateway/reasoning.py); "openai_gptoss": harmony (gateway/harmony.py)
    reasoning_parser: str | None = None
    # how "auto" tool choice finds the model's calls (gateway/tool_parsers.py; "openai": harmony)
    tool_call_parser: str = "hermes"
    request_timeout: float | None = None  # gRPC deadline of a generation, seconds (504 past it)
    allowed_origins: tuple[str, ...] = ()  # CORS
    rpc_timeout: float = 10.0  # model info, tokenize, health
    model_info_ttl: float = 30.0

    @property
    def harmony(self) -> bool:
        """Chat answers are read as gpt-oss's harmony messages (gateway/harmony.py)."""
        return harmony.on(self.reasoning_parser, self.tool_call_parser)

    @property
    def text_reasoning_parser(self) -> str | None:
        """The reasoning parser of answers not read as harmony (gateway/reasoning.py), if any."""
        return None if self.harmony else self.reasoning_parser


class Backend:
    """The scheduler as the gateway sees it: one asyncio gRPC client and its model info, cached."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.client = AsyncClient(config.scheduler, **config.scheduler_security.kwargs())
        self.tokens = TokenRenderer(config.tokenizer)
        self.created = int(time.time())
        self._info: dict[str, Any] | None = None
        self._info_at = -math.inf  # when the cached answer was asked for
        self._stale_before = -math.inf  # answers asked for before this are stale (forget_model_info)
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        await self.client.close()

    def forget_model_info(self) -> None:
        """The next model_info asks the scheduler (its LoRA adapters changed), also where an answer asked for
        before this call is still on its way."""
        self._stale_before = time.monotonic()

    def _fresh(self) -> bool:
        return (self._info is not None and self._info_at >= self._stale_before
                and time.monotonic() - self._info_at < self.config.model_info_ttl)

    async def model_info(self) -> dict[str, Any]:
        """GetModelInfo, at most once per `model_info_ttl`; the last answer while the scheduler fails."""
        if self._fresh():
            return self._info
        async with self._lock:
            if self._fresh():
                return self._info
            asked = time.monotonic()
            try:
                self._info = await self.client.model_info(timeout=self.config.rpc_timeout)
            except grpc.RpcError:
                if self._info is None:
                    raise
                log.warning("model info: scheduler failed, using the last answer", exc_info=True)
            self._info_at = asked
            return self._info

    async def model_names(self) -> list[str]:
        """The names a request's `model` may give: the base model's, then the LoRA adapters' (vLLM's way)."""
        info = await self.model_info()
        base = list(self.config.served_model_names) or [info["model"]]
        return base + [name for name in info.get("lora_adapters", []) if name not in base]

    async def lora_of(self, model: str) -> str:
        """The LoRA adapter a resolved `model` names, or "" for the base model: a name the scheduler's resolver may
        load (ModelInfo.lora_resolver) is an adapter's, as one it serves."""
        info = await self.model_info()
        if model in info.get("lora_adapters", []):
            return model
        return model if info.get("lora_resolver") and model not in await self.model_names() else ""

    async def resolve_model(self, requested: str | None, may_load: bool = True) -> str:
        """The served name a request's `model` gives (the base model's where none); a name the scheduler's resolver
        may load passes where the request would run under it (`may_load`), else it is a 404 as any unknown name."""
        arrived = time.monotonic()
        names = await self.model_names()
        if not requested:
            return names[0]
        if requested not in names and self._info_at < arrived:  # loaded since, maybe through another HTTP worker
            self.forget_model_info()
            names = await self.model_names()
        if requested not in names and not (may_load and (await self.model_info()).get("lora_resolver")):
            raise APIError(404, f"The model `{requested}` does not exist (served: {', '.join(names)}).",
                           "invalid_request_error", "model", "model_not_found")
        return requested

    async def token_limit(self) -> int:
        return token_limit(await self.model_info())


def token_limit(info: dict[str, Any]) -> int:
    """Most tokens (prompt + completion) one sequence can have: the model length, capped by the smallest live
    worker's KV cache (a sequence's last token needs no KV slot), except behind a sliding window, where blocks the
    window has passed go back to the pool and a sequence may outgrow it."""
    capacities = [w["num_blocks"] * info["block_size"] + 1 for w in info.get("workers", [])
                  if w.get("alive") and w.get("num_blocks") and not w.get("sliding_window")]
    return min([int(info["max_model_len"]), *capacities])
