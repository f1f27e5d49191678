"""The ASGI application (FastAPI): POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, in front of one scheduler address through `client.AsyncClient`.

A request becomes one gRPC `Generate` stream per prompt (the n completions of a prompt share it, as the
scheduler shares their prompt blocks). The HTTP status is decided by the start of that stream: the
gateway waits for the first delta before it answers, so a refusal (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
UNAVAILABLE, DEADLINE_EXCEEDED) is a proper 400 / 429 / 503 / 504 even for `stream: true`; an error after
the first delta ends an event stream with an error event and `data: [DONE]`. An HTTP client that goes
away cancels its gRPC calls, and the scheduler frees the request's KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from client.channel import ChannelSecurity
from client.client import GENERATION_SERVICE, AsyncClient, Delta
from gateway.errors import APIError, from_grpc, invalid, validation_param
from gateway.metrics import HTTPMetrics, exposition
from gateway.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatMessage,
                              CompletionChunk, CompletionRequest, CompletionResponse, DetokenizeRequest,
                              DetokenizeResponse, ErrorBody, HealthBody, ModelCard, ModelList, TokenizeChatRequest,
                              TokenizeRequest, TokenizeResponse)
from gateway.reasoning import ReasoningStream, split_reasoning
from gateway.schemas import event_schema
from gateway.structured import structured_of
from gateway.tokens import TokenRenderer
from gateway.tools import ToolPlan, ToolStream, plan_tools, with_tool_calls

log = logging.getLogger("splitserve.gateway")
T = TypeVar("T")

ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
INT32 = 1 << 31
LOGPROB_FLOOR = -9999.0  # -inf (a masked token) as a JSON number, like vLLM


@dataclass(frozen=True)
class GatewayConfig:
    scheduler: str = "127.0.0.1:50051"
    scheduler_security: ChannelSecurity = ChannelSecurity()  # TLS and API key towards the scheduler
    api_keys: frozenset[str] = frozenset()  # of this HTTP API
    served_model_names: tuple[str, ...] = ()  # empty: the scheduler's model name
    tokenizer: str | None = None  # checkpoint folder or tokenizer.json, for logprob token strings
    reasoning_parser: str | None = None  # "qwen3": thinking apart, as reasoning_content
    tool_call_parser: str = "hermes"  # how "auto" tool choice finds the model's calls (gateway/tool_parsers.py)
    request_timeout: float | None = None  # gRPC deadline of a generation, seconds (504 past it)
    allowed_origins: tuple[str, ...] = ()  # CORS
    rpc_timeout: float = 10.0  # model info, tokenize, health
    model_info_ttl: float = 30.0


class _ClientGone(Exception):
    """The HTTP client disconnected before the answer started."""


class Backend:
    """The scheduler as the gateway sees it: one asyncio gRPC client and its model info, cached."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.client = AsyncClient(config.scheduler, **config.scheduler_security.kwargs())
        self.tokens = TokenRenderer(config.tokenizer)
        self.created = int(time.time())
        self._info: dict[str, Any] | None = None
        self._info_at = -math.inf
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        await self.client.close()

    async def model_info(self) -> dict[str, Any]:
        """GetModelInfo, at most once per `model_info_ttl`; the last answer while the scheduler fails."""
        if self._info is not None and time.monotonic() - self._info_at < self.config.model_info_ttl:
            return self._info
        async with self._lock:
            if self._info is not None and time.monotonic() - self._info_at < self.config.model_info_ttl:
                return self._info
            try:
                self._info = await self.client.model_info(timeout=self.config.rpc_timeout)
            except grpc.RpcError:
                if self._info is None:
                    raise
                log.warning("model info: scheduler failed, using the last answer", exc_info=True)
            self._info_at = time.monotonic()
            return self._info

    async def model_names(self) -> list[str]:
        if self.config.served_model_names:
            return list(self.config.served_model_names)
        return [(await self.model_info())["model"]]

    async def resolve_model(self, requested: str | None) -> str:
        names = await self.model_names()
        if not requested:
            return names[0]
        if requested not in names:
            raise APIError(404, f"The model `{requested}` does not exist (served: {', '.join(names)}).",
                           "invalid_request_error", "model", "model_not_found")
        return requested

    async def token_limit(self) -> int:
        """Most tokens (prompt + completion) one sequence can have: the model length, capped by the
        smallest live worker's KV cache (a sequence's last token needs no KV slot)."""
        info = await self.model_info()
        limit = int(info["max_model_len"])
        capacities = [w["num_blocks"] * info["block_size"] + 1 for w in info.get("workers", [])
                      if w.get("alive") and w.get("num_blocks")]
        return min([limit, *capacities])


