"""Worker membership of the scheduler: which worker groups it drives, how they join, fail, come back and
leave, and where the requests of a group that goes end up.

- Join: a static `--worker` address is connected at start-up; a worker started with `--scheduler` calls
  Register (protos/membership.proto) and is connected then. Either way a group is one Execute stream to
  the worker at one epoch, with a fresh block pool.
- Fail: a group's stream breaks (worker gone, keepalive heartbeat unanswered, or a step overdue: the
  watchdog here checks every group's step progress, see grpc_executor). Its unfinished requests are moved
  to the surviving groups by recompute (prompt plus the tokens streamed so far, same seed and limits, same
  detokenizer state): the client sees exactly the tokens it would have seen. With no live group left they
  end with UNAVAILABLE, and readiness is NOT_SERVING until a worker is back.
- Come back: the address of a failed group is retried in the background with exponential backoff (a
  static one until it answers; a registered one for REGISTERED_RETRY_S, after which the worker is expected
  to register again by itself). A worker that answers, at a new epoch, gets a new group.
- Leave: Deregister (a worker that drains on SIGTERM) marks the group draining: nothing new is routed to
  it, its queued requests move at once, its running ones get the grace period the worker asks for, then
  what remains moves by recompute and the stream is closed, before Deregister returns.
"""
from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from common.security import RegistrationPolicy
from protos import membership_pb2 as mpb
from protos import membership_pb2_grpc
from scheduler_svc.engine import EngineRequest
from scheduler_svc.grpc_executor import WatchConfig, WorkerUnavailable
from scheduler_svc.prefix_hash import PromptHashes
from scheduler_svc.router import pick_group
from scheduler_svc.worker_group import GroupUnavailable, WorkerGroup

log = logging.getLogger("splitserve.scheduler")
SERVICE = mpb.DESCRIPTOR.services_by_name["Membership"].full_name
REGISTERED_RETRY_S = 600.0  # how long the address of a failed registered worker is retried


@dataclass(slots=True)
class MembershipConfig:
    watch: WatchConfig = field(default_factory=WatchConfig)
    connect_timeout: float = 600.0  # a static --worker at start-up: how long to wait for it to come up
    reconnect_timeout: float = 10.0  # one attempt to reach a worker again, or a registering one (Describe)
    reconnect_backoff_min: float = 0.5  # first wait before retrying the address of a failed group
    reconnect_backoff_max: float = 10.0  # the wait doubles up to this
    # TLS to the workers, made for each connection (a rotated certificate is presented); None: plaintext
    worker_credentials: Callable[[], grpc.ChannelCredentials] | None = None


class MembershipHost(Protocol):
    """What Membership needs of the service it serves (scheduler_svc/server.py's GenerationService)."""

    @property
    def accepting(self) -> bool:
        """False once the scheduler drains: no group joins, no address is retried."""
        ...

    def open_group(self, address: str, timeout: float, wait_for_ready: bool, stale_epoch: int | None,
                   credentials: grpc.ChannelCredentials | None) -> WorkerGroup:
        """Connects a new group to the worker at address (blocks: called in a thread). Raises
        WorkerUnavailable."""
        ...

    def is_streaming(self, request_id: str) -> bool:
        """Whether the request's client call is still open."""
        ...

    def continue_on(self, request_id: str, group: WorkerGroup) -> bool:
        """The request continues on group from now on (a cancel aborts it there); False when its call has
        ended meanwhile."""
        ...

    def lost(self, request_id: str) -> None:
        """No live group can continue the request: its call ends with UNAVAILABLE."""
        ...

    async def groups_changed(self) -> None:
        """A group joined, left, failed or drains (readiness follows the live groups)."""
        ...


