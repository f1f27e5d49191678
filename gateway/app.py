"""The ASGI application (FastAPI): POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (run as a
chat request: responses.py), GET /v1/models, GET /health, in front of one scheduler address through
`client.AsyncClient`.

A request becomes one gRPC `Generate` stream per prompt (the n completions of a prompt share it, as the
scheduler shares their prompt blocks). The HTTP status is decided by the start of that stream: the
gateway waits for the first delta before it answers, so a refusal (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
UNAVAILABLE, DEADLINE_EXCEEDED) is a proper 400 / 429 / 503 / 504 even for `stream: true`; an error after
the first delta ends an event stream with an error event and `data: [DONE]`. An HTTP client that goes
away cancels its gRPC calls, and the scheduler frees the request's KV blocks.

Here: the routes, and a generation from Job to answer. The rest, each in its module: the scheduler as the
gateway sees it (backend.py), a request's checks and gRPC arguments (jobs.py), running its streams
(streams.py), the answer's JSON (render.py) and its server-sent events (events.py), API keys (auth.py).
"""
from __future__ import annotations

import base64
import contextlib
import importlib.metadata
import logging
import re
import time
import uuid
from array import array
from collections.abc import Awaitable
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from client.client import GENERATION_SERVICE
from client.scores import Scores, score_plan
from gateway.auth import APIKeys
from gateway.backend import Backend, GatewayConfig
from gateway.errors import APIError, from_grpc, invalid, validation_param
from gateway.events import chat_events, completion_events
from gateway.jobs import Job, chat_job, chat_messages, completion_job, continues, template_kwargs
from gateway.metrics import HTTPMetrics, exposition
from gateway.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                              ClassificationRequest, ClassificationResponse, CompletionChunk, CompletionRequest,
                              CompletionResponse, DetokenizeRequest, DetokenizeResponse, EmbeddingRequest,
                              EmbeddingResponse, ErrorBody, HealthBody, LoadLoraAdapterRequest, ModelCard, ModelList,
                              RerankRequest, RerankResponse, ResetPrefixCacheResponse, ResponseBody, ResponsesRequest,
                              ScoreRequest, ScoreResponse, TokenizeChatRequest, TokenizeRequest, TokenizeResponse,
                              UnloadLoraAdapterRequest, UpdateWeightsFromDiskRequest, UpdateWeightsFromDiskResponse,
                              VersionBody, WeightVersionResponse, grpc_priority)
from gateway.render import chat_completion, collect, text_completion
from gateway.responses import chat_request, renamed, renamed_error, response_events, response_object
from gateway.schemas import event_schema, response_event_schema
from gateway.streams import ClientGone, EventStream, first_delta, merge, open_streams, unless_disconnected
from gateway.tools import plan_tools

__all__ = ["GatewayConfig", "create_app"]

log = logging.getLogger("splitserve.gateway")