# ---- requests -> generate() arguments ----------------------------------------------------------------


@dataclass
class _Job:
    """One HTTP request as gRPC streams: one prompt each, n completions per prompt."""
    prompts: list[dict[str, Any]]
    params: dict[str, Any]
    n: int
    param_names: dict[str, str] = field(default_factory=dict)  # OpenAI names of ambiguous fields
    failed: bool = False  # a stream failed after its start (no usage chunk then)
    tools: ToolPlan | None = None  # a chat request with tools

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def _logit_bias(body: CompletionRequest | ChatCompletionRequest) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids as strings (JSON keys) -> bias; the scheduler checks ranges."""
    if not body.logit_bias:
        return None
    try:
        bias = {int(token): value for token, value in body.logit_bias.items()}
    except ValueError:
        raise invalid("logit_bias", "logit_bias keys must be token ids") from None
    if not all(0 <= t < INT32 for t in bias):
        raise invalid("logit_bias", "logit_bias keys must be token ids")
    return bias


def _common_checks(body: CompletionRequest | ChatCompletionRequest) -> None:
    for name in body.unsupported_fields():
        raise invalid(name, f"{name} is not supported by this server", "unsupported_parameter")
    _logit_bias(body)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "stream_options is only allowed with stream: true")
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if any(not s for s in stops):
        raise invalid("stop", "stop strings must not be empty")
    if body.stop_token_ids and not all(0 <= t < INT32 for t in body.stop_token_ids):
        raise invalid("stop_token_ids", "stop_token_ids must be token ids >= 0")
    for name in ("max_tokens", "min_tokens", "n", "top_k", "priority"):
        value = getattr(body, name, None)
        if value is not None and abs(value) >= INT32:
            raise invalid(name, f"{name} is out of range: {value}")
    if getattr(body, "max_completion_tokens", None) is not None and body.max_completion_tokens >= INT32:
        raise invalid("max_completion_tokens", "max_completion_tokens is out of range")


def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
              logprobs: int | None) -> dict[str, Any]:
    return dict(
        max_tokens=max_tokens, temperature=body.temperature,
        top_p=None if body.top_p is None else max(body.top_p, MIN_FLOAT32), top_k=body.top_k,
        min_p=body.min_p, presence_penalty=body.presence_penalty,
        repetition_penalty=None if body.repetition_penalty is None else max(body.repetition_penalty, MIN_FLOAT32),
        frequency_penalty=body.frequency_penalty, seed=body.seed, logit_bias=_logit_bias(body), stop=body.stop or None,
        stop_token_ids=body.stop_token_ids or None, ignore_eos=bool(body.ignore_eos), min_tokens=body.min_tokens,
        logprobs=logprobs, n=body.n or 1, priority=body.priority or 0,
        skip_special_tokens=body.skip_special_tokens, structured=_structured(body))


def _structured(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any] | None:
    found = structured_of(body)
    return None if found is None else found[1]


def completion_job(body: CompletionRequest, tokens: TokenRenderer | None = None) -> _Job:
    """With echo, each prompt's "echo" is the text its choices start with (a token-id prompt decoded by `tokens`, the
    gateway's tokenizer), and with logprobs too the prompt is scored (prompt_logprobs): its tokens' logprobs come
    before the completion's, as OpenAI's do. max_tokens 0 (with echo only) scores the prompt, generating nothing."""
    _common_checks(body)
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise invalid("best_of", "best_of other than n is not supported", "unsupported_parameter")
    if body.suffix:
        raise invalid("suffix", "suffix is not supported", "unsupported_parameter")
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[dict[str, Any]] = [{"prompt": prompt}]
    elif not prompt:
        raise invalid("prompt", "prompt must not be empty")
    elif all(isinstance(p, str) for p in prompt):
        prompts = [{"prompt": p} for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [{"token_ids": list(prompt)}]
    else:
        prompts = [{"token_ids": list(p)} for p in prompt]
    for i, p in enumerate(prompts):
        ids = p.get("token_ids")
        if ids is not None and not ids:
            raise invalid(f"prompt[{i}]" if len(prompts) > 1 else "prompt", "a token-id prompt must not be empty")
        if ids is not None and not all(0 <= t < INT32 for t in ids):
            raise invalid("prompt", "prompt token ids must be >= 0")
    if body.max_tokens == 0 and not body.echo:
        raise invalid("max_tokens", "max_tokens 0 is only allowed with echo: true (the prompt alone, scored)")
    if body.echo:
        for p in prompts:
            if "token_ids" not in p:
                p["echo"] = p["prompt"]
            elif (text := tokens.decode(p["token_ids"]) if tokens is not None else None) is not None:
                p["echo"] = text
            else:
                raise invalid("echo", "echo of a token-id prompt needs the gateway's --tokenizer (to decode it)",
                              "unsupported_parameter")
    # max_tokens unset: the scheduler's default, 16, which is OpenAI's for completions.
    params = _sampling(body, body.max_tokens, body.logprobs)
    if body.echo and (body.logprobs is not None or body.max_tokens == 0):
        # Scoring the prompt: max_tokens 0 needs it even without logprobs (then none are returned).
        params["prompt_logprobs"] = body.logprobs or 0
    return _Job(prompts, params, n)


def _tool_calls(i: int, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as the client takes them; arguments must be a JSON object's text."""
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"messages[{i}].tool_calls[{j}].function", "a tool call needs function.name")
        if not isinstance(c.get("id") or "", str):
            raise invalid(f"messages[{i}].tool_calls[{j}].id", "a tool call's id is a string")
        args = fn.get("arguments", "{}")
        try:
            ok = isinstance(json.loads(args) if isinstance(args, str) else args, dict)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise invalid(f"messages[{i}].tool_calls[{j}].function.arguments", "arguments must be a JSON object")
        out.append({"id": c.get("id") or "", "function": {"name": fn["name"], "arguments": args}})
    return out


