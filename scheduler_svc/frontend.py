"""A front-end process of the scheduler tree: the public gRPC API (Generate, model info, tokenize, health,
reflection, and worker Register / Deregister, which it hands to the supervisor) on the service's one port. Every
front-end binds the same port (SO_REUSEPORT: the kernel spreads client connections over them).

A front-end holds its requests' client-facing state: prompt, parameters and resolved seed, the tokens received
so far, the detokenizer (text, stop strings) and the client stream. It validates, tokenizes and routes each
request to a worker group (router.py), whose engine process sends back token ids, one message per step; it
turns them into text and streams it. A stop string found here finishes the sequence at its engine (one wasted
token at most, as with pipelining). When a group goes (its worker died, drains, or its engine process died),
the front-end continues each of its requests there on another group with its prompt plus the tokens received
so far (recompute, same seed): the client sees exactly the tokens it would have seen; with no group left the
stream ends with UNAVAILABLE.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
import uuid
from pathlib import Path
from array import array
from dataclasses import dataclass, field

import grpc
import zmq
import zmq.asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import model_files
from common.security import ApiKeyInterceptor, ApiKeys, RegistrationPolicy, add_port, transport
from common.util import freeze_heap, run_loop
from protos import membership_pb2_grpc, splitserve_pb2_grpc
from protos import splitserve_pb2 as api
from scheduler_svc import ipc
from scheduler_svc.beam_search import beam_search
from scheduler_svc.metrics import FrontendMetrics
from scheduler_svc.output import OutputState, class_probs, embedding
from scheduler_svc.prefix_hash import PromptHashes
from scheduler_svc.registration import MembershipService
from scheduler_svc.requests import (InvalidRequest, ParsedEmbed, ParsedRequest, check_text_size, max_prompt_bytes,
                                    parse_classify, parse_embed, parse_generate, prompt_ids)
from scheduler_svc.responses import FINISH, REASON, abort, hold, response_of, write
from scheduler_svc.router import GroupInfo, GroupView, pick_group, serving
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.sequence import TokenLogprob
from scheduler_svc.tokenizer import ModelTokenizer, load_tokenizer
from scheduler_svc.write_slots import WriteSlots

log = logging.getLogger("splitserve.scheduler")
SERVICE = api.DESCRIPTOR.services_by_name["Generation"].full_name
DEADLINE_SLACK_S = 0.1  # a call cancelled this close to its deadline is logged as a passed deadline
WRITE_SLOTS = 32  # writes in flight per front-end (WriteSlots says why)
WRITE_HOLD_S = 0.1  # a write not completed after this (a client not reading) holds no slot
# gRPC core cancels, with status CANCELLED and no message, incoming calls that wait for the server to take them
# once more than max_pending_requests (1,000) are pending, and any that waited longer than
# server_max_unrequested_time_in_server (30 s). A burst of new streams larger than the first lost the excess; a
# saturated front-end takes new calls slowly (bench grpc-accept), so thousands of streams opened at once on one
# waited past the second. Admission is this service's job (RESOURCE_EXHAUSTED, with a message) and a client's
# deadline bounds its wait (DEADLINE_EXCEEDED), so both bounds are far away.
MAX_PENDING_CALLS = 1 << 17
MAX_UNTAKEN_S = 7 * 24 * 3600
PUBLIC_SERVER_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                         ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                         ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
                         ("grpc.server_max_unrequested_time_in_server", MAX_UNTAKEN_S),
                         ("grpc.so_reuseport", 1)]
NO_WORKER_LEFT = "its worker failed and no other worker is serving; retry the request"
MAX_ADAPTER_NAME = 256  # characters of a LoRA adapter's name (the gateway's `model`)
# what an engine's refusal of an add means for the client
_REFUSED = {"full": grpc.StatusCode.RESOURCE_EXHAUSTED, "fit": grpc.StatusCode.INVALID_ARGUMENT}


@dataclass(slots=True)
class _Stream:
    """The completions of one client call (all its n) with output not sent yet, fed by the receive loop. With a
    stream_interval other than 1 the call's coroutine wakes only when a message may go out (a completion's first
    token, `interval` tokens held, its end, or its failure): one wake-up per token per call was most of the event
    loop's work."""
    interval: int = 1
    outputs: list[Completion] = field(default_factory=list)  # in the order their output came
    failed: str = ""  # why its request cannot continue anywhere: the call ends UNAVAILABLE with it
    due: bool = False  # an output calls for the call to wake
    waiter: asyncio.Future | None = None  # while the call waits

    def put(self, c: Completion, count: int, final: bool) -> None:
        """c has output to send: `count` more tokens, and whether it ended."""
        if not c.queued:
            c.queued = True
            self.outputs.append(c)
        if final or self.interval == 1:
            self._wake()
            return
        first = c.since_wake < 0
        count += max(c.since_wake, 0)
        due = self.interval and count >= self.interval  # the call sends them all: the count starts over
        c.since_wake = 0 if due else count
        if first or due:
            self._wake()

    def fail(self, why: str) -> None:
        self.failed = why
        self._wake()

    def _wake(self) -> None:
        self.due = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until an output calls for the call to wake."""
        if not self.due:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def take(self) -> list[Completion]:
        """The completions with output since the last take."""
        self.due = False
        batch, self.outputs = self.outputs, []
        for c in batch:
            c.queued = False
        return batch


@dataclass(slots=True, eq=False)
class Completion:
    """One of a request's n completions, as this front-end carries it."""
    key: int  # this front-end's id of it, in its engine's messages
    sub_id: str
    index: int  # among its request's n
    stream: _Stream
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    text: OutputState
    tokens: list[int] = field(default_factory=list)  # generated so far
    group: GroupView | None = None  # where it runs now
    ack: asyncio.Future | None = None  # while its engine has not answered its add
    prompt_logprobs: list[TokenLogprob] | None = None  # from its engine, until its first message carries them
    pooled: array | None = None  # an embedding request's pooled row, from its engine (Sequence.pooled)
    scheduled_at: float | None = None  # time.monotonic() its engine first admitted it (every process's clock)
    # Its output not sent yet (what its next message carries), reused from message to message.
    out_tokens: list[int] = field(default_factory=list)
    out_text: list[str] = field(default_factory=list)
    out_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # once it ended
    prompt_ids_due: bool = False  # its next message carries the prompt's token ids (return_prompt_token_ids)
    stop_reason: str | None = None
    weight_version: str = ""  # once it ended: its group's, whose weights computed its tokens
    queued: bool = False  # in its stream's outputs
    since_wake: int = -1  # tokens since it last woke its call (stream_interval other than 1); -1: none yet

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def move_to(self, group: GroupView | None) -> None:
        """Runs on `group` from now (None: nowhere): its tokens count in that group's load as this front-end
        routes (router.py), and each token it generates there adds one."""
        held = len(self.prompt_ids) + len(self.tokens)
        if self.group is not None:
            self.group.own_tokens -= held
        if group is not None:
            group.own_tokens += held
        self.group = group


