"""The scheduler's public gRPC service (grpc.aio): Generate streams, model info, tokenize, health and
reflection. Requests are routed to a worker group; each group's engine runs on its own thread and
hands outputs back to the event loop in one batch per step."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.security import ApiKeyInterceptor, ApiKeys, RegistrationPolicy, TLSConfig, add_port, transport
from protos import membership_pb2_grpc, splitserve_pb2_grpc
from protos import splitserve_pb2 as api
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import EngineRequest, RequestOutput
from scheduler_svc.membership import Membership, MembershipConfig, MembershipService
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.prefix_hash import PromptHashes
from scheduler_svc.requests import InvalidRequest, check_text_size, max_prompt_bytes, parse_generate, prompt_ids
from scheduler_svc.router import pick_group
from scheduler_svc.scheduler import QueueFullError
from scheduler_svc.tokenizer import load_tokenizer
from scheduler_svc.worker_group import GroupUnavailable, WorkerGroup

log = logging.getLogger("splitserve.scheduler")
SERVICE = api.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH = {"stop": api.FINISH_REASON_STOP, "length": api.FINISH_REASON_LENGTH, "abort": api.FINISH_REASON_ABORT}
_REASON = {v: k for k, v in FINISH.items()}
DEADLINE_SLACK_S = 0.1  # a call cancelled this close to its deadline is logged as a passed deadline
FAILED = object()  # put on a client stream whose request cannot continue anywhere: it ends UNAVAILABLE
# gRPC core cancels incoming calls that wait for the server to take them once more than max_pending_requests
# (1,000) are pending, with status CANCELLED and no message: a burst of new streams larger than that, on one
# connection or many, lost the excess. Admission is this service's job (RESOURCE_EXHAUSTED, with a message),
# so the bound is far above any admission bound.
MAX_PENDING_CALLS = 1 << 17
PUBLIC_SERVER_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                         ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                         ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS)]


@dataclass(slots=True)
class _Stream:
    """Outputs of one client call (all its n completions), fed by the event loop. With a stream_interval
    other than 1 the call's coroutine wakes only when a message may go out (a completion's first token,
    `interval` tokens held, its end, or its worker's failure): one wake-up per token per call was most of
    the event loop's work."""
    index_of: dict[str, int] = field(default_factory=dict)
    group_of: dict[str, WorkerGroup] = field(default_factory=dict)  # where each completion runs now
    interval: int = 1
    outputs: list = field(default_factory=list)  # RequestOutputs (or FAILED) not taken yet
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    since_wake: dict[str, int] = field(default_factory=dict)  # tokens per completion since it last woke the call

    def put(self, out: RequestOutput | object) -> None:
        self.outputs.append(out)
        if out is FAILED or out.finished or self.interval == 1:
            self.ready.set()
            return
        first = out.request_id not in self.since_wake
        count = self.since_wake.get(out.request_id, 0) + len(out.token_ids)
        due = self.interval and count >= self.interval  # the call sends them all: the count starts over
        self.since_wake[out.request_id] = 0 if due else count
        if first or due:
            self.ready.set()

    async def take(self) -> list:
        """Every output put since the last take, once one of them calls for it."""
        await self.ready.wait()
        self.ready.clear()
        batch, self.outputs = self.outputs, []
        return batch