def _message_text(i: int, message) -> str:
    content = message.content
    if content is None:
        if message.role == "assistant" or message.tool_calls:
            return ""
        raise invalid(f"messages[{i}].content", "content must be a string or a list of text parts")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid(f"messages[{i}].content[{j}]", f"only text parts are supported, got type {part.type!r}",
                          "unsupported_parameter")
        texts.append(part.text)
    return "\n".join(texts)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (the same for a chat request and for /tokenize)."""
    out = []
    for i, m in enumerate(messages):
        message = {"role": ROLE_ALIASES.get(m.role, m.role), "content": _message_text(i, m)}
        if m.tool_calls:
            message["tool_calls"] = _tool_calls(i, m.tool_calls)
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


async def chat_job(body: ChatCompletionRequest, backend: Backend) -> _Job:
    _common_checks(body)
    if body.functions:
        raise invalid("functions", "functions (deprecated by OpenAI) is not supported: use tools",
                      "unsupported_parameter")
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    if plan is not None and plan.structured is not None and structured_of(body) is not None:
        raise invalid("tool_choice", f"tool_choice {plan.mode!r} constrains the output, as does "
                                     f"{structured_of(body)[0]}; give one")
    if not body.messages:
        raise invalid("messages", "messages must not be empty")
    messages = chat_messages(body.messages)
    kwargs = body.chat_template_kwargs or {}
    for key in sorted(set(kwargs) - {"enable_thinking"}):
        raise invalid(f"chat_template_kwargs.{key}", "only chat_template_kwargs.enable_thinking is supported",
                      "unsupported_parameter")
    enable_thinking = kwargs.get("enable_thinking")
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise invalid("chat_template_kwargs.enable_thinking", "enable_thinking must be true or false")
    if body.top_logprobs and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    names = {"prompt_param": "messages", "max_tokens_param": max_name, "logprobs_param": "top_logprobs"}
    constraint = structured_of(body)
    if plan is not None and plan.structured is not None:
        names["structured_param"] = "tool_choice"
    elif constraint is not None:
        names["structured_param"] = constraint[0]
    tools = plan.tools if plan is not None else None
    if max_tokens is not None:
        prompt: dict[str, Any] = {"messages": messages, "enable_thinking": enable_thinking, "tools": tools}
    else:
        # OpenAI's default for chat: up to the model's length. That needs the prompt's length, so the
        # template is applied once, by the scheduler's Tokenize, and the ids are sent.
        try:
            ids = await backend.client.tokenize(messages=messages, enable_thinking=enable_thinking, tools=tools,
                                                timeout=backend.config.rpc_timeout)
            limit = await backend.token_limit()
        except grpc.RpcError as e:
            raise from_grpc(e, **names) from None
        if len(ids) >= limit:
            raise invalid("messages", f"the prompt has {len(ids)} tokens; this model takes at most {limit - 1}")
        max_tokens = limit - len(ids)
        prompt = {"token_ids": ids}
    params = _sampling(body, max_tokens, logprobs)
    if plan is not None and plan.structured is not None:
        params["structured"] = plan.structured
    return _Job([prompt], params, body.n or 1, names, tools=plan)


# ---- running the streams ---------------------------------------------------------------------------


def _open(backend: Backend, job: _Job, request_id: str, stream: bool) -> list[AsyncGenerator[Delta, None]]:
    """One Generate call per prompt; without `stream`, each completion comes back in one message."""
    streams = []
    for i, prompt in enumerate(job.prompts):
        rid = request_id if len(job.prompts) == 1 else f"{request_id}-{i}"
        try:
            streams.append(backend.client.generate(
                prompt.get("prompt"), token_ids=prompt.get("token_ids"), messages=prompt.get("messages"),
                enable_thinking=prompt.get("enable_thinking"), tools=prompt.get("tools"), request_id=rid,
                timeout=backend.config.request_timeout, stream_interval=None if stream else 0, **job.params))
        except (ValueError, TypeError) as e:  # a value the proto cannot hold
            raise invalid(None, str(e)) from None
    return streams


async def _merge(streams: list[AsyncGenerator[Delta, None]]) -> AsyncGenerator[tuple[int, Delta], None]:
    """(prompt index, delta) of every stream as they come; leaving early cancels every call."""
    if len(streams) == 1:
        (stream,) = streams
        try:
            async for delta in stream:
                yield 0, delta
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[Delta, None]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, None, e))
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                remaining -= 1
                continue
            yield i, delta
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled (raising _ClientGone) if the HTTP client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise _ClientGone()
    return task.result()


async def _first(request: Request, it: AsyncGenerator[T, None], names: dict[str, str]) -> T | None:
    """The first item of `it` (None if empty), or the HTTP error the stream failed with."""
    async def first() -> T | None:
        async for item in it:
            return item
        return None

    try:
        return await _unless_disconnected(request, first())
    except grpc.RpcError as e:
        await it.aclose()
        raise from_grpc(e, **names) from None
    except BaseException:
        await it.aclose()
        raise


class _EventStream(StreamingResponse):
    """Server-sent events. However the response ends (done, failed, or the client gone: Starlette cancels
    the sending), the events and their source are closed at once, which cancels the gRPC calls."""

    def __init__(self, events: AsyncGenerator[str, None], source: AsyncGenerator, headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self.events, self.source = events, source

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()
                await self.source.aclose()


def _chunker(rid: str, object_type: str, created: int, model: str, include_usage: bool):
    """One SSE chunk of a streamed answer: its choices, and usage (null until the last chunk) when the
    client asked for stream_options.include_usage."""
    def chunk(choices: list[dict[str, Any]], usage_body: dict[str, Any] | None = None) -> str:
        obj: dict[str, Any] = {"id": rid, "object": object_type, "created": created, "model": model,
                               "choices": choices}
        if include_usage:
            obj["usage"] = usage_body
        return _event(obj)
    return chunk


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


@dataclass
class _Usage:
    """Usage of a whole request: each prompt counted once, its cached tokens from its first completion."""
    prompt: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)
    completion: int = 0

    def add(self, prompt_index: int, delta: Delta) -> None:
        if delta.usage is None:
            return
        self.prompt[prompt_index] = delta.usage.prompt_tokens
        if delta.index == 0:
            self.cached[prompt_index] = delta.usage.cached_prompt_tokens
        self.completion += delta.usage.completion_tokens

    def body(self) -> dict[str, Any]:
        prompt = sum(self.prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion,
                "total_tokens": prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def _completion_logprobs(tokens: TokenRenderer, token_ids: list[int], logprobs, offset: int
                         ) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy logprobs object for some tokens, and the text offset after them."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, (logprob, top) in zip(token_ids, logprobs):
        text, _ = tokens.render(token_id)
        alternatives = {tokens.render(t)[0]: _lp(p) for t, p in top}
        alternatives.setdefault(text, _lp(logprob))
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(logprob))
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def _echo_logprobs(tokens: TokenRenderer, prompt_ids: list[int], prompt_logprobs) -> tuple[dict[str, Any], int]:
    """The prompt's part of an echoed completion's logprobs, and the text offset after it: the first token has
    no context, so its logprob and its alternatives are null."""
    if len(prompt_logprobs or ()) != len(prompt_ids) - 1:
        raise RuntimeError(f"{len(prompt_logprobs or ())} prompt logprobs for a prompt of {len(prompt_ids)} tokens")
    first, _ = tokens.render(prompt_ids[0])
    rest, offset = _completion_logprobs(tokens, prompt_ids[1:], prompt_logprobs, len(first))
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}, offset


def _joined_logprobs(first: dict[str, list], then: dict[str, list]) -> dict[str, list]:
    return {key: first[key] + then[key] for key in first}


def _chat_logprobs(tokens: TokenRenderer, token_ids: list[int], logprobs) -> list[dict[str, Any]]:
    content = []
    for token_id, (logprob, top) in zip(token_ids, logprobs):
        text, raw = tokens.render(token_id)
        alternatives = []
        for t, p in top:
            t_text, t_raw = tokens.render(t)
            alternatives.append({"token": t_text, "logprob": _lp(p), "bytes": t_raw})
        content.append({"token": text, "logprob": _lp(logprob), "bytes": raw, "top_logprobs": alternatives})
    return content


def chat_message(text: str, reasoning_parser: str | None, include_reasoning: bool) -> dict[str, Any]:
    """The assistant message of a whole answer; with a reasoning parser, its thinking apart."""
    if reasoning_parser is None:
        return {"role": "assistant", "content": text}
    thought, content = split_reasoning(text)
    return {"role": "assistant", "content": content, "reasoning_content": thought if include_reasoning else None}


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    prompt_token_ids: list[int] | None = None  # with prompt logprobs (an echoed completion's)
    prompt_logprobs: list | None = None


async def _collect(it: AsyncIterator[tuple[int, Delta]], first: tuple[int, Delta] | None, job: _Job
                   ) -> tuple[list[_Choice], _Usage]:
    choices = [_Choice(i) for i in range(job.num_choices)]
    usage = _Usage()

    def add(prompt_index: int, delta: Delta) -> None:
        c = choices[prompt_index * job.n + delta.index]
        c.text.append(delta.text)
        c.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            c.logprobs.extend(delta.logprobs)
        if delta.prompt_token_ids is not None:
            c.prompt_token_ids, c.prompt_logprobs = delta.prompt_token_ids, delta.prompt_logprobs
        if delta.finish_reason is not None:
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
        usage.add(prompt_index, delta)

    if first is not None:
        add(*first)
    async for prompt_index, delta in it:
        add(prompt_index, delta)
    return choices, usage


# ---- the application -------------------------------------------------------------------------------


# For a top_p or repetition_penalty the schema allows (> 0) but float32 would round to 0 (a subnormal): the same
# answer as the value itself (only the top token kept; logits scaled without bound).
MIN_FLOAT32 = 1e-30
# The error answers every route may give, for the OpenAPI document (the bodies are OpenAI's).
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": what} for status, what in (
        (400, "an invalid or unsupported field, named in error.param"), (401, "a missing or wrong API key"),
        (404, "an unknown model"), (429, "overloaded: retry after Retry-After"),
        (503, "the scheduler, or every worker, unavailable"), (504, "past the request timeout"))}
PROTECTED = ("/v1", "/tokenize", "/detokenize")  # behind the API keys; /health stays open, for probes


class _APIKeys:
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


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def create_app(config: GatewayConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.backend = Backend(config)  # the gRPC channel belongs to this event loop
        log.info("gateway for scheduler %s over %s (API keys: %s, reasoning parser: %s, logprob tokens: %s)",
                 config.scheduler, "TLS" if config.scheduler_security.uses_tls else "plaintext",
                 "on" if config.api_keys else "off", config.reasoning_parser or "none",
                 "from " + str(config.tokenizer) if config.tokenizer else "token_id:N")
        try:
            yield
        finally:
            await app.state.backend.close()

    app = FastAPI(title="splitserve OpenAI-compatible gateway", lifespan=lifespan)
    if config.api_keys:
        app.add_middleware(_APIKeys, keys=config.api_keys)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(HTTPMetrics, routes=app.router.routes)  # outermost: refused requests count too

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = validation_param(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            param, message = None, f"the body is not valid JSON: {first.get('msg')}"
        else:
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return _error_response(invalid(param, message))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        error = APIError(e.status_code, str(e.detail), "invalid_request_error", None,
                         "not_found" if e.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(grpc.RpcError)
    async def _rpc_error(request: Request, e: grpc.RpcError) -> JSONResponse:
        return _error_response(from_grpc(e))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path, exc_info=e)
        return _error_response(APIError(500, f"internal error: {type(e).__name__}", "server_error", None,
                                        "internal_error"))

    def backend_of(request: Request) -> Backend:
        return request.app.state.backend

    def openapi() -> dict[str, Any]:
        """FastAPI's document, less the 422 bodies it promises: every invalid request is a 400 in OpenAI's shape."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            _, chunks = models_json_schema([(CompletionChunk, "validation"), (ChatCompletionChunk, "validation")],
                                           ref_template="#/components/schemas/{model}")
            for name, definition in chunks["$defs"].items():
                components.setdefault(name, definition)
            chunks_of = {"/v1/completions": "CompletionChunk", "/v1/chat/completions": "ChatCompletionChunk"}
            for path, operations in schema["paths"].items():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
                    if path in chunks_of:  # with stream: true
                        operation["responses"]["200"]["content"]["text/event-stream"] = {
                            "schema": event_schema(chunks_of[path])}
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/health", response_model=HealthBody,
             responses={503: {"model": HealthBody, "description": "the scheduler is not serving"}})
    async def health(request: Request) -> JSONResponse:
        """200 while the scheduler's Generation service is SERVING (a worker is connected), else 503."""
        backend = backend_of(request)
        try:
            status = await backend.client.health(GENERATION_SERVICE, timeout=min(backend.config.rpc_timeout, 3.0))
        except grpc.RpcError as e:
            status = e.code().name
        code = 200 if status == "SERVING" else 503
        return JSONResponse({"status": "ok" if code == 200 else "unavailable", "scheduler": status}, code)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition"}})
    async def metrics() -> Response:
        content, media_type = exposition()
        return Response(content, media_type=media_type)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models(request: Request) -> JSONResponse:
        backend = backend_of(request)
        info = await backend.model_info()
        data = [{"id": name, "object": "model", "created": backend.created, "owned_by": "splitserve",
                 "root": info["model"], "parent": None, "max_model_len": info["max_model_len"]}
                for name in await backend.model_names()]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
    async def model(model_id: str, request: Request) -> JSONResponse:
        backend = backend_of(request)
        name = await backend.resolve_model(model_id)
        info = await backend.model_info()
        return JSONResponse({"id": name, "object": "model", "created": backend.created, "owned_by": "splitserve",
                             "root": info["model"], "parent": None, "max_model_len": info["max_model_len"]})

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        """vLLM's: the prompt's token ids as the scheduler encodes them (its Tokenize call)."""
        backend = backend_of(request)
        await backend.resolve_model(body.model)
        try:
            if isinstance(body, TokenizeChatRequest):
                ids = await backend.client.tokenize(messages=chat_messages(body.messages),
                                                    timeout=backend.config.rpc_timeout)
            else:
                ids = await backend.client.tokenize(body.prompt, timeout=backend.config.rpc_timeout)
        except grpc.RpcError as e:
            raise from_grpc(e, prompt_param="messages" if isinstance(body, TokenizeChatRequest) else "prompt") from None
        info = await backend.model_info()
        return JSONResponse({"count": len(ids), "max_model_len": info["max_model_len"], "tokens": ids})

    @app.post("/detokenize", response_model=DetokenizeResponse, responses={
        **ERRORS, 501: {"model": ErrorBody, "description": "the gateway was started without --tokenizer"}})
    async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
        backend = backend_of(request)
        await backend.resolve_model(body.model)
        info = await backend.model_info()
        if not all(0 <= t < info["vocab_size"] for t in body.tokens):
            raise invalid("tokens", f"token ids must lie in [0, {info['vocab_size']})")
        text = backend.tokens.decode(body.tokens)
        if text is None:
            raise APIError(501, "detokenize needs the gateway's --tokenizer", "server_error", "tokens",
                           "not_implemented")
        return JSONResponse({"prompt": text})

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        backend = backend_of(request)
        model = await backend.resolve_model(body.model)
        job = completion_job(body, backend.tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await _run(request, backend, job, rid, model, body, chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        backend = backend_of(request)
        model = await backend.resolve_model(body.model)
        job = await chat_job(body, backend)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await _run(request, backend, job, rid, model, body, chat=True)

    return app


async def _run(request: Request, backend: Backend, job: _Job, rid: str, model: str,
               body: CompletionRequest | ChatCompletionRequest, *, chat: bool) -> Response:
    it = _merge(_open(backend, job, rid, bool(body.stream)))
    headers = {"X-Request-Id": rid}
    try:
        first = await _first(request, it, job.param_names)
    except _ClientGone:
        log.info("%s: client went away before the first token", rid)
        return Response(status_code=499)
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = (_chat_events if chat else _completion_events)(
            it, first, job, backend, rid, model, created, body, include_usage)
        return _EventStream(events, it, headers)
    try:
        choices, usage = await _unless_disconnected(request, _collect(it, first, job))
    except _ClientGone:
        log.info("%s: client went away", rid)
        return Response(status_code=499)
    except grpc.RpcError as e:
        raise from_grpc(e, **job.param_names) from None
    finally:
        await it.aclose()
    tokens = backend.tokens
    if chat:
        out = []
        include_reasoning = getattr(body, "include_reasoning", True) is not False
        for c in choices:
            message = chat_message("".join(c.text), backend.config.reasoning_parser, include_reasoning)
            finish = c.finish_reason
            if job.tools is not None:
                message, finish = with_tool_calls(message, finish, job.tools, backend.config.tool_call_parser)
            logprobs = {"content": _chat_logprobs(tokens, c.token_ids, c.logprobs)} if c.logprobs else None
            out.append({"index": c.index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish, "stop_reason": c.stop_reason})
        result = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
                  "usage": usage.body(), "system_fingerprint": None}
    else:
        out = []
        for c in choices:
            prefix = job.prompts[c.index // job.n].get("echo", "")
            if body.echo and body.logprobs is not None and c.prompt_token_ids:
                logprobs, offset = _echo_logprobs(tokens, c.prompt_token_ids, c.prompt_logprobs)
                logprobs = _joined_logprobs(logprobs, _completion_logprobs(tokens, c.token_ids, c.logprobs, offset)[0])
            else:
                logprobs = _completion_logprobs(tokens, c.token_ids, c.logprobs, 0)[0] if c.logprobs else None
            out.append({"index": c.index, "text": prefix + "".join(c.text), "logprobs": logprobs,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        result = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
                  "usage": usage.body(), "system_fingerprint": None}
    return JSONResponse(result, headers=headers)


async def _completion_events(it, first, job: _Job, backend: Backend, rid: str, model: str, created: int,
                             body: CompletionRequest, include_usage: bool) -> AsyncGenerator[str, None]:
    usage = _Usage()
    offsets = [0] * job.num_choices
    started = [False] * job.num_choices

    chunk = _chunker(rid, "text_completion", created, model, include_usage)

    def render(prompt_index: int, delta: Delta) -> str | None:
        usage.add(prompt_index, delta)
        index = prompt_index * job.n + delta.index
        text = delta.text
        logprobs = None
        if body.echo and not started[index]:  # the first chunk of a choice: the prompt, and its logprobs
            text = job.prompts[prompt_index].get("echo", "") + text
            if body.logprobs is not None and delta.prompt_token_ids:
                logprobs, offsets[index] = _echo_logprobs(backend.tokens, delta.prompt_token_ids,
                                                          delta.prompt_logprobs)
        started[index] = True
        if delta.logprobs:
            generated, offsets[index] = _completion_logprobs(backend.tokens, delta.token_ids, delta.logprobs,
                                                             offsets[index])
            logprobs = generated if logprobs is None else _joined_logprobs(logprobs, generated)
        if not text and logprobs is None and delta.finish_reason is None:
            return None
        return chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                       "stop_reason": delta.stop_reason}])

    async for event in _stream_events(it, first, render, job):
        yield event
    if include_usage and not job.failed:
        yield chunk([], usage.body())
    yield DONE