class Frontend(splitserve_pb2_grpc.GenerationServicer):
    def __init__(self, index: int, num_frontends: int, run_dir: str, tokenizer: ModelTokenizer, model_dir: str,
                 allow_lora_updating: bool = False, lora_resolver_dir: str | None = None,
                 sampling_defaults: dict | None = None, allow_weight_updates: bool = False, table_delay: float = 0.0):
        self.index, self.num_frontends, self.run_dir, self.tokenizer = index, num_frontends, run_dir, tokenizer
        self.sampling_defaults = sampling_defaults or {}  # the model's, for fields a request leaves unset
        self.model_dir, self.allow_lora_updating = model_dir, allow_lora_updating
        self.allow_weight_updates = allow_weight_updates
        self.lora_resolver_dir = Path(lora_resolver_dir) if lora_resolver_dir else None
        self._resolving: dict[str, asyncio.Future] = {}  # adapter name -> its load from lora_resolver_dir
        self.loop = asyncio.get_running_loop()
        self.groups: dict[int, GroupView] = {}
        self.completions: dict[int, Completion] = {}
        self._streams: dict[str, _Stream] = {}
        self._keys = itertools.count(1)
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future] = {}
        self.table_delay = table_delay  # testing only: seconds before each table from the supervisor is read
        self.accepting = True
        self.health = health.aio.HealthServicer()
        self.metrics = FrontendMetrics()
        self.write_slots = WriteSlots(WRITE_SLOTS, WRITE_HOLD_S)
        self._finished = {r: self.metrics.requests_finished.labels(r) for r in FINISH}
        self.out = ipc.Outboxes(zmq.Context.instance(), run_dir)
        self.server: grpc.aio.Server | None = None
        self.stopped = asyncio.Event()

    # ---- the worker groups --------------------------------------------------------------------------
    def groups_by_address(self, address: str) -> GroupView | None:
        return next((g for g in self.groups.values() if g.address == address), None)

    def live_groups(self) -> list[GroupView]:
        return [g for g in self.groups.values() if not g.info.draining]

    @property
    def max_model_len(self) -> int:
        return min(g.info.max_model_len for g in (self.live_groups() or self.groups.values()))

    @property
    def lora_adapters(self) -> list[str]:
        """The LoRA adapters some live group serves (a request under one goes to a group that serves it)."""
        return list(dict.fromkeys(name for g in self.live_groups() for name in g.info.lora_adapters))

    async def read_current_table(self) -> None:
        """Reads the supervisor's table of groups as it is now (it sends the table ahead of its reply). This
        front-end's view may lag what another front-end on the port has told a client (SERVING as a cluster starts or
        a worker comes back, an adapter loaded), which that client's next connection, landing here, may rely on."""
        await self.ask_supervisor(["table"])

    async def serving_groups(self, lora: str = "") -> list[GroupView]:
        """The live groups, the current table read first where this front-end's view would refuse the call: no
        group, or none serving the LoRA adapter `lora`."""
        if self.accepting and (not self.live_groups() or lora and lora not in self.lora_adapters):
            await self.read_current_table()
        return self.live_groups()

    def _candidates(self, c: Completion, tried: set[int]) -> list[GroupView]:
        """The live groups a completion may go to: not tried yet, and serving its LoRA adapter."""
        return serving([g for g in self.live_groups() if g.group_id not in tried], c.params.lora)

    @property
    def vocab_size(self) -> int:
        groups = self.live_groups() or list(self.groups.values())
        return groups[0].info.vocab_size or self.tokenizer.vocab_size

    async def update_health(self) -> None:
        serving = self.accepting and bool(self.live_groups())
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(SERVICE, status)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)  # liveness

    def _table(self, infos: list[dict]) -> None:
        """The supervisor's table of live groups: new ones are mirrored from a snapshot of their cache, gone
        ones have their requests continue elsewhere."""
        now = {}
        for d in infos:
            info = GroupInfo(**d)
            view = self.groups.get(info.group_id)
            if view is None:
                view = GroupView(info)
                self._to_engine(info.engine, ["snapshot", self.index, info.group_id])
            view.info = info
            now[info.group_id] = view
        gone = [g for gid, g in self.groups.items() if gid not in now]
        self.groups = now
        for g in gone:
            self._group_gone(g.group_id, [c.key for c in self.completions.values() if c.group is g])
        asyncio.ensure_future(self.update_health())

    def _to_engine(self, engine: int, message: list) -> None:
        self.out.send(ipc.engine_name(engine), message)

    # ---- messages from engines and the supervisor ----------------------------------------------------
    async def receive(self, inbox: zmq.asyncio.Socket) -> None:
        while True:
            data = await inbox.recv()
            try:
                message = ipc.unpack(data)
                if self.table_delay and message[0] == "groups":
                    await asyncio.sleep(self.table_delay)
                self._handle(message)
            except Exception:
                log.exception("front-end %d: a message failed", self.index)
            await asyncio.sleep(0)  # a waiting recv() does not yield: let the streams write between messages

    def _handle(self, message: list) -> None:
        op = message[0]
        if op == "out":
            self._outputs(message)
        elif op == "ack":
            _, gid, key, code, text = message
            c = self.completions.get(key)
            if (c is not None and c.ack is not None and not c.ack.done() and c.group is not None
                    and c.group.group_id == gid):
                c.ack.set_result((code, text))
        elif op == "ended":  # [ended, group, keys, ""]: aborted by the engine (a weight update's abort_requests)
            self._aborted(message[1], list(ipc.unints(message[2])))
        elif op == "moved":  # [moved, group, keys, why they left ("": it drains)]
            self._group_gone(message[1], list(ipc.unints(message[2])), message[3])
        elif op == "down":
            self.groups.pop(message[1], None)
            self._group_gone(message[1], list(ipc.unints(message[2])))
        elif op == "groups":
            self._table(message[1])
        elif op == "reply":
            future = self._replies.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])
        elif op == "metrics":
            self.out.send(ipc.SUPERVISOR, ["metrics", message[1], self.metrics.text()])
        elif op == "drain":
            asyncio.ensure_future(self._drain())
        elif op == "exit":
            asyncio.ensure_future(self._exit())

    def _outputs(self, message: list) -> None:
        gid = message[1]
        group = self.groups.get(gid)
        if group is not None:
            events = message[3]
            group.report(message[2], events, *((ipc.unints(events[0], "Q"), ipc.unints(events[1], "Q"))
                                               if events else ((), ())))
        if len(message) == 4:
            return
        keys, tokens = ipc.unints(message[4]), ipc.unints(message[5], "i")
        finished, first, logprobs = dict(message[6]), message[7], message[8]
        completions = self.completions
        for i, cached, prompt, scheduled_at, pooled in first:
            c = completions.get(keys[i])
            if c is not None and c.text.cached_tokens is None:
                c.text.cached_tokens, c.scheduled_at = cached, scheduled_at
            if c is not None and pooled is not None:
                c.pooled = ipc.unfloats(pooled)
            if c is not None and prompt is not None and not c.tokens:
                c.prompt_logprobs = [TokenLogprob(t, v, [tuple(x) for x in top] if top else None)
                                     for t, v, top in prompt]
        for i, key in enumerate(keys):
            c = completions.get(key)
            if c is None or (g := c.group) is None or g.info.group_id != gid:
                continue  # finished, aborted or moved since
            token = tokens[i]
            reason = finished.get(i)
            state = c.text
            if state.scoring:  # the token sampled at the prompt's end finished it: none of it is output
                self._end(c, "length", 0)
                continue
            c.tokens.append(token)
            g.own_tokens += 1
            text, reason_now, stop_reason = state.next(token, reason)
            c.out_tokens.append(token)
            c.out_text.append(text)
            if logprobs is not None and logprobs[i] is not None:
                value, top = logprobs[i]
                if c.out_logprobs is None:
                    c.out_logprobs = []
                c.out_logprobs.append(TokenLogprob(token, value, [tuple(t) for t in top] if top else None))
            if reason_now is None:
                c.stream.put(c, 1, False)
                continue
            if reason_now == "stop" and reason is None:  # a stop string, and its engine still runs it
                self._to_engine(g.info.engine, ["stop", self.index, key, gid])
            c.stop_reason = stop_reason
            self._end(c, reason_now, 1)

    def _end(self, c: Completion, reason: str, count: int) -> None:
        """c ended with `reason`, with `count` more tokens to send: its stream sends them and its last message."""
        c.finish_reason = reason
        if c.group is not None:
            c.weight_version = c.group.weight_version
        del self.completions[c.key]
        c.move_to(None)
        c.stream.put(c, count, True)

    def _aborted(self, group_id: int, keys: list[int]) -> None:
        """These requests were ended by group `group_id`: each ends with finish reason "abort" and the tokens it has
        (text held back for a stop string that did not come included)."""
        for key in keys:
            c = self.completions.get(key)
            if c is None or c.group is None or c.group.group_id != group_id:
                continue
            if held := c.text.detokenizer.flush():
                c.out_text.append(held)
            self._end(c, "abort", 0)

    def _group_gone(self, group_id: int, keys: list[int], why: str = "") -> None:
        """These requests left group `group_id` unfinished (it failed, drained or its engine died, or it lost their
        LoRA adapter: `why`): each one still there continues elsewhere, or its add is answered as refused. One that
        has moved on already (the supervisor's table and the engine's notice both report a group's loss, in either
        order) is left alone."""
        for key in keys:
            c = self.completions.get(key)
            if c is None or c.group is None or c.group.group_id != group_id:
                continue
            if c.ack is not None and not c.ack.done():
                c.ack.set_result(("gone", f"worker {c.group.address} is gone"))
                continue
            c.move_to(None)
            asyncio.ensure_future(self._move(c, group_id, why))

    async def _move(self, c: Completion, left: int, why: str = "") -> None:
        """Continues a completion whose group went, on the live group that costs least (its prompt plus the
        tokens received so far are recomputed there); with none left, its stream ends with UNAVAILABLE (and why)."""
        hashes = PromptHashes(c.token_ids(), c.params.hash_root)
        tried = {left}  # the group it left: gone, draining, or without its adapter now
        while c.key in self.completions:
            groups = self._candidates(c, tried)
            if not groups:
                log.warning("request %s: no live worker left to continue it", c.sub_id,
                            extra={"request_id": c.sub_id})
                self.completions.pop(c.key, None)
                c.stream.fail(f"{why}, and no other worker serves it" if why else NO_WORKER_LEFT)
                return
            group = pick_group(groups, hashes, self.num_frontends)
            code, text = await self._add(c, group, hashes, force=True)
            if code == "":
                self.metrics.requests_requeued.inc()
                log.info("request %s moved to worker %s: %d prompt + %d generated tokens to recompute", c.sub_id,
                         group.address, len(c.prompt_ids), len(c.tokens),
                         extra={"request_id": c.sub_id, "worker": group.address})
                return
            log.warning("request %s: cannot continue on %s: %s", c.sub_id, group.address, text,
                        extra={"request_id": c.sub_id, "worker": group.address})
            tried.add(group.group_id)

    async def _add(self, c: Completion, group: GroupView, hashes: PromptHashes, force: bool = False) -> tuple[str, str]:
        """Sends the completion's add to the group's engine and waits for its answer: ("", "") when queued, else
        (refusal code, message)."""
        c.move_to(group)
        c.ack = self.loop.create_future()
        tokens = c.token_ids()
        params = c.params
        self._to_engine(group.info.engine, [
            "add", self.index, c.key, group.group_id, len(c.prompt_ids), ipc.ints(tokens, "i"), params.engine_fields(),
            c.priority, force, ipc.ints(hashes.of(group.info.block_size), "Q")])
        try:
            return await c.ack
        finally:
            c.ack = None

    # ---- RPCs -------------------------------------------------------------------------------------
    async def _reject(self, context, code: grpc.StatusCode, message: str) -> None:
        """Refuse a request before (or at) admission: counted by status, then the call ends."""
        self.metrics.requests_rejected.labels(code.name).inc()
        await abort(context, code, message)

    async def Generate(self, request: api.GenerateRequest, context: grpc.aio.ServicerContext):
        started, arrived = time.perf_counter(), time.monotonic()
        remaining = context.time_remaining()  # None: no deadline
        deadline = None if remaining is None else started + remaining
        if not self.accepting:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
        if not await self.serving_groups(request.lora):
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "no worker is serving")
        await self._resolve_adapter(request.lora, context)
        try:
            parsed = parse_generate(request, self.tokenizer, self.max_model_len, self.vocab_size, self.lora_adapters,
                                    self.sampling_defaults)
        except InvalidRequest as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or f"req-{self.index}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        subs = [rid] if parsed.n == 1 else [f"{rid}#{i}" for i in range(parsed.n)]
        if any(s in self._streams for s in subs):
            await self._reject(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is in use")
        if parsed.beam_search:
            return await self._beam_search(rid, parsed, request.return_prompt_token_ids, context, arrived)
        hashes = PromptHashes(parsed.prompt_ids, parsed.params.hash_root)  # routing, and the sequences' prefix blocks
        interval = request.stream_interval if request.HasField("stream_interval") else 1
        stream = _Stream(interval=interval)
        completions = []
        for i, s in enumerate(subs):
            params = parsed.completion_params(i)
            completions.append(Completion(next(self._keys), s, i, stream, parsed.prompt_ids, params, parsed.priority,
                                          OutputState(s, self.tokenizer.tokenizer, parsed.prompt_ids,
                                                      len(parsed.prompt_ids), params),
                                          prompt_ids_due=request.return_prompt_token_ids))
            self._streams[s] = stream
        pending = set(subs)
        reached = False  # the first completion reached an engine
        usage = api.Usage()
        # Metrics, per completion: tokens streamed, when its last message went out; the request's TTFT.
        metrics, itl = self.metrics, self.metrics.itl
        streamed = [0] * parsed.n
        last_sent = [0.0] * parsed.n
        first_at = [0.0] * parsed.n  # when each completion's first token came
        reasons: list[str | None] = [None] * parsed.n
        first_token = True
        held_back: dict[int, api.GenerateResponse] = {}  # per completion, what stream_interval holds back
        where = "-"  # the group the request was routed to, for the log
        try:
            # With n > 1 the first completion computes the prompt; the others start once it has, on the same
            # group, and hit its cached blocks.
            where = (await self._submit(completions[0], hashes, context)).address
            reached = True
            started_rest = parsed.n == 1
            while pending:
                await stream.wait()
                if stream.failed:
                    await abort(context, grpc.StatusCode.UNAVAILABLE, stream.failed)
                slot = await self.write_slots.take()  # given back by its hold time at the latest
                try:
                    # All that arrived until now, the wait for a slot included: coalesced when the client or the
                    # front-end is slow.
                    responses = [(c.index, len(c.out_tokens), response_of(rid, c)) for c in stream.take()]
                    if not started_rest:
                        started_rest = True
                        for c in completions[1:]:
                            await self._submit(c, hashes, context,
                                               prefer=completions[0].group or self.groups_by_address(where))
                    for i, count, response in responses:
                        if response.finish_reason:
                            pending.discard(subs[i])
                            reasons[i] = REASON[response.finish_reason]
                            self._finished[reasons[i]].inc()
                            u = response.usage
                            usage.prompt_tokens = u.prompt_tokens
                            usage.completion_tokens += u.completion_tokens
                            usage.cached_prompt_tokens += u.cached_prompt_tokens
                            metrics.observe_end(u, arrived, first_at[i], completions[i].scheduled_at)
                        if count:
                            now = time.perf_counter()
                            first_at[i] = first_at[i] or time.monotonic()
                            if first_token:
                                first_token = False
                                metrics.ttft.observe(now - started)
                            elif last_sent[i]:
                                itl.observe(now - last_sent[i])
                            last_sent[i] = now
                            streamed[i] += count
                        if interval != 1:
                            response = hold(held_back, response, interval)
                        if response is not None and not await write(context, response):
                            return
                finally:
                    slot.give_back()
        finally:
            # sent to an engine and not refused, also where the call ended while the engine's answer was on its way
            if not reached and completions[0].group is not None:
                reached, where = True, completions[0].group.address
            for c in completions:
                self._streams.pop(c.sub_id, None)
                if c.sub_id in pending:  # cancelled, failed or deadline passed: free its blocks now
                    self._abort(c)
            # Once the first completion reached an engine, every completion counts once: by its finish reason, or
            # as an abort (those of n > 1 that the call ended before they were submitted too).
            aborted = len(pending) if reached else 0
            if aborted:
                self._finished["abort"].inc(aborted)
            elapsed = time.perf_counter() - started
            if reached:
                metrics.generation_tokens.inc(sum(streamed))
                metrics.e2e.observe(elapsed)
            status = "cancelled" if pending else "done"
            # The client's own timer usually cancels the call a moment before the server's fires.
            if pending and deadline is not None and time.perf_counter() >= deadline - DEADLINE_SLACK_S:
                status = "cancelled (deadline passed)"
            log.info("request %s: group %s, n=%d, prompt %d tokens, completion %d tokens, cached %d, %s, %.3f s",
                     rid, where, parsed.n, len(parsed.prompt_ids), sum(streamed), usage.cached_prompt_tokens, status,
                     elapsed, extra={"request_id": rid, "worker": where, "n": parsed.n, "priority": parsed.priority,
                                     "prompt_tokens": len(parsed.prompt_ids), "completion_tokens": sum(streamed),
                                     "cached_tokens": usage.cached_prompt_tokens, "status": status,
                                     "finish_reason": reasons[0] if parsed.n == 1 else reasons,
                                     "latency_s": round(elapsed, 6)})

    async def _submit(self, c: Completion, hashes: PromptHashes, context,
                      prefer: GroupView | None = None) -> GroupView:
        """Routes the completion (to `prefer` while it serves) and queues it there; refusals end the call."""
        self.completions[c.key] = c
        tried: set[int] = set()
        while True:
            groups = self._candidates(c, tried)
            if not groups:
                self.completions.pop(c.key, None)
                if c.params.lora and self.live_groups():  # none serves it: unloaded or lost since it was checked
                    await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, f"lora {c.params.lora!r} is "
                                       "not served")
                await self._reject(context, grpc.StatusCode.UNAVAILABLE, "no worker is serving")
            group = prefer if prefer is not None and prefer in groups else pick_group(groups, hashes, self.num_frontends)
            code, text = await self._add(c, group, hashes)
            if code == "":
                return group
            if code in _REFUSED:
                self.completions.pop(c.key, None)
                c.move_to(None)
                await self._reject(context, _REFUSED[code], text)
            tried.add(group.group_id)  # gone meanwhile, or without its adapter now: pick again

    def _abort(self, c: Completion) -> None:
        self.completions.pop(c.key, None)
        if c.group is not None:
            self._to_engine(c.group.info.engine, ["abort", self.index, ipc.ints([c.key]), c.group.group_id])
            c.move_to(None)

    async def Embed(self, request: api.EmbedRequest, context: grpc.aio.ServicerContext) -> api.EmbedResponse:
        """Each input runs as a sequence that computes its prompt and samples nothing (max_tokens 0, the model's
        pooling); its pooled row comes with its end, then is truncated and normalised here."""
        arrived = time.monotonic()
        groups = await self._pooling_groups(context, request.lora)
        if groups[0].info.labels:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "this model is a sequence classifier "
                               "(its worker's head is a classifier's): it serves Classify, not Embed")
        try:
            pooling = model_files.pooling(self.model_dir)
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.UNIMPLEMENTED, str(e))
        await self._resolve_adapter(request.lora, context)
        try:
            parsed = parse_embed(request, self.tokenizer, self.max_model_len, self.vocab_size,
                                 min(g.info.hidden_size for g in groups), self.lora_adapters)
        except InvalidRequest as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or f"emb-{self.index}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        completions = await self._pool(rid, parsed, pooling.kind, context, arrived)
        normalize = pooling.normalize if parsed.normalize is None else parsed.normalize
        response = api.EmbedResponse(request_id=rid, pooling=pooling.kind)
        for c in completions:
            response.embeddings.add(values=embedding(c.pooled, pooling.kind, len(c.prompt_ids), parsed.dimensions,
                                                     normalize), prompt_tokens=len(c.prompt_ids))
        return response

    async def Classify(self, request: api.ClassifyRequest,
                       context: grpc.aio.ServicerContext) -> api.ClassifyResponse:
        """As Embed, with the pooled row of the token the classifier reads (the last, or an encoder's first)
        through its head (on the worker), then its activation here."""
        arrived = time.monotonic()
        info = (await self._pooling_groups(context, request.lora))[0].info
        if not info.labels:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "this model is not a sequence classifier "
                               "(config.json, with the worker's --hf-overrides, names no ForSequenceClassification): "
                               "it serves Embed, not Classify")
        await self._resolve_adapter(request.lora, context)
        try:
            parsed = parse_classify(request, self.tokenizer, self.max_model_len, self.vocab_size, self.lora_adapters)
        except InvalidRequest as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or f"cls-{self.index}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        completions = await self._pool(rid, parsed, info.label_pooling, context, arrived)
        response = api.ClassifyResponse(request_id=rid, labels=info.labels)
        for c in completions:
            response.classifications.add(probs=class_probs(c.pooled, info.label_activation), logits=c.pooled,
                                         prompt_tokens=len(c.prompt_ids))
        return response

    async def _pooling_groups(self, context: grpc.aio.ServicerContext, lora: str) -> list[GroupView]:
        if not self.accepting:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
        groups = await self.serving_groups(lora)
        if not groups:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "no worker is serving")
        return groups

    async def _pool(self, rid: str, parsed: ParsedEmbed, pooling: str, context: grpc.aio.ServicerContext,
                    arrived: float) -> list[Completion]:
        """Runs each input as a sequence that computes its prompt and samples nothing (max_tokens 0, pooled by
        `pooling`) and waits for all of them; their pooled rows come with their ends. Whatever did not end (the call
        cancelled, failed or past its deadline) is aborted, so its blocks are freed now. Each input that reached an
        engine counts as a request in the request metrics, as vLLM counts pooling requests: one that finished
        ("stop", with its prompt tokens and phases once the call succeeds), or an abort; the call's end-to-end
        latency is the request latency."""
        subs = [f"{rid}#{i}" for i in range(len(parsed.inputs))]
        if any(s in self._streams for s in subs):
            await self._reject(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is in use")
        params = SamplingParams(max_tokens=0, temperature=0.0, seed=0, pooling=pooling, lora=parsed.lora)
        completions = self._completions(subs, parsed.inputs, params, parsed.priority)
        await self._run_all(completions, context, counted=True)
        if any(c.pooled is None for c in completions):  # never from this project's workers
            await abort(context, grpc.StatusCode.INTERNAL, "a worker returned no pooled row")
        for c in completions:
            self.metrics.observe_end(c.text.usage(), arrived, 0.0, c.scheduled_at)
        elapsed = time.monotonic() - arrived
        self.metrics.e2e.observe(elapsed)
        tokens = sum(len(ids) for ids in parsed.inputs)
        log.info("pooled %s: %d inputs, %d tokens, %.3f s", rid, len(completions), tokens, elapsed,
                 extra={"request_id": rid, "prompt_tokens": tokens})
        return completions

    def _completions(self, subs: list[str], prompts: list[list[int]], params: SamplingParams,
                     priority: int) -> list[Completion]:
        """Completions of one call that run at once and are read when all have ended (_run_all), on one stream."""
        stream = _Stream(interval=0)
        return [Completion(next(self._keys), sub, i, stream, ids, params, priority,
                           OutputState(sub, self.tokenizer.tokenizer, ids, len(ids), params))
                for i, (sub, ids) in enumerate(zip(subs, prompts))]

    async def _run_all(self, completions: list[Completion], context: grpc.aio.ServicerContext, counted: bool) -> None:
        """Submits the completions at once and waits until every one ended. Whatever did not end (the call cancelled,
        failed or past its deadline) is aborted, so its blocks are freed now. counted: each one that reached an engine
        counts as a request in the request metrics: one that finished ("stop"), or an abort."""
        stream = completions[0].stream
        pending = set(range(len(completions)))
        for c in completions:
            self._streams[c.sub_id] = stream
        try:
            # All at once: one at a time, each waiting for its engine's answer, an engine's step would find few of
            # them queued. Every submission ends before the call goes on or fails, so the cleanup below finds each
            # where its submission left it.
            submitted = await asyncio.gather(*(self._submit(c, PromptHashes(c.prompt_ids, c.params.hash_root), context)
                                               for c in completions), return_exceptions=True)
            for outcome in submitted:
                if isinstance(outcome, BaseException):
                    raise outcome
            while pending:
                await stream.wait()
                if stream.failed:
                    await abort(context, grpc.StatusCode.UNAVAILABLE, stream.failed)
                for c in stream.take():
                    pending.discard(c.index)
        finally:
            for c in completions:
                self._streams.pop(c.sub_id, None)
                ended = c.index not in pending
                if counted and (ended or c.group is not None):  # a cut one queued on an engine (or on its way)
                    self._finished["stop" if ended else "abort"].inc()
                if not ended:
                    self._abort(c)

    async def _beam_search(self, rid: str, parsed: ParsedRequest, prompt_ids_due: bool,
                           context: grpc.aio.ServicerContext, arrived: float) -> None:
        """A beam search request (GenerateRequest.use_beam_search): each step's beams as one-token completions with
        their top logprobs (beam_search.py), then the n best beams, each whole in one message, best first."""
        p = parsed.params
        step_params = SamplingParams(max_tokens=1, temperature=0.0, seed=0, ignore_eos=True, lora=p.lora,
                                     cache_salt=p.cache_salt)
        steps = itertools.count()
        weight_version = ""  # the last step's (an update between steps changes what the next ones run on)

        async def next_tokens(prompts: list[list[int]], k: int) -> list[list[tuple[int, float]]]:
            nonlocal weight_version
            step = next(steps)
            completions = self._completions([f"{rid}#beam{step}.{i}" for i in range(len(prompts))], prompts,
                                            dataclasses.replace(step_params, logprobs=k), parsed.priority)
            await self._run_all(completions, context, counted=False)
            weight_version = completions[0].weight_version
            return [c.out_logprobs[0].top if c.out_logprobs else [] for c in completions]

        status = "cancelled"
        try:
            beams = await beam_search(next_tokens, parsed.prompt_ids, parsed.n, p.max_tokens,
                                      self.tokenizer.eos_token_ids, p.ignore_eos, parsed.length_penalty)
            status = "done"
        finally:
            if status == "cancelled":  # as a Generate call's completions that were cut
                self._finished["abort"].inc(parsed.n)
            log.info("request %s: beam search, n=%d, prompt %d tokens, %d steps, %s, %.3f s", rid, parsed.n,
                     len(parsed.prompt_ids), next(steps), status, time.monotonic() - arrived,
                     extra={"request_id": rid, "n": parsed.n, "prompt_tokens": len(parsed.prompt_ids),
                            "status": status})
        for i, beam in enumerate(beams):
            self._finished[beam.finish_reason].inc()
            r = api.GenerateResponse(request_id=rid, index=i, token_ids=beam.tokens, finish_reason=FINISH[
                beam.finish_reason], text=self.tokenizer.decode(beam.tokens, skip_special_tokens=p.skip_special_tokens),
                stop_reason=str(beam.stop_token) if beam.stop_token is not None else "",
                cumulative_logprob=beam.logprob, weight_version=weight_version)
            r.usage.prompt_tokens, r.usage.completion_tokens = len(parsed.prompt_ids), len(beam.tokens)
            if prompt_ids_due:
                r.prompt_token_ids.extend(parsed.prompt_ids)
            if not await write(context, r):
                return
        self.metrics.e2e.observe(time.monotonic() - arrived)

    async def GetModelInfo(self, request, context) -> api.ModelInfo:
        if self.accepting:
            await self.read_current_table()  # what any front-end has told a client, e.g. an adapter just loaded
        groups = self.live_groups()
        if not groups:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "no worker is serving")
        info = groups[0].info
        return api.ModelInfo(
            model=info.model, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            eos_token_ids=list(self.tokenizer.eos_token_ids), num_workers=len(groups), dtype=info.dtype,
            block_size=info.block_size, lora_adapters=self.lora_adapters,
            lora_resolver=self.lora_resolver_dir is not None, labels=info.labels,
            workers=[api.WorkerStatus(address=g.address, alive=True, num_blocks=g.info.num_blocks,
                                      free_blocks=g.free_blocks, cached_blocks=g.cached_blocks,
                                      num_running=g.running, num_waiting=g.waiting, num_requests=g.num_requests,
                                      num_preemptions=g.preemptions, kv_cache_dtype=g.info.kv_cache_dtype,
                                      projection_dtype=g.info.projection_dtype,
                                      num_host_blocks=g.info.num_host_blocks,
                                      sliding_window=g.info.sliding_window, hidden_size=g.info.hidden_size,
                                      embedding_only=g.info.embedding_only, lora_adapters=g.info.lora_adapters,
                                      weights_path=g.info.weights_path, weight_version=g.weight_version)
                     for g in self.groups.values()])

    async def Tokenize(self, request: api.TokenizeRequest, context) -> api.TokenizeResponse:
        try:
            limit = self.max_model_len if self.groups else 1 << 16
            special = request.add_special_tokens if request.HasField("add_special_tokens") else None
            if request.WhichOneof("prompt") == "text":
                check_text_size(request.text, "text", max_prompt_bytes(limit))
                ids = self.tokenizer.encode(request.text, add_special_tokens=special is not False)
            else:
                ids = prompt_ids(request, self.tokenizer, self.tokenizer.vocab_size, limit, add_special_tokens=special)
        except InvalidRequest as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return api.TokenizeResponse(token_ids=ids, tokens=[self.tokenizer.tokenizer.id_to_token(i) or ""
                                                           for i in ids])

    async def LoadLoraAdapter(self, request: api.LoadLoraAdapterRequest, context) -> api.LoraAdaptersResponse:
        return await self._update_adapter(request.lora_name, request.lora_path, context, load=True)

    async def UnloadLoraAdapter(self, request: api.UnloadLoraAdapterRequest, context) -> api.LoraAdaptersResponse:
        return await self._update_adapter(request.lora_name, "", context, load=False)

    async def ResetPrefixCache(self, request: api.ResetPrefixCacheRequest, context) -> api.ResetPrefixCacheResponse:
        reply = await self.ask_supervisor(["reset_prefix_cache"])
        return api.ResetPrefixCacheResponse(dropped_blocks=reply["dropped_blocks"])

    async def UpdateWeights(self, request: api.UpdateWeightsRequest, context) -> api.UpdateWeightsResponse:
        if not self.allow_weight_updates:
            await abort(context, grpc.StatusCode.PERMISSION_DENIED, "weights are read again while serving only where "
                                "the scheduler runs with --allow-weight-updates")
        if not request.model_path:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "model_path must name a checkpoint folder")
        reply = await asyncio.shield(  # not undone by a cancel
            self.ask_supervisor(["weights", request.model_path, request.abort_requests,
                                 request.weight_version or request.model_path]))
        if reply.get("code"):
            await abort(context, grpc.StatusCode[reply["code"]], reply["message"])
        return api.UpdateWeightsResponse(model_path=reply["model_path"], num_workers=reply["num_workers"],
                                         weight_version=reply["weight_version"])

    async def _update_adapter(self, name: str, path: str, context, load: bool) -> api.LoraAdaptersResponse:
        """A load (of the folder at path) or unload, by the supervisor on every worker group."""
        if not self.allow_lora_updating:
            await abort(context, grpc.StatusCode.PERMISSION_DENIED, "LoRA adapters are loaded and unloaded while "
                                "serving only where the scheduler runs with --allow-runtime-lora-updating")
        if load and not path:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "lora_path must name the adapter's folder")
        groups = self.live_groups()
        if not name or len(name) > MAX_ADAPTER_NAME or (groups and name == groups[0].info.model):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"lora_name must be 1 to {MAX_ADAPTER_NAME} "
                                "characters, other than the base model's name")
        reply = await self.ask_supervisor(["lora", name, path])
        if reply.get("code"):
            await abort(context, grpc.StatusCode[reply["code"]], reply["message"])
        return api.LoraAdaptersResponse(lora_adapters=self.lora_adapters)

    async def _resolve_adapter(self, name: str, context) -> None:
        """A request's adapter that no worker serves, where the scheduler resolves adapters by name
        (--lora-resolver-dir, vLLM's filesystem resolver): the folder of that name there is loaded on every worker
        first, once for all the requests that ask for it meanwhile. A name with no such folder is left to the
        request's checks, which refuse it."""
        if not name or self.lora_resolver_dir is None or name in self.lora_adapters:
            return
        folder = self.lora_resolver_dir / name
        if (len(name) > MAX_ADAPTER_NAME or name in (".", "..") or "/" in name or "\\" in name
                or not (folder / "adapter_config.json").is_file()):
            return
        loading = self._resolving.get(name)
        if loading is None:
            loading = self._resolving[name] = asyncio.ensure_future(self.ask_supervisor(["lora", name, str(folder)]))
            loading.add_done_callback(lambda _: self._resolving.pop(name, None))
        reply = await asyncio.shield(loading)  # a cancelled request leaves the load to the others
        if reply.get("code") not in (None, "ALREADY_EXISTS"):  # ALREADY_EXISTS: another front-end's load won
            await self._reject(context, grpc.StatusCode[reply["code"]], f"lora {name!r}: {reply['message']}")

    # ---- membership, through the supervisor ---------------------------------------------------------
    async def ask_supervisor(self, message: list) -> dict:
        """Sends a request to the supervisor and waits for its reply."""
        req_id = next(self._ids)
        future = self._replies[req_id] = self.loop.create_future()
        self.out.send(ipc.SUPERVISOR, [message[0], self.index, req_id, *message[1:]])
        return await future

    # ---- leaving ----------------------------------------------------------------------------------
    async def _drain(self) -> None:
        """The scheduler drains: new requests get UNAVAILABLE; the supervisor is told once the last stream ended."""
        self.accepting = False
        await self.update_health()
        while self._streams:
            await asyncio.sleep(0.05)
        self.out.send(ipc.SUPERVISOR, ["drained", self.index])

    async def _exit(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)
        self.stopped.set()