class GenerationService(splitserve_pb2_grpc.GenerationServicer):
    def __init__(self, model_dir: Path, config: SchedulerConfig, membership: MembershipConfig | None = None):
        self.model_dir, self.config = model_dir, config
        self.tokenizer = load_tokenizer(model_dir)
        self.loop = asyncio.get_running_loop()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count(1)
        self.accepting = True
        self.health = health.aio.HealthServicer()
        # Always there (served only with --metrics-port).
        self.metrics = SchedulerMetrics(lambda: self.members.groups)
        # joining, failing, moving requests, leaving (scheduler_svc/membership.py)
        self.members = Membership(self, membership, on_moved=self.metrics.requests_requeued.inc)
        self._finished = {r: self.metrics.requests_finished.labels(r) for r in FINISH}

    # ---- worker groups (membership.MembershipHost) -----------------------------------------------
    async def add_worker(self, address: str) -> WorkerGroup:
        """A static worker (--worker): waits for it to come up; reconnected whenever it fails."""
        return await self.members.add_static(address)

    @property
    def groups(self) -> list[WorkerGroup]:
        return self.members.groups

    def live_groups(self) -> list[WorkerGroup]:
        return self.members.live_groups()

    def open_group(self, address: str, timeout: float, wait_for_ready: bool, stale_epoch: int | None,
                   credentials: grpc.ChannelCredentials | None) -> WorkerGroup:
        group = WorkerGroup(address, self.model_dir, self.tokenizer, self.config, self._outputs_from_thread,
                            self._failure_from_thread, self.members.config.watch, timeout, wait_for_ready,
                            stale_epoch, credentials)
        group.engine.step_observer = self.metrics.step_observer(address)
        return group

    def is_streaming(self, request_id: str) -> bool:
        return request_id in self._streams

    def continue_on(self, request_id: str, group: WorkerGroup) -> bool:
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        stream.group_of[request_id] = group
        return True

    def lost(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(FAILED)

    async def groups_changed(self) -> None:
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
                stream.put(out)

    def _failure_from_thread(self, group: WorkerGroup, requests: list[EngineRequest], error: Exception) -> None:
        # Its requests move to the surviving groups (or end with UNAVAILABLE when none is left).
        self.loop.call_soon_threadsafe(self.members.group_failed, group, requests, error)

    @property
    def max_model_len(self) -> int:
        return min(g.engine.scheduler.max_model_len for g in (self.live_groups() or self.groups))

    @property
    def vocab_size(self) -> int:
        return (self.live_groups() or self.groups)[0].info.vocab_size or self.tokenizer.vocab_size

    # ---- RPCs ---------------------------------------------------------------------------------
    async def _reject(self, context, code: grpc.StatusCode, message: str) -> None:
        """Refuse a request before (or at) admission: counted by status, then the call ends."""
        self.metrics.requests_rejected.labels(code.name).inc()
        await context.abort(code, message)

    async def Generate(self, request: api.GenerateRequest, context: grpc.aio.ServicerContext):
        started = time.perf_counter()
        remaining = context.time_remaining()  # None: no deadline
        deadline = None if remaining is None else started + remaining
        if not self.accepting:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
        groups = self.live_groups()
        if not groups:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "no worker is serving")
        try:
            parsed = parse_generate(request, self.tokenizer, self.max_model_len, self.vocab_size)
        except InvalidRequest as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        subs = [rid] if parsed.n == 1 else [f"{rid}#{i}" for i in range(parsed.n)]
        if any(s in self._streams for s in subs):
            await self._reject(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is in use")
        hashes = PromptHashes(parsed.prompt_ids)  # for routing, and the sequence's prefix blocks
        group = pick_group(groups, hashes)
        interval = request.stream_interval if request.HasField("stream_interval") else 1
        stream = _Stream(index_of={s: i for i, s in enumerate(subs)}, interval=interval)
        for s in subs:
            self._streams[s] = stream
        pending = set(subs)
        submitted: set[str] = set()
        usage = api.Usage()
        # Metrics, per completion: tokens streamed, when its last message went out; the request's TTFT.
        metrics, itl = self.metrics, self.metrics.itl
        streamed = [0] * parsed.n
        last_sent = [0.0] * parsed.n
        reasons: list[str | None] = [None] * parsed.n
        first_token = True
        held_back: dict[int, api.GenerateResponse] = {}  # per completion, what stream_interval holds back
        try:
            # With n > 1 the first completion computes the prompt; the others start once it has, and
            # hit its cached blocks.
            await self._submit(group, parsed, hashes, subs[0], 0, context)
            submitted.add(subs[0])
            started_rest = parsed.n == 1
            while pending:
                batch = await stream.take()  # all that arrived since: coalesced when the client is slow
                if FAILED in batch:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        "its worker failed and no other worker is serving; retry the request")
                if not started_rest:
                    started_rest = True
                    for i, s in enumerate(subs[1:], 1):
                        await self._submit(stream.group_of.get(subs[0], group), parsed, hashes, s, i, context)
                        submitted.add(s)
                for response in _responses(rid, batch, stream.index_of):
                    i = response.index
                    if response.finish_reason:
                        pending.discard(subs[i])
                        u = response.usage
                        usage.prompt_tokens = u.prompt_tokens
                        usage.completion_tokens += u.completion_tokens
                        usage.cached_prompt_tokens += u.cached_prompt_tokens
                        reasons[i] = reason = _REASON[response.finish_reason]
                        self._finished[reason].inc()
                        metrics.prompt_tokens.inc(u.prompt_tokens)
                        metrics.cached_prompt_tokens.inc(u.cached_prompt_tokens)
                    if response.token_ids:
                        now = time.perf_counter()
                        if first_token:
                            first_token = False
                            metrics.ttft.observe(now - started)
                        elif last_sent[i]:
                            itl.observe(now - last_sent[i])
                        last_sent[i] = now
                        streamed[i] += len(response.token_ids)
                    if interval != 1:
                        response = _hold(held_back, response, interval)
                    if response is not None:
                        await context.write(response)
        finally:
            for s in subs:
                self._streams.pop(s, None)
                if s in pending:  # cancelled, failed or deadline passed: free its blocks now
                    stream.group_of.get(s, group).abort(s)
            # Every completion handed to the engine counts once: by its finish reason, or as an abort.
            aborted = len(pending & submitted)
            if aborted:
                self._finished["abort"].inc(aborted)
            elapsed = time.perf_counter() - started
            if submitted:
                metrics.generation_tokens.inc(sum(streamed))
                metrics.e2e.observe(elapsed)
            status = "cancelled" if pending else "done"
            # The client's own timer usually cancels the call a moment before the server's fires.
            if pending and deadline is not None and time.perf_counter() >= deadline - DEADLINE_SLACK_S:
                status = "cancelled (deadline passed)"
            log.info("request %s: group %s, n=%d, prompt %d tokens, completion %d tokens, cached %d, %s, %.3f s",
                     rid, group.address, parsed.n, len(parsed.prompt_ids), sum(streamed),
                     usage.cached_prompt_tokens, status, elapsed,
                     extra={"request_id": rid, "worker": group.address, "n": parsed.n, "priority": parsed.priority,
                            "prompt_tokens": len(parsed.prompt_ids), "completion_tokens": sum(streamed),
                            "cached_tokens": usage.cached_prompt_tokens, "status": status,
                            "finish_reason": reasons[0] if parsed.n == 1 else reasons,
                            "latency_s": round(elapsed, 6)})

    async def _submit(self, group: WorkerGroup, parsed, hashes: PromptHashes, sub_id: str, index: int,
                      context) -> None:
        try:
            while True:
                if not group.alive or group.draining:  # gone since it was picked: pick again
                    if not (groups := self.live_groups()):
                        await self._reject(context, grpc.StatusCode.UNAVAILABLE, "no worker is serving")
                    group = pick_group(groups, hashes)
                self._streams[sub_id].group_of[sub_id] = group  # before the add: a cancel aborts it there
                try:
                    await asyncio.wrap_future(group.add(hashes, parsed.completion_params(index), sub_id,
                                                        parsed.priority))
                    return
                except GroupUnavailable:
                    continue
        except QueueFullError as e:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

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
            limit = self.max_model_len if self.groups else 1 << 16
            if request.WhichOneof("prompt") == "text":
                check_text_size(request.text, "text", max_prompt_bytes(limit))
                ids = self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
            else:
                ids = prompt_ids(request, self.tokenizer, self.tokenizer.vocab_size, limit)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return api.TokenizeResponse(token_ids=ids, tokens=[self.tokenizer.tokenizer.id_to_token(i) or ""
                                                           for i in ids])

    async def drain(self, grace: float) -> None:
        """Stops admitting, lets running requests finish within the grace period."""
        self.accepting = False
        await self.groups_changed()
        await self.members.stop()
        deadline = time.monotonic() + grace
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def _hold(held_back: dict[int, api.GenerateResponse], response: api.GenerateResponse,
          interval: int) -> api.GenerateResponse | None:
    """Joins `response` to what its completion holds back; returns the message to send once it holds
    `interval` tokens (0: never) or the completion ended, else None."""
    joined = held_back.pop(response.index, None)
    if joined is not None:
        joined.token_ids.extend(response.token_ids)
        joined.text += response.text
        joined.logprobs.extend(response.logprobs)
        joined.finish_reason, joined.stop_reason = response.finish_reason, response.stop_reason
        if response.HasField("usage"):
            joined.usage.CopyFrom(response.usage)
        response = joined
    if response.finish_reason or (interval and len(response.token_ids) >= interval):
        return response
    held_back[response.index] = response
    return None


