"""The scheduler's public gRPC service (grpc.aio): Generate streams, model info, tokenize, health and
reflection. Requests are routed to a worker group; each group's engine runs on its own thread and
hands outputs back to the event loop in one batch per step."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import splitserve_pb2 as api
from protos import splitserve_pb2_grpc
from scheduler_svc.engine import EngineConfig, RequestOutput
from scheduler_svc.requests import InvalidRequest, parse_generate, prompt_ids
from scheduler_svc.router import pick_group
from scheduler_svc.scheduler import QueueFullError
from scheduler_svc.tokenizer import load_tokenizer
from scheduler_svc.worker_group import WorkerGroup

log = logging.getLogger("splitserve.scheduler")
SERVICE = api.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH = {"stop": api.FINISH_REASON_STOP, "length": api.FINISH_REASON_LENGTH, "abort": api.FINISH_REASON_ABORT}
_FAILED = object()


@dataclass(slots=True)
class _Stream:
    """Outputs of one client call (all its n completions), fed by the event loop."""
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    index_of: dict[str, int] = field(default_factory=dict)


class GenerationService(splitserve_pb2_grpc.GenerationServicer):
    def __init__(self, model_dir: Path, config: EngineConfig):
        self.model_dir, self.config = model_dir, config
        self.tokenizer = load_tokenizer(model_dir)
        self.groups: list[WorkerGroup] = []
        self.loop = asyncio.get_running_loop()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count(1)
        self.accepting = True
        self.health = health.aio.HealthServicer()

    # ---- worker groups ------------------------------------------------------------------------
    async def add_worker(self, address: str) -> WorkerGroup:
        group = await asyncio.to_thread(WorkerGroup, address, self.model_dir, self.tokenizer, self.config,
                                        self._outputs_from_thread, self._failure_from_thread)
        self.groups.append(group)
        log.info("worker group %s: %s, %d blocks of %d, max_model_len %d", address, group.info.device,
                 group.info.num_blocks, group.info.block_size, group.info.max_model_len)
        await self._update_health()
        return group

    def live_groups(self) -> list[WorkerGroup]:
        return [g for g in self.groups if g.alive]

    async def _update_health(self) -> None:
        serving = self.accepting and bool(self.live_groups())
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(SERVICE, status)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)  # liveness

    def _outputs_from_thread(self, outputs: list[RequestOutput]) -> None:
        self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)

    def _failure_from_thread(self, group: WorkerGroup, request_ids: list[str], error: Exception) -> None:
        def fail() -> None:
            for rid in request_ids:
                stream = self._streams.get(rid)
                if stream is not None:
                    stream.queue.put_nowait(_FAILED)
            asyncio.ensure_future(self._update_health())
        self.loop.call_soon_threadsafe(fail)

    @property
    def max_model_len(self) -> int:
        return min(g.engine.scheduler.config.max_model_len for g in self.groups)

    @property
    def vocab_size(self) -> int:
        return self.groups[0].info.vocab_size or self.tokenizer.vocab_size

    # ---- RPCs ---------------------------------------------------------------------------------
    async def Generate(self, request: api.GenerateRequest, context: grpc.aio.ServicerContext):
        started = time.perf_counter()
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
        groups = self.live_groups()
        if not groups:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is serving")
        try:
            parsed = parse_generate(request, self.tokenizer, self.max_model_len, self.vocab_size)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if rid in self._streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is in use")
        group = pick_group(groups, parsed.prompt_ids)
        subs = [rid] if parsed.n == 1 else [f"{rid}#{i}" for i in range(parsed.n)]
        stream = _Stream(index_of={s: i for i, s in enumerate(subs)})
        for s in subs:
            self._streams[s] = stream
        pending = set(subs)
        usage = api.Usage()
        try:
            # With n > 1 the first completion computes the prompt; the others start once it has, and
            # hit its cached blocks.
            await self._submit(group, parsed, subs[0], 0, context)
            started_rest = parsed.n == 1
            while pending:
                item = await stream.queue.get()
                batch = [item]
                while not stream.queue.empty():  # coalesce what arrived while the client was slow
                    batch.append(stream.queue.get_nowait())
                if _FAILED in batch:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"worker {group.address} failed; retry the request")
                if not started_rest:
                    started_rest = True
                    for i, s in enumerate(subs[1:], 1):
                        await self._submit(group, parsed, s, i, context)
                for response in _responses(rid, batch, stream.index_of):
                    if response.finish_reason:
                        pending.discard(subs[response.index])
                        usage.prompt_tokens = response.usage.prompt_tokens
                        usage.completion_tokens += response.usage.completion_tokens
                        usage.cached_prompt_tokens += response.usage.cached_prompt_tokens
                    await context.write(response)
        finally:
            for s in subs:
                self._streams.pop(s, None)
                if s in pending:
                    group.abort(s)  # cancelled, failed or deadline passed: free its blocks now
            reason = "cancelled" if pending else "done"
            log.info("request %s: group %s, n=%d, prompt %d tokens, completion %d tokens, cached %d, %s, %.3f s",
                     rid, group.address, parsed.n, len(parsed.prompt_ids), usage.completion_tokens,
                     usage.cached_prompt_tokens, reason, time.perf_counter() - started)

    async def _submit(self, group: WorkerGroup, parsed, sub_id: str, index: int, context) -> None:
        try:
            await asyncio.wrap_future(group.add(parsed.prompt_ids, parsed.completion_params(index), sub_id))
        except QueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def GetModelInfo(self, request, context) -> api.ModelInfo:
        groups = self.live_groups()
        if not groups:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is serving")
        info = groups[0].info
        return api.ModelInfo(model=info.model, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                             eos_token_ids=list(self.tokenizer.eos_token_ids), num_workers=len(groups),
                             dtype=info.dtype, block_size=info.block_size,
                             workers=[g.status() for g in self.groups])

    async def Tokenize(self, request: api.TokenizeRequest, context) -> api.TokenizeResponse:
        try:
            if request.WhichOneof("prompt") == "text":
                ids = self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
            else:
                ids = prompt_ids(request, self.tokenizer, self.tokenizer.vocab_size)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return api.TokenizeResponse(token_ids=ids, tokens=[self.tokenizer.tokenizer.id_to_token(i) or ""
                                                           for i in ids])

    async def drain(self, grace: float) -> None:
        """Stops admitting, lets running requests finish within the grace period."""
        self.accepting = False
        await self._update_health()
        deadline = time.monotonic() + grace
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def _responses(rid: str, batch: list[RequestOutput], index_of: dict[str, int]) -> list[api.GenerateResponse]:
    """One response per completion in the batch, with all its new tokens."""
    merged: dict[int, api.GenerateResponse] = {}
    for out in batch:
        index = index_of[out.request_id]
        r = merged.get(index)
        if r is None:
            r = merged[index] = api.GenerateResponse(request_id=rid, index=index)
        r.token_ids.extend(out.token_ids)
        r.text += out.text
        if out.logprobs:
            for lp in out.logprobs:
                r.logprobs.add(logprob=lp.logprob, top=[api.TopLogprob(token_id=t, logprob=p)
                                                        for t, p in (lp.top or [])])
        if out.finished:
            r.finish_reason = FINISH.get(out.finish_reason, api.FINISH_REASON_STOP)
            r.stop_reason = out.stop_reason or ""
            if out.usage is not None:
                r.usage.prompt_tokens = out.usage.prompt_tokens
                r.usage.completion_tokens = out.usage.completion_tokens
                r.usage.cached_prompt_tokens = out.usage.cached_tokens
    return list(merged.values())


async def serve(model_dir: Path, workers: list[str], host: str, port: int, config: EngineConfig,
                ) -> tuple[grpc.aio.Server, GenerationService, int]:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    service = GenerationService(model_dir, config)
    splitserve_pb2_grpc.add_GenerationServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(service.health, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await service._update_health()
    await server.start()
    for address in workers:
        await service.add_worker(address)
    return server, service, bound