class Membership:
    def __init__(self, host: MembershipHost, config: MembershipConfig | None = None,
                 on_moved: Callable[[], None] = lambda: None):
        """on_moved: called for every request that continues on another group (a metric)."""
        self.host = host
        self.config = config or MembershipConfig()
        self.on_moved = on_moved
        self.groups: list[WorkerGroup] = []  # every group driven now, draining ones included
        self.scheduler_id = uuid.uuid4().hex[:12]
        self.static: set[str] = set()  # --worker addresses
        self.registered: dict[str, float] = {}  # registered address -> loop time it was last seen
        self._connect_locks: dict[str, asyncio.Lock] = {}
        self._reconnecting: dict[str, asyncio.Task] = {}
        self._drains: dict[WorkerGroup, asyncio.Task] = {}
        self._last_epoch: dict[str, int] = {}  # address -> epoch of its last group (gone)
        self._tasks: set[asyncio.Task] = set()
        self._watchdog: asyncio.Task | None = None

    # ---- groups -------------------------------------------------------------------------------
    def live_groups(self) -> list[WorkerGroup]:
        """Groups that take requests: alive and not draining."""
        return [g for g in self.groups if g.alive and not g.draining]

    def group_at(self, address: str) -> WorkerGroup | None:
        return next((g for g in self.groups if g.address == address and g.alive), None)

    async def add_static(self, address: str) -> WorkerGroup:
        self.static.add(address)
        return await self.connect(address, self.config.connect_timeout)

    async def connect(self, address: str, timeout: float, wait_for_ready: bool = True) -> WorkerGroup:
        """A live group for address: the one there is, or a new one (Describe, then Execute opened).
        Raises WorkerUnavailable."""
        lock = self._connect_locks.setdefault(address, asyncio.Lock())
        async with lock:
            group = self.group_at(address)
            if group is not None:
                return group
            credentials = self.config.worker_credentials
            group = await asyncio.to_thread(self.host.open_group, address, timeout, wait_for_ready,
                                            self._last_epoch.get(address),
                                            credentials() if credentials is not None else None)
            if not self.host.accepting:
                await asyncio.to_thread(group.stop)
                raise WorkerUnavailable("the scheduler is shutting down")
            if not group.alive:  # failed at once: group_failed has run or will, and retries
                raise WorkerUnavailable(f"worker {address} failed as it joined")
            self.groups.append(group)
        info = group.info
        log.info("worker group %s: %s, %d blocks of %d, max_model_len %d, epoch %d", address, info.device,
                 info.num_blocks, info.block_size, info.max_model_len, info.epoch,
                 extra={"worker": address, "epoch": info.epoch})
        await self.host.groups_changed()
        return group

    def start(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch())

    async def stop(self) -> None:
        """The scheduler drains: no more reconnection attempts (the watchdog goes on while streams run)."""
        tasks = list(self._reconnecting.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self) -> None:
        """The step-progress watchdog over every live group (the heartbeat and the stream watch themselves)."""
        interval = min(1.0, max(0.05, self.config.watch.step_timeout / 10))
        while True:
            await asyncio.sleep(interval)
            for group in list(self.groups):
                if group.alive and (reason := group.engine.executor.check_progress()):
                    log.error("watchdog: %s", reason, extra={"worker": group.address})

    # ---- failure and re-queue ----------------------------------------------------------------
    def group_failed(self, group: WorkerGroup, requests: list[EngineRequest], error: Exception) -> None:
        """On the event loop, after a group's engine thread gave up on its worker."""
        if group in self.groups:
            self.groups.remove(group)
        self._last_epoch[group.address] = group.info.epoch
        log.warning("worker group %s is gone (%s): %d request(s) to move, %d live group(s) left", group.address,
                    error, len(requests), len(self.live_groups()), extra={"worker": group.address})
        self.move(requests)
        self._spawn(self.host.groups_changed())
        self.schedule_reconnect(group.address)

    def move(self, requests: list[EngineRequest]) -> None:
        for req in requests:
            if self.host.is_streaming(req.request_id):
                self._spawn(self._move(req))

    async def _move(self, req: EngineRequest) -> None:
        """Continues one request on the live group that costs least (its prompt plus generated tokens are
        recomputed there); with none left, its stream ends with UNAVAILABLE."""
        rid = req.request_id
        hashes = PromptHashes(req.seq.token_ids)
        tried: set[WorkerGroup] = set()
        while True:
            candidates = [g for g in self.live_groups() if g not in tried]
            if not candidates:
                if self.host.is_streaming(rid):
                    log.warning("request %s: no live worker left to continue it", rid, extra={"request_id": rid})
                    self.host.lost(rid)
                return
            group = pick_group(candidates, hashes)
            if not self.host.continue_on(rid, group):  # the call ended meanwhile (cancelled)
                return
            try:
                await asyncio.wrap_future(group.move_in(req, hashes))
            except (GroupUnavailable, ValueError) as e:
                log.warning("request %s: cannot continue on %s: %s", rid, group.address, e,
                            extra={"request_id": rid, "worker": group.address})
                tried.add(group)
                continue
            self.on_moved()
            seq = req.seq
            log.info("request %s moved to worker %s: %d prompt + %d generated tokens to recompute", rid,
                     group.address, seq.prompt_len, seq.num_output_tokens,
                     extra={"request_id": rid, "worker": group.address})
            return

    # ---- coming back --------------------------------------------------------------------------
    def schedule_reconnect(self, address: str) -> None:
        if not self.host.accepting or address in self._reconnecting:
            return
        if address not in self.static and address not in self.registered:
            return
        task = asyncio.ensure_future(self._reconnect(address))
        self._reconnecting[address] = task

    async def _reconnect(self, address: str) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        delay = cfg.reconnect_backoff_min
        started = loop.time()
        try:
            while self.host.accepting:
                if address not in self.static:
                    if address not in self.registered:
                        return  # deregistered meanwhile
                    if loop.time() - started > REGISTERED_RETRY_S:
                        log.info("worker %s: not back after %.0f s; forgotten until it registers again", address,
                                 REGISTERED_RETRY_S, extra={"worker": address})
                        self.registered.pop(address, None)
                        return
                if self.group_at(address) is not None:
                    return
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(2 * delay, cfg.reconnect_backoff_max)
                try:
                    group = await self.connect(address, cfg.reconnect_timeout, wait_for_ready=False)
                except WorkerUnavailable as e:
                    log.debug("worker %s: not back yet: %s", address, e)
                    continue
                except Exception:
                    log.exception("worker %s: reconnecting failed", address)
                    continue
                log.info("worker %s is back at epoch %d", address, group.info.epoch, extra={"worker": address})
                return
        finally:
            if self._reconnecting.get(address) is asyncio.current_task():
                del self._reconnecting[address]

    # ---- leaving ------------------------------------------------------------------------------
    async def drain_group(self, group: WorkerGroup, grace: float) -> int:
        """Routes nothing new to the group, lets its running requests finish within grace seconds, moves
        the rest by recompute, closes its stream. Returns how many requests moved. Idempotent."""
        task = self._drains.get(group)
        if task is None:
            task = self._drains[group] = asyncio.ensure_future(self._drain(group, grace))
            task.add_done_callback(lambda _t: self._drains.pop(group, None))
        return await asyncio.shield(task)  # goes on if the caller (a Deregister call) is cancelled

    async def _drain(self, group: WorkerGroup, grace: float) -> int:
        loop = asyncio.get_running_loop()
        group.draining = True
        await self.host.groups_changed()
        log.info("worker %s drains: %d request(s), grace %.1f s", group.address, group.num_unfinished, grace,
                 extra={"worker": group.address})
        moved = 0
        if self.live_groups():  # queued requests have nothing to finish there: they move at once
            moved += await self._move_out(group, waiting_only=True)
        deadline = loop.time() + max(0.0, grace)
        while group.alive and group.num_unfinished and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if group.alive:
            moved += await self._move_out(group)
            if group in self.groups:
                self.groups.remove(group)
            self._last_epoch[group.address] = group.info.epoch
            await asyncio.to_thread(group.stop)
        # (a group that failed meanwhile moved its requests through group_failed)
        await self.host.groups_changed()
        log.info("worker %s left: %d request(s) moved to other workers", group.address, moved,
                 extra={"worker": group.address})
        return moved

    async def _move_out(self, group: WorkerGroup, waiting_only: bool = False) -> int:
        try:
            requests = await asyncio.wrap_future(group.move_out(waiting_only))
        except GroupUnavailable:
            return 0
        self.move(requests)
        return len(requests)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _valid_address(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


class MembershipService(membership_pb2_grpc.MembershipServicer):
    """Register / Deregister, served by the scheduler next to its public API. Who may call them: the
    policy (common.security): mutual TLS, a shared secret, or nobody."""

    def __init__(self, membership: Membership, policy: RegistrationPolicy):
        self.m = membership
        self.policy = policy

    async def _authorize(self, context, request) -> None:
        reason = self.policy.refusal(context.invocation_metadata())
        if reason is not None:
            log.warning("membership call refused from %s for worker %r: %s", context.peer(), request.address,
                        reason, extra={"worker": request.address})
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def Register(self, request: mpb.RegisterRequest, context) -> mpb.RegisterResponse:
        m = self.m
        await self._authorize(context, request)
        address = request.address
        if not m.host.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
        if not _valid_address(address):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address must be HOST:PORT, got {address!r}")
        loop = asyncio.get_running_loop()
        m.registered[address] = loop.time()
        group = m.group_at(address)
        if group is not None and request.epoch and group.info.epoch != request.epoch:
            # Registering again at another epoch: the worker restarted, or lost the stream this group holds.
            group.fail(f"worker {address} registered again at a new epoch: its stream is gone")
            deadline = loop.time() + 10.0
            while group in m.groups and loop.time() < deadline:
                await asyncio.sleep(0.02)
            group = None
        if group is not None:
            if group.draining:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {address} is draining")
            return mpb.RegisterResponse(scheduler_id=m.scheduler_id, already_member=True)
        try:
            await m.connect(address, m.config.reconnect_timeout, wait_for_ready=False)
        except WorkerUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot reach the worker at {address}: {e}")
        except Exception as e:  # e.g. another protocol version
            log.exception("worker %s: registration refused", address, extra={"worker": address})
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {address} refused: {e}")
        log.info("worker %s registered (worker id %s)", address, request.worker_id or "?",
                 extra={"worker": address})
        return mpb.RegisterResponse(scheduler_id=m.scheduler_id, already_member=False)

    async def Deregister(self, request: mpb.DeregisterRequest, context) -> mpb.DeregisterResponse:
        m = self.m
        await self._authorize(context, request)
        address = request.address
        m.registered.pop(address, None)
        group = m.group_at(address)
        if group is None:
            return mpb.DeregisterResponse(was_member=False)
        log.info("worker %s deregisters (worker id %s)", address, request.worker_id or "?",
                 extra={"worker": address})
        moved = await m.drain_group(group, max(0.0, request.grace_s))
        if address in m.static:
            m.schedule_reconnect(address)  # a static worker that is restarted comes back
        return mpb.DeregisterResponse(moved=moved, was_member=True)