def _responses(rid: str, batch: list[RequestOutput], index_of: dict[str, int]) -> list[api.GenerateResponse]:
    """One response per completion in the batch, with all its new tokens."""
    outputs: dict[int, list[RequestOutput]] = {}
    for out in batch:
        outputs.setdefault(index_of[out.request_id], []).append(out)
    return [_response(rid, index, outs) for index, outs in outputs.items()]


def _response(rid: str, index: int, outs: list[RequestOutput]) -> api.GenerateResponse:
    # Joined once: with stream_interval 0 a completion's ~1,000 outputs come in one batch, and appending
    # each one's text to the message's string field copies (and checks) the whole text every time.
    r = api.GenerateResponse(request_id=rid, index=index, text="".join(out.text for out in outs),
                             token_ids=[t for out in outs for t in out.token_ids])
    for out in outs:
        for lp in out.logprobs or ():
            r.logprobs.add(logprob=lp.logprob,
                           top=[api.TopLogprob(token_id=t, logprob=p) for t, p in (lp.top or [])])
    last = outs[-1]  # a completion's final output is its last
    if last.finished:
        r.finish_reason = FINISH.get(last.finish_reason, api.FINISH_REASON_STOP)
        r.stop_reason = last.stop_reason or ""
        if last.usage is not None:
            r.usage.prompt_tokens = last.usage.prompt_tokens
            r.usage.completion_tokens = last.usage.completion_tokens
            r.usage.cached_prompt_tokens = last.usage.cached_prompt_tokens
    return r