async def _chat_events(it, first, job: _Job, backend: Backend, rid: str, model: str, created: int,
                       body: ChatCompletionRequest, include_usage: bool) -> AsyncGenerator[str, None]:
    usage = _Usage()
    parsers = [ReasoningStream() for _ in range(job.num_choices)] if backend.config.reasoning_parser else None
    include_reasoning = body.include_reasoning is not False
    tools = [ToolStream(job.tools, backend.config.tool_call_parser) for _ in range(job.num_choices)] \
        if job.tools is not None else None

    chunk = _chunker(rid, "chat.completion.chunk", created, model, include_usage)

    def render(prompt_index: int, delta: Delta) -> str | None:
        usage.add(prompt_index, delta)
        index = prompt_index * job.n + delta.index
        message: dict[str, Any] = {}
        if parsers is None:
            if delta.text:
                message["content"] = delta.text
        else:
            thought, content = parsers[index].feed(delta.text)
            if delta.finish_reason is not None:
                more_thought, more_content = parsers[index].finish()
                thought, content = thought + more_thought, content + more_content
            if thought and include_reasoning:
                message["reasoning_content"] = thought
            if content:
                message["content"] = content
        finish = delta.finish_reason
        if tools is not None:
            content, calls = tools[index].feed(message.pop("content", ""), finish is not None)
            if content:
                message["content"] = content
            if calls:
                message["tool_calls"] = calls
            if finish == "stop" and tools[index].called:
                finish = "tool_calls"
        logprobs = {"content": _chat_logprobs(backend.tokens, delta.token_ids, delta.logprobs)} \
            if delta.logprobs else None
        if not message and logprobs is None and finish is None:
            return None
        return chunk([{"index": index, "delta": message, "logprobs": logprobs,
                       "finish_reason": finish, "stop_reason": delta.stop_reason}])

    for index in range(job.num_choices):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async for event in _stream_events(it, first, render, job):
        yield event
    if include_usage and not job.failed:
        yield chunk([], usage.body())
    yield DONE


async def _stream_events(it, first, render, job: _Job) -> AsyncGenerator[str, None]:
    """The rendered events of the deltas; a gRPC failure mid-stream becomes an error event."""
    try:
        if first is not None:
            event = render(*first)
            if event:
                yield event
        async for prompt_index, delta in it:
            event = render(prompt_index, delta)
            if event:
                yield event
    except grpc.RpcError as e:
        job.failed = True
        error = from_grpc(e, **job.param_names)
        log.warning("stream failed after its start: %s %s", error.status, error.message)
        yield _event(error.body())
    finally:
        await it.aclose()