async def serve(index: int, num_frontends: int, run_dir: str, args, port: int) -> None:
    """Serves the public API on host:port until the supervisor says exit."""
    tokenizer = load_tokenizer(args.model, args.chat_template, args.trust_request_chat_template)
    frontend = Frontend(index, num_frontends, run_dir, tokenizer, args.model,
                        args.allow_runtime_lora_updating, args.lora_resolver_dir, args.sampling_defaults,
                        args.allow_weight_updates, args.debug_table_delay if index else 0.0)
    interceptors = []
    keys = ApiKeys(args.api_keys)
    if keys:  # the Generation service only; a refused Generate counts as a rejected request
        refused = frontend.metrics.requests_rejected.labels(grpc.StatusCode.UNAUTHENTICATED.name)
        interceptors.append(ApiKeyInterceptor(keys, [SERVICE],
                                              lambda method: refused.inc() if method.endswith("/Generate") else None))
    server = frontend.server = grpc.aio.server(interceptors=interceptors, options=PUBLIC_SERVER_OPTIONS)
    policy = RegistrationPolicy(transport(args.tls), args.registration_secret)
    splitserve_pb2_grpc.add_GenerationServicer_to_server(frontend, server)
    membership_pb2_grpc.add_MembershipServicer_to_server(MembershipService(frontend, policy), server)
    health_pb2_grpc.add_HealthServicer_to_server(frontend.health, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    add_port(server, f"{args.host}:{port}", args.tls)
    await frontend.update_health()
    await server.start()
    inbox = ipc.inbox(zmq.asyncio.Context.instance(), run_dir, ipc.frontend_name(index))
    receiving = asyncio.ensure_future(frontend.receive(inbox))
    freeze_heap()
    frontend.out.send(ipc.SUPERVISOR, ["hello", "frontend", index, os.getpid()])
    await frontend.stopped.wait()
    receiving.cancel()
    inbox.close(0)
    frontend.out.close()


def frontend_main(index: int, num_frontends: int, run_dir: str, argv: list[str], port: int, parent) -> None:
    """Entry point of front-end process `index` of `num_frontends`."""
    from scheduler_svc import cli

    ipc.become_child(f"frontend {index}", parent)
    args = cli.parse_child_args(argv)
    run_loop(serve(index, num_frontends, run_dir, args, port))