async def serve(model_dir: Path, workers: list[str], host: str, port: int, config: SchedulerConfig,
                metrics_port: int = 0, membership: MembershipConfig | None = None, *,
                tls: TLSConfig | None, registration_secret: bytes | None = None,
                api_keys: frozenset[str] = frozenset()) -> tuple[grpc.aio.Server, GenerationService, int]:
    """tls: this port's and the worker links' TLS material; None (--plaintext) serves and calls in the clear.
    registration_secret and api_keys: see common.security."""
    membership = membership or MembershipConfig()
    if tls is not None and membership.worker_credentials is None:  # scheduler -> worker: the same material
        membership = dataclasses.replace(membership, worker_credentials=tls.channel_credentials)
    service = GenerationService(model_dir, config, membership)
    interceptors = []
    keys = ApiKeys(api_keys)
    if keys:  # the Generation service only; a refused Generate counts as a rejected request
        refused = service.metrics.requests_rejected.labels(grpc.StatusCode.UNAUTHENTICATED.name)
        interceptors.append(ApiKeyInterceptor(keys, [SERVICE],
                                              lambda method: refused.inc() if method.endswith("/Generate") else None))
    server = grpc.aio.server(interceptors=interceptors, options=PUBLIC_SERVER_OPTIONS)
    policy = RegistrationPolicy(transport(tls), registration_secret)
    splitserve_pb2_grpc.add_GenerationServicer_to_server(service, server)
    membership_pb2_grpc.add_MembershipServicer_to_server(MembershipService(service.members, policy), server)
    health_pb2_grpc.add_HealthServicer_to_server(service.health, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = add_port(server, f"{host}:{port}", tls)
    if tls is None:
        log.warning("PLAINTEXT gRPC on %s:%d (--plaintext): no encryption, no authentication of workers or "
                    "clients by certificate; a local demo only", host, bound)
    else:
        log.info("%s on %s:%d%s", tls.mode, host, bound,
                 ": callers need a certificate signed by the CA" if tls.mutual else "")
    log.info("%s; client API keys: %s", policy.describe(), f"{len(api_keys)} accepted" if keys else "off")
    if metrics_port:
        service.metrics.serve(metrics_port, host)
        log.info("metrics on %s:%d/metrics", host, metrics_port, extra={"metrics_port": metrics_port})
    await service.groups_changed()
    await server.start()
    service.members.start()
    for address in workers:
        await service.add_worker(address)
    return server, service, bound