# The error answers every route may give, for the OpenAPI document (the bodies are OpenAI's).
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": what} for status, what in (
        (400, "an invalid or unsupported field, named in error.param"), (401, "a missing or wrong API key"),
        (404, "an unknown model"), (429, "overloaded: retry after Retry-After"),
        (503, "the scheduler, or every worker, unavailable"), (504, "past the request timeout"))}


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

    app = FastAPI(title="splitserve OpenAI-compatible gateway", version=_version(), lifespan=lifespan)
    if config.api_keys:
        app.add_middleware(APIKeys, keys=config.api_keys)
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
                    if path in chunks_of or path == "/v1/responses":  # with stream: true
                        operation["responses"]["200"]["content"]["text/event-stream"] = {"schema": event_schema(
                            chunks_of[path]) if path in chunks_of else response_event_schema()}
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.api_route("/ping", methods=["GET", "POST"], response_model=HealthBody, include_in_schema=False)
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

    @app.get("/version", response_model=VersionBody)
    async def version() -> JSONResponse:
        """vLLM's: the server's version (open, as /health is)."""
        return JSONResponse({"version": app.version})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition"}})
    async def metrics() -> Response:
        content, media_type = exposition()
        return Response(content, media_type=media_type)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models(request: Request) -> JSONResponse:
        backend = backend_of(request)
        backend.forget_model_info()  # as the scheduler has it now: another HTTP worker may have (un)loaded an adapter
        return JSONResponse({"object": "list", "data": [await _model_card(backend, name)
                                                        for name in await backend.model_names()]})

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
    async def model(model_id: str, request: Request) -> JSONResponse:
        backend = backend_of(request)
        return JSONResponse(await _model_card(backend, await backend.resolve_model(model_id, may_load=False)))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        """vLLM's: the prompt's token ids as the scheduler encodes them (its Tokenize call), with each id's token
        as the vocabulary spells it where return_token_strs asks."""
        backend = backend_of(request)
        await backend.resolve_model(body.model, may_load=False)
        try:
            if isinstance(body, TokenizeChatRequest):
                plan = plan_tools(body.tools, None, None)
                enable_thinking, kwargs = template_kwargs(body.chat_template_kwargs)
                ids, strs = await backend.client.tokenize(
                    messages=chat_messages(body.messages), enable_thinking=enable_thinking,
                    tools=plan.tools if plan else None, chat_template_kwargs=kwargs,
                    continue_final_message=continues(body), add_special_tokens=body.add_special_tokens,
                    return_token_strs=True, chat_template=body.chat_template, timeout=backend.config.rpc_timeout)
            else:
                ids, strs = await backend.client.tokenize(body.prompt, add_special_tokens=body.add_special_tokens,
                                                          return_token_strs=True, timeout=backend.config.rpc_timeout)
        except grpc.RpcError as e:
            raise from_grpc(e, prompt_param="messages" if isinstance(body, TokenizeChatRequest) else "prompt") from None
        info = await backend.model_info()
        return JSONResponse({"count": len(ids), "max_model_len": info["max_model_len"], "tokens": ids,
                             "token_strs": strs if body.return_token_strs else None})

    @app.post("/detokenize", response_model=DetokenizeResponse, responses={
        **ERRORS, 501: {"model": ErrorBody, "description": "the gateway was started without --tokenizer"}})
    async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
        backend = backend_of(request)
        await backend.resolve_model(body.model, may_load=False)
        info = await backend.model_info()
        if not all(0 <= t < info["vocab_size"] for t in body.tokens):
            raise invalid("tokens", f"token ids must lie in [0, {info['vocab_size']})")
        text = backend.tokens.decode(body.tokens)
        if text is None:
            raise APIError(501, "detokenize needs the gateway's --tokenizer", "server_error", "tokens",
                           "not_implemented")
        return JSONResponse({"prompt": text})

    lora_answers = {**ERRORS, 200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                    403: {"model": ErrorBody,
                          "description": "the scheduler runs without --allow-runtime-lora-updating"},
                    409: {"model": ErrorBody, "description": "an adapter of that name is loaded already"}}

    async def adapter_answer(backend: Backend, call: Awaitable, done: str) -> PlainTextResponse:
        """The answer to a LoRA load or unload (`call`, the scheduler's): its refusal as an HTTP error, else vLLM's
        text `done`."""
        try:
            await call
        except grpc.RpcError as e:
            raise from_grpc(e) from None
        finally:
            backend.forget_model_info()
        return PlainTextResponse(done)

    @app.post("/v1/load_lora_adapter", responses=lora_answers)
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
        """vLLM's: loads a LoRA adapter on every worker (the scheduler's LoadLoraAdapter), served by its name as a
        request's `model` from then on; 429 when each adapter a worker holds in host memory (--max-cpu-loras) runs a
        request, so that none can make room."""
        backend = backend_of(request)
        call = backend.client.load_lora_adapter(body.lora_name, body.lora_path, timeout=backend.config.rpc_timeout)
        return await adapter_answer(backend, call, f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=lora_answers)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
        """vLLM's: unloads a LoRA adapter from every worker once the requests running under it have ended (new ones
        get 404 from the call on); 404 when it is not loaded."""
        backend = backend_of(request)
        call = backend.client.unload_lora_adapter(body.lora_name, timeout=backend.config.rpc_timeout)
        return await adapter_answer(backend, call, f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/update_weights_from_disk", response_model=UpdateWeightsFromDiskResponse, responses={
        **ERRORS, 403: {"model": ErrorBody, "description": "the scheduler runs without --allow-weight-updates"}})
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest, request: Request) -> JSONResponse:
        """SGLang's: every worker reads the model's weights again from another checkpoint of it (the scheduler's
        UpdateWeights), once the requests received before have finished on the weights they started with; later ones
        wait and run on the new weights, their answers' metadata.weight_version the body's weight_version. 400 (param
        model_path) where a worker cannot: every worker then serves the weights it had."""
        backend = backend_of(request)
        try:  # as long as the requests before it take: no rpc_timeout
            workers = await backend.client.update_weights(body.model_path, abort_requests=body.abort_all_requests,
                                                          weight_version=body.weight_version or "")
        except grpc.RpcError as e:
            error = from_grpc(e)
            if error.status == 400:  # the scheduler's INVALID_ARGUMENT: what the workers found in the folder
                error.param = "model_path"
            raise error from None
        finally:
            backend.forget_model_info()
        return JSONResponse({"success": True, "message": f"weights read from {body.model_path} on {workers} worker(s)",
                             "model_path": body.model_path, "num_workers": workers})

    @app.get("/get_weight_version", response_model=WeightVersionResponse, responses=ERRORS)
    async def get_weight_version(request: Request) -> JSONResponse:
        """SGLang's: the version of the weights served (/update_weights_from_disk's weight_version; by default the
        folder they were read from), as the first worker serves them."""
        backend = backend_of(request)
        try:
            info = await backend.client.model_info(timeout=backend.config.rpc_timeout)
        except grpc.RpcError as e:
            raise from_grpc(e) from None
        return JSONResponse({"weight_version": info["workers"][0]["weight_version"] if info["workers"] else None})

    async def reset_prefix_cache(request: Request) -> JSONResponse:
        """vLLM's /reset_prefix_cache (SGLang's /flush_cache): drops every cached prefix no running request holds, on
        every worker, so that the next requests compute their whole prompts, as on a cold start."""
        backend = backend_of(request)
        try:
            dropped = await backend.client.reset_prefix_cache(timeout=backend.config.rpc_timeout)
        except grpc.RpcError as e:
            raise from_grpc(e) from None
        return JSONResponse({"dropped_blocks": dropped})

    for path in ("/reset_prefix_cache", "/flush_cache"):
        app.post(path, response_model=ResetPrefixCacheResponse, responses=ERRORS,
                 include_in_schema=path == "/reset_prefix_cache")(reset_prefix_cache)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERRORS)
    async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
        """OpenAI's: the scheduler's Embed of every input, as floats or base64 (little-endian float32)."""
        backend = backend_of(request)
        model = await backend.resolve_model(body.model)
        try:
            result = await backend.client.embed(body.input, dimensions=body.dimensions, normalize=body.normalize,
                                                priority=grpc_priority(body.priority),
                                                truncate_prompt_tokens=body.truncate_prompt_tokens,
                                                lora=await backend.lora_of(model), timeout=backend.config.rpc_timeout)
        except grpc.RpcError as e:
            raise from_grpc(e, prompt_param="input") from None
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(array("f", v).tobytes()).decode() if body.encoding_format == "base64"
                 else v} for i, v in enumerate(result.vectors)]
        tokens = sum(result.prompt_tokens)
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @app.post("/classify", response_model=ClassificationResponse, responses=ERRORS)
    async def classify(body: ClassificationRequest, request: Request) -> JSONResponse:
        """vLLM's, on a sequence classifier: the scheduler's Classify of every input."""
        backend = backend_of(request)
        model = await backend.resolve_model(body.model)
        try:
            got = await backend.client.classify(body.input, priority=grpc_priority(body.priority),
                                                truncate_prompt_tokens=body.truncate_prompt_tokens,
                                                lora=await backend.lora_of(model), timeout=backend.config.rpc_timeout)
        except grpc.RpcError as e:
            raise from_grpc(e, prompt_param="input") from None
        tokens = sum(got.prompt_tokens)
        return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": model, "data": [
                                 {"index": i, "label": got.labels[max(range(len(p)), key=p.__getitem__)], "probs": p,
                                  "num_classes": len(p)} for i, p in enumerate(got.probs)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _scores(backend: Backend, model: str, text_1: Any, text_2: Any, names: tuple[str, str],
                      body: ScoreRequest | RerankRequest) -> Scores:
        """Client.score's scores of text_1 against text_2 by `model` (the base model or an adapter); an error names
        its side (`names`: what the request calls the two; a cross-encoder's pair too long is the second's)."""
        try:
            return await backend.client.score(text_1, text_2, priority=grpc_priority(body.priority),
                                              truncate_prompt_tokens=body.truncate_prompt_tokens,
                                              lora=await backend.lora_of(model), timeout=backend.config.rpc_timeout)
        except ValueError as e:  # the two sides do not pair, or cannot be scored by this model
            raise invalid(names[str(e).startswith("text_2")], str(e)) from None
        except grpc.RpcError as e:
            at = re.match(r"inputs\[(\d+)\](\.pair)?", e.details() or "")
            side = 0 if not at else 1 if at.group(2) else score_plan(text_1, text_2).side_of(int(at.group(1)))
            raise from_grpc(e, prompt_param=names[side]) from None

    @app.post("/score", response_model=ScoreResponse, responses=ERRORS, include_in_schema=False)
    @app.post("/v1/score", response_model=ScoreResponse, responses=ERRORS)
    async def score(body: ScoreRequest, request: Request) -> JSONResponse:
        """vLLM's: each pair's score (the cosine similarity of its embeddings, or a cross-encoder's probability)."""
        backend = backend_of(request)
        model = await backend.resolve_model(body.model)
        got = await _scores(backend, model, body.text_1, body.text_2, ("text_1", "text_2"), body)
        return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": model, "data": [{"object": "score", "index": i, "score": v}
                                                      for i, v in enumerate(got.scores)],
                             "usage": {"prompt_tokens": got.prompt_tokens, "total_tokens": got.prompt_tokens}})

    async def rerank(body: RerankRequest, request: Request) -> JSONResponse:
        """vLLM's (Jina's and Cohere's bodies): the documents by their score against the query, best first."""
        backend = backend_of(request)
        model = await backend.resolve_model(body.model)
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        got = await _scores(backend, model, body.query, texts, ("query", "documents"), body)
        best = sorted(range(len(texts)), key=lambda i: -got.scores[i])[:body.top_n or None]
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {
            "total_tokens": got.prompt_tokens}, "results": [
                {"index": i, "relevance_score": got.scores[i], **({"document": {"text": texts[i]}}
                                                                 if body.return_documents else {})} for i in best]})

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):  # Jina's and Cohere's v1 clients, Cohere's v2 client
        app.post(path, response_model=RerankResponse, responses=ERRORS, include_in_schema=path == "/v1/rerank")(rerank)

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

    invocations = ((ChatCompletionRequest, chat_completions), (CompletionRequest, completions),
                   (EmbeddingRequest, embeddings), (ClassificationRequest, classify), (ScoreRequest, score),
                   (RerankRequest, rerank))

    @app.post("/invocations", responses=ERRORS, include_in_schema=False)
    async def invoke(request: Request) -> Response:
        """SageMaker's, as vLLM serves it: the body of any of `invocations`' routes, taken by the first it is valid
        for."""
        try:
            body = await request.json()
        except ValueError:
            raise invalid(None, "the body must be JSON") from None
        for kind, route in invocations:
            try:
                parsed = kind.model_validate(body)
            except ValidationError:
                continue
            return await route(parsed, request)
        raise invalid(None, "the body is none of a chat completion's, a completion's, an embedding's, a "
                            "classification's, a score's or a rerank's request")

    @app.post("/v1/responses", response_model=ResponseBody, responses=ERRORS)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        backend = backend_of(request)
        model = await backend.resolve_model(body.model)
        chat = chat_request(body)
        try:
            job = await chat_job(chat, backend)
        except APIError as e:
            raise renamed_error(e) from None
        job.param_names = {k: renamed(v) for k, v in job.param_names.items()}
        return await _run(request, backend, job, f"resp_{uuid.uuid4().hex}", model, chat, chat=True, response=body)

    return app



def _version() -> str:
    """The installed splitserve's version (a checkout run without installing has none)."""
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"

async def _model_card(backend: Backend, name: str) -> dict[str, Any]:
    """A served name's card: the base model's, or a LoRA adapter's, whose parent is the base model (vLLM's)."""
    info = await backend.model_info()
    lora = await backend.lora_of(name)
    return {"id": name, "object": "model", "created": backend.created, "owned_by": "splitserve",
            "root": name if lora else info["model"], "parent": (await backend.model_names())[0] if lora else None,
            "max_model_len": info["max_model_len"]}


async def _run(request: Request, backend: Backend, job: Job, rid: str, model: str,
               body: CompletionRequest | ChatCompletionRequest, *, chat: bool,
               response: ResponsesRequest | None = None) -> Response:
    """The answer to a job: whole, or streamed as events; `response`: a Responses API request run as the chat
    request `body`, answered in its own shape (responses.py)."""
    job.params["lora"] = await backend.lora_of(model)
    it = merge(open_streams(backend, job, rid, bool(body.stream)))
    headers = {"X-Request-Id": rid}
    try:
        first = await first_delta(request, it, job.param_names)
    except ClientGone:
        log.info("%s: client went away before the first token", rid)
        return Response(status_code=499)
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = (chat_events if chat else completion_events)(
            it, first, job, backend, rid, model, created, body, include_usage)
        if response is not None:
            events = response_events(events, response, rid, model, created)
        return EventStream(events, it, headers)
    try:
        choices, usage = await unless_disconnected(request, collect(it, first, job))
    except ClientGone:
        log.info("%s: client went away", rid)
        return Response(status_code=499)
    except grpc.RpcError as e:
        raise from_grpc(e, **job.param_names) from None
    finally:
        await it.aclose()
    result = (chat_completion if chat else text_completion)(choices, usage, job, backend, rid, model, created, body)
    if response is not None:
        result = response_object(result, response, rid, model, created)
    return JSONResponse(result, headers=headers)
