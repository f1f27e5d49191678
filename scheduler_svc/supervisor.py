"""The scheduler's process tree, behind one address, and its supervisor (the process `splitserve-scheduler`
starts):

    clients ──gRPC──▶ front-ends (K processes, one port)  ◀─ZeroMQ IPC─▶  engines (one per worker group, or M)
                      validation, tokens, routing, text,                  Scheduler + BlockManager, the
                      stop strings, streaming                             pipelined Execute stream

The supervisor starts the front-ends (frontend.py) and the engines (engine_proc.py) and replaces any that dies,
keeps the membership of the worker groups (who joins, fails, comes back and leaves: below), tells the front-ends
which groups serve, serves every process's metrics on one --metrics-port (added up), and drains the tree on
SIGTERM. It holds no request: a front-end holds its requests, an engine its sequences.

- Join: a static `--worker` address is connected at start-up; a worker started with `--scheduler` calls Register
  (on any front-end, which asks the supervisor) and is connected then. The supervisor gives each group to an
  engine: a new engine process for each group while there are fewer than --engines, else the engine with the
  fewest groups. A group is one Execute stream to the worker at one epoch, with a fresh block pool.
- Fail: a group's stream breaks (worker gone, keepalive heartbeat unanswered, or a step overdue: its engine's
  watchdog). Its front-ends continue its requests on the other groups by recompute; with none left they end
  with UNAVAILABLE, and readiness is NOT_SERVING until a worker is back.
- Come back: the address of a failed group is retried in the background with exponential backoff (a static one
  until it answers; a registered one for REGISTERED_RETRY_S, after which the worker is expected to register
  again by itself). A worker that answers, at a new epoch, gets a new group.
- Leave: Deregister (a worker that drains on SIGTERM) marks the group draining: nothing new is routed to it, its
  queued requests move at once, its running ones get the grace period the worker asks for, then what remains
  moves by recompute and the stream is closed, before Deregister returns.
- LoRA adapters loaded or unloaded while serving (LoadLoraAdapter, UnloadLoraAdapter on any front-end): the
  supervisor asks every live group's engine, answers once all did (a load any group refused is unloaded from the
  others: one answer for the tree), and keeps the outcome, by name, for groups that join later: an engine loads what
  its new group lacks, and drops what the tree unloaded, before the group serves.
- Weights read again from another checkpoint while serving (UpdateWeights on any front-end): the supervisor asks
  every live group's engine (each loads once the requests it held have finished: scheduler_svc/weights.py), answers
  once all did, and keeps the folder (and the version it names them) for groups that join later, whose engines have
  their workers read it before they serve. Where a group could not, the groups that did read their weights before
  again: one answer for the tree, which serves the same weights everywhere.
- ResetPrefixCache on any front-end: every group's engine drops the cached blocks no running request holds (both
  tiers) and says how many; the answer is their sum.
- A process dies: an engine's groups are gone (their front-ends move their requests, the supervisor retries
  their addresses on the other engines, and a new engine takes the dead one's place); a front-end's client
  streams are gone with it (clients see UNAVAILABLE and retry): its requests are aborted at the engines and a
  new front-end takes its place on the same port.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import random
import shutil
import signal
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from common.exposition import serve, with_labels
from common.util import available_cpus, free_port
from scheduler_svc import ipc
from scheduler_svc.grpc_executor import WorkerUnavailable
from scheduler_svc.metrics import merge

log = logging.getLogger("splitserve.scheduler")
REGISTERED_RETRY_S = 600.0  # how long the address of a failed registered worker is retried
METRICS_TIMEOUT_S = 5.0  # a process that does not answer a scrape within this is left out of it
GROUP_GONE = ("UNAVAILABLE", "the worker group is gone")  # a LoRA load's or unload's answer from a group gone


@dataclass(slots=True)
class _Group:
    group_id: int
    engine: int
    address: str
    info: dict
    draining: bool = False
    left: asyncio.Future | None = None  # while draining: resolved with the number of requests moved


@dataclass(slots=True)
class _Child:
    kind: str  # "frontend" or "engine"
    index: int
    process: mp.process.BaseProcess
    pipe: object  # our end of the pipe it watches: closed when we die
    ready: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def default_frontends(cpus: int) -> int:
    """Front-ends by cores: half of them (1 to 8). A streamed token costs a front-end about twice what it
    costs an engine, and a front-end's event loop is one core: the front-ends run out first (bench/NOTES.md,
    bench scale)."""
    return max(1, min(8, cpus // 2))


class Supervisor:
    def __init__(self, args, argv: list[str]):
        self.args, self.argv = args, argv
        cpus = available_cpus()
        self.num_frontends = args.frontends or default_frontends(cpus)
        self.max_engines = args.engines or cpus
        self.run_dir = tempfile.mkdtemp(prefix="splitserve-tree-")
        self.loop = asyncio.get_running_loop()
        self.context = zmq.Context.instance()
        self.out = ipc.Outboxes(self.context, self.run_dir)
        self.inbox = ipc.inbox(zmq.asyncio.Context.instance(), self.run_dir, ipc.SUPERVISOR)
        self.port = args.port or free_port(args.host)
        self.accepting = True
        self.scheduler_id = uuid.uuid4().hex[:12]
        self.frontends: dict[int, _Child] = {}
        self.engines: dict[int, _Child] = {}
        self.groups: dict[int, _Group] = {}
        self._group_ids = itertools.count(1)
        self._req_ids = itertools.count(1)
        # group id -> (engine, future): the group on group_up, an error on connect_failed
        self._connects: dict[int, tuple[int, asyncio.Future]] = {}
        self._metrics: dict[int, asyncio.Future] = {}
        self._drained: set[int] = set()
        self.static: set[str] = set()
        self.registered: dict[str, float] = {}  # registered address -> loop time it was last seen
        self._connect_locks: dict[str, asyncio.Lock] = {}
        self._reconnecting: dict[str, asyncio.Task] = {}
        self._last_epoch: dict[str, int] = {}  # address -> epoch of its last group (gone)
        self._tasks: set[asyncio.Task] = set()
        self._receiving: asyncio.Task | None = None
        self.adapters: dict[str, str] = {}  # LoRA adapters loaded (path) or unloaded ("") while serving, by name
        self._adapter_locks: dict[str, asyncio.Lock] = {}  # one load or unload of a name at a time
        self.weights = ""  # the folder the weights were last read from while serving ("": the workers' own)
        self.weight_version = ""  # the name UpdateWeights gave them
        self._weights_lock = asyncio.Lock()  # one weight update at a time
        # a question put to groups' engines, by (ticket, group id): its future and the answer if the group goes
        self._group_waits: dict[tuple[int, int], tuple[asyncio.Future, Any]] = {}

    # ---- the processes ----------------------------------------------------------------------------
    def _spawn(self, kind: str, index: int) -> _Child:
        from scheduler_svc.engine_proc import engine_main
        from scheduler_svc.frontend import frontend_main

        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)  # the child reads: EOF means we are gone
        if kind == "frontend":
            target, args = frontend_main, (index, self.num_frontends, self.run_dir, self.argv, self.port, reader)
        else:
            target, args = engine_main, (index, self.run_dir, self.argv, self.num_frontends, reader)
        process = ctx.Process(target=target, args=args, name=f"{kind}-{index}", daemon=True)
        process.start()
        reader.close()
        child = _Child(kind, index, process, writer)
        (self.frontends if kind == "frontend" else self.engines)[index] = child
        self.loop.add_reader(process.sentinel, self._child_ended, child)
        return child

    def _child_ended(self, child: _Child) -> None:
        self.loop.remove_reader(child.process.sentinel)
        child.process.join(1.0)
        child.pipe.close()
        if not self.accepting:
            return
        log.error("%s %d (pid %s) exited with code %s: replacing it", child.kind, child.index, child.process.pid,
                  child.process.exitcode)
        if child.kind == "frontend":
            for engine in self.engines:
                self._to_engine(engine, ["forget", child.index])
        else:
            for group in [g for g in self.groups.values() if g.engine == child.index]:
                self._group_gone(group, f"its engine process {child.index} exited")
            for engine, future in self._connects.values():  # connects it was making
                if engine == child.index and not future.done():
                    future.set_exception(WorkerUnavailable(f"engine {child.index} exited"))
        self._spawn(child.kind, child.index)

    async def _engine_for_new_group(self) -> int:
        counts = {i: 0 for i in self.engines}
        for g in self.groups.values():
            counts[g.engine] = counts.get(g.engine, 0) + 1
        idle = [i for i, n in counts.items() if n == 0]
        if idle:
            index = idle[0]
        elif len(self.engines) < self.max_engines:
            index = len(self.engines)
            self._spawn("engine", index)
        else:
            index = min(counts, key=counts.get)
        await self.engines[index].ready
        return index

    def _to_engine(self, index: int, message: list) -> None:
        self.out.send(ipc.engine_name(index), message)

    def _to_frontends(self, message: list) -> None:
        data = ipc.pack(message)
        for index in self.frontends:
            self.out.send_bytes(ipc.frontend_name(index), data)

    # ---- messages ---------------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            message = ipc.unpack(await self.inbox.recv())
            try:
                self._handle(message)
            except Exception:
                log.exception("supervisor: message %r failed", message[0])

    def _handle(self, message: list) -> None:
        op = message[0]
        if op == "hello":
            _, kind, index, pid = message
            log.info("%s %d started, pid %d", kind, index, pid, extra={"role": kind, "index": index, "pid": pid})
            child = (self.frontends if kind == "frontend" else self.engines).get(index)
            if child is not None and not child.ready.done():
                child.ready.set_result(None)
            if kind == "frontend":
                self.out.send(ipc.frontend_name(index), ["groups", self._table()])
        elif op == "group_up":
            _, engine, gid, address, info = message
            _, future = self._connects.pop(gid, (None, None))
            if future is None or future.done():  # given up on meanwhile
                self._to_engine(engine, ["drain", gid, 0.0, False])
                return
            self.groups[gid] = _Group(gid, engine, address, info)
            future.set_result(self.groups[gid])
            self._sync_adapters(self.groups[gid])
            self._sync_weights(self.groups[gid])
            self._publish()
        elif op == "connect_failed":
            _, _engine, gid, address, text, unavailable = message
            _, future = self._connects.pop(gid, (None, None))
            if future is not None and not future.done():
                future.set_exception(WorkerUnavailable(text) if unavailable else RuntimeError(text))
        elif op == "group_down":
            _, _engine, gid, address, epoch, reason = message
            group = self.groups.get(gid)
            if group is not None:
                self._group_gone(group, reason)
        elif op == "group_left":
            _, _engine, gid, address, epoch, moved = message
            group = self.groups.pop(gid, None)
            if group is not None:
                self._last_epoch[group.address] = group.info["epoch"]
                if group.left is not None and not group.left.done():
                    group.left.set_result(moved)
                self._publish()
        elif op == "lora_done":
            _, _engine, gid, ticket, code, error, served = message
            group = self.groups.get(gid)
            if group is not None and group.info["lora_adapters"] != served:
                group.info["lora_adapters"] = served
                self._publish()
            self._answered(ticket, gid, (code, error))
        elif op == "lora":
            self._spawn_task(self._update_adapter(*message[1:]))
        elif op == "weights_done":
            _, _engine, gid, ticket, error = message
            if ticket == 0 and gid in self.groups:  # a sync, which nobody waits for
                group = self.groups[gid]
                if error:
                    log.error("worker %s could not read the weights the others serve from %s: %s", group.address,
                              self.weights, error, extra={"worker": group.address})
                else:
                    group.info["weights_path"], group.info["weight_version"] = self.weights, self.weight_version
                    self._publish()
            self._answered(ticket, gid, error)
        elif op == "weights":
            self._spawn_task(self._update_weights(*message[1:]))
        elif op == "reset_done":
            _, _engine, gid, ticket, dropped = message
            self._answered(ticket, gid, dropped)
        elif op == "reset_prefix_cache":
            self._spawn_task(self._reset_prefix_cache(*message[1:]))
        elif op == "table":  # [table, front-end, req_id]: the table now, then the reply that says it came
            _, index, req_id = message
            self.out.send(ipc.frontend_name(index), ["groups", self._table()])
            self._reply(index, req_id)
        elif op == "register":
            self._spawn_task(self._register(*message[1:]))
        elif op == "deregister":
            self._spawn_task(self._deregister(*message[1:]))
        elif op == "drained":
            self._drained.add(message[1])
        elif op == "metrics":
            future = self._metrics.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])

    def _table(self) -> list[dict]:
        return [{"group_id": g.group_id, "engine": g.engine, "address": g.address, "draining": g.draining,
                 **g.info} for g in self.groups.values()]

    def _publish(self) -> None:
        """The front-ends learn which groups serve."""
        self._to_frontends(["groups", self._table()])

    def _group_gone(self, group: _Group, reason: str) -> None:
        self.groups.pop(group.group_id, None)
        self._last_epoch[group.address] = group.info["epoch"]
        log.warning("worker group %s is gone (%s); %d live group(s) left", group.address, reason,
                    sum(not g.draining for g in self.groups.values()), extra={"worker": group.address})
        if group.left is not None and not group.left.done():
            group.left.set_result(0)
        for ticket, gid in [key for key in self._group_waits if key[1] == group.group_id]:
            self._answered(ticket, gid, self._group_waits[ticket, gid][1])
        self._publish()
        self.schedule_reconnect(group.address)

    def _spawn_task(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- joining ----------------------------------------------------------------------------------
    def group_at(self, address: str) -> _Group | None:
        return next((g for g in self.groups.values() if g.address == address), None)

    async def connect(self, address: str, timeout: float, wait_for_ready: bool = True) -> _Group:
        """A live group for address: the one there is, or a new one on an engine. Raises WorkerUnavailable
        (unreachable) or RuntimeError (it refused: another protocol version, ...)."""
        lock = self._connect_locks.setdefault(address, asyncio.Lock())
        async with lock:
            group = self.group_at(address)
            if group is not None:
                return group
            if not self.accepting:
                raise WorkerUnavailable("the scheduler is shutting down")
            engine = await self._engine_for_new_group()
            gid = next(self._group_ids)
            future = self.loop.create_future()
            self._connects[gid] = (engine, future)
            self._to_engine(engine, ["connect", gid, address, timeout, wait_for_ready, self._last_epoch.get(address),
                                     self.adapters, self.weights, self.weight_version])
            try:
                group = await future
            finally:
                self._connects.pop(gid, None)
        info = group.info
        log.info("worker group %s: %s, %d blocks of %d, max_model_len %d, epoch %d, engine %d", address,
                 info["device"], info["num_blocks"], info["block_size"], info["max_model_len"], info["epoch"],
                 group.engine, extra={"worker": address, "epoch": info["epoch"]})
        return group

    async def add_static(self, address: str) -> _Group:
        self.static.add(address)
        return await self.connect(address, self.args.worker_connect_timeout)

    # ---- coming back ------------------------------------------------------------------------------
    def schedule_reconnect(self, address: str) -> None:
        if not self.accepting or address in self._reconnecting:
            return
        if address not in self.static and address not in self.registered:
            return
        self._reconnecting[address] = asyncio.ensure_future(self._reconnect(address))

    async def _reconnect(self, address: str) -> None:
        args = self.args
        delay = min(0.5, args.reconnect_backoff_max)
        started = self.loop.time()
        try:
            while self.accepting:
                if address not in self.static:
                    if address not in self.registered:
                        return  # deregistered meanwhile
                    if self.loop.time() - started > REGISTERED_RETRY_S:
                        log.info("worker %s: not back after %.0f s; forgotten until it registers again", address,
                                 REGISTERED_RETRY_S, extra={"worker": address})
                        self.registered.pop(address, None)
                        return
                if self.group_at(address) is not None:
                    return
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(2 * delay, args.reconnect_backoff_max)
                try:
                    group = await self.connect(address, args.reconnect_timeout, wait_for_ready=False)
                except WorkerUnavailable as e:
                    log.debug("worker %s: not back yet: %s", address, e)
                    continue
                except Exception:
                    log.exception("worker %s: reconnecting failed", address)
                    continue
                log.info("worker %s is back at epoch %d", address, group.info["epoch"], extra={"worker": address})
                return
        finally:
            if self._reconnecting.get(address) is asyncio.current_task():
                del self._reconnecting[address]

    # ---- Register / Deregister, asked by a front-end ------------------------------------------------
    def _reply(self, frontend: int, req_id: int, **reply) -> None:
        self.out.send(ipc.frontend_name(frontend), ["reply", req_id, reply])

    async def _register(self, frontend: int, req_id: int, address: str, worker_id: str, epoch: int) -> None:
        def refuse(code: str, message: str) -> None:
            self._reply(frontend, req_id, code=code, message=message)

        if not self.accepting:
            return refuse("UNAVAILABLE", "the scheduler is shutting down")
        self.registered[address] = self.loop.time()
        group = self.group_at(address)
        if group is not None and epoch and group.info["epoch"] != epoch:
            # Registering again at another epoch: the worker restarted, or lost the stream this group holds.
            self._to_engine(group.engine, ["fail", group.group_id, f"worker {address} registered again at a new "
                                           "epoch: its stream is gone"])
            deadline = self.loop.time() + 10.0
            while group.group_id in self.groups and self.loop.time() < deadline:
                await asyncio.sleep(0.02)
            group = None
        if group is not None:
            if group.draining:
                return refuse("FAILED_PRECONDITION", f"worker {address} is draining")
            return self._reply(frontend, req_id, scheduler_id=self.scheduler_id, already_member=True)
        try:
            await self.connect(address, self.args.reconnect_timeout, wait_for_ready=False)
        except WorkerUnavailable as e:
            return refuse("UNAVAILABLE", f"cannot reach the worker at {address}: {e}")
        except Exception as e:  # e.g. another protocol version
            log.error("worker %s: registration refused: %s", address, e, extra={"worker": address})
            return refuse("FAILED_PRECONDITION", f"worker {address} refused: {e}")
        log.info("worker %s registered (worker id %s)", address, worker_id or "?", extra={"worker": address})
        self._reply(frontend, req_id, scheduler_id=self.scheduler_id, already_member=False)

    async def _deregister(self, frontend: int, req_id: int, address: str, worker_id: str, grace: float) -> None:
        self.registered.pop(address, None)
        group = self.group_at(address)
        if group is None:
            return self._reply(frontend, req_id, moved=0, was_member=False)
        log.info("worker %s deregisters (worker id %s)", address, worker_id or "?", extra={"worker": address})
        moved = await self.drain_group(group, grace)
        if address in self.static:
            self.schedule_reconnect(address)  # a static worker that is restarted comes back
        self._reply(frontend, req_id, moved=moved, was_member=True)

    async def drain_group(self, group: _Group, grace: float) -> int:
        """Routes nothing new to the group, lets its running requests finish within grace seconds, moves the
        rest by recompute, closes its stream. Returns how many requests moved. Idempotent."""
        if group.left is None:
            group.left = self.loop.create_future()
            group.draining = True
            self._publish()
            others = any(not g.draining for g in self.groups.values())
            # queued requests have nothing to finish there: they move at once, if there is somewhere to go
            self._to_engine(group.engine, ["drain", group.group_id, grace, others])
            log.info("worker %s drains: grace %.1f s", group.address, grace, extra={"worker": group.address})
        moved = await asyncio.shield(group.left)
        log.info("worker %s left: %d request(s) moved to other workers", group.address, moved,
                 extra={"worker": group.address})
        return moved

    # ---- LoRA adapters, asked by a front-end -----------------------------------------------------------
    async def _update_adapter(self, frontend: int, req_id: int, name: str, path: str) -> None:
        """Loads (path) or unloads ("") the adapter on every live group; replies code and message where refused."""
        async with self._adapter_locks.setdefault(name, asyncio.Lock()):  # an unload may wait long: by name
            groups = [g for g in self.groups.values() if not g.draining]
            if not groups:
                return self._reply(frontend, req_id, code="UNAVAILABLE", message="no worker is serving")
            answers = list(zip(groups, await self._ask_groups(groups, "lora", name, path, if_gone=GROUP_GONE)))
            done = [g for g, (code, _) in answers if not code]
            refused = [(g, code, error) for g, (code, error) in answers if code and code != "UNAVAILABLE"]
            if path and refused:
                await self._ask_groups(done, "lora", name, "", if_gone=GROUP_GONE)  # one answer: no group keeps it
            if not done or path and refused:
                group, code, error = refused[0] if refused else (None, "UNAVAILABLE", "no worker is serving")
                return self._reply(frontend, req_id, code=code,
                                   message=f"worker {group.address}: {error}" if group else error)
            self.adapters[name] = path
            asked = {g.group_id for g in groups}
            for group in self.groups.values():
                if group.group_id not in asked:  # joined meanwhile, from the adapters as they were
                    self._sync_adapters(group)
            log.info("LoRA adapter %s %s on %d worker group(s)", name, f"loaded from {path}" if path else "unloaded",
                     len(done))
            self._reply(frontend, req_id)  # after the groups' new adapters: the front-end answers with them

    def _sync_adapters(self, group: _Group) -> None:
        """Has the group load the tree's adapters it lacks and drop those the tree unloaded (answered by lora_done
        with no one waiting): for a group whose engine connected it from the adapters as they were before a load
        or unload that ended meanwhile."""
        served = group.info["lora_adapters"]
        for name, path in self.adapters.items():
            if (name in served) != bool(path):
                self._to_engine(group.engine, ["lora", group.group_id, 0, name, path])

    # ---- weights, read again by a front-end's UpdateWeights --------------------------------------------------
    async def _update_weights(self, frontend: int, req_id: int, path: str, abort: bool, version: str) -> None:
        """Has every live group read its weights again from path, named `version` (abort: ending the requests it
        holds first); replies code and message where one could not, after the others read theirs before again."""
        async with self._weights_lock:
            groups = [g for g in self.groups.values() if not g.draining]
            if not groups:
                return self._reply(frontend, req_id, code="UNAVAILABLE", message="no worker is serving")
            answers = list(zip(groups, await self._ask_groups(groups, "weights", path, abort, version, if_gone=None)))
            done = [g for g, error in answers if error == ""]
            refused = [(g, error) for g, error in answers if error]
            if refused:
                await self._roll_back_weights(done)
                group, error = refused[0]
                log.warning("weights from %s refused by worker %s: %s", path, group.address, error)
                return self._reply(frontend, req_id, code="INVALID_ARGUMENT",
                                   message=f"model_path: worker {group.address}: {error}")
            if not done:
                return self._reply(frontend, req_id, code="UNAVAILABLE", message="no worker is serving")
            self.weights, self.weight_version = path, version
            for g in done:
                g.info["weights_path"], g.info["weight_version"] = path, version
            for g in self.groups.values():
                self._sync_weights(g)  # joined meanwhile, from the weights as they were
            self._publish()
            log.info("weights read again from %s on %d worker group(s)", path, len(done))
            self._reply(frontend, req_id, model_path=path, num_workers=len(done), weight_version=version)

    async def _roll_back_weights(self, groups: list[_Group]) -> None:
        """Has groups that read an update another group refused read their weights before again, all at once."""
        by_weights: dict[tuple[str, str], list[_Group]] = {}
        for g in groups:
            by_weights.setdefault((g.info["weights_path"], g.info["weight_version"]), []).append(g)
        answers = await asyncio.gather(*(self._ask_groups(gs, "weights", before, False, version, if_gone=None)
                                         for (before, version), gs in by_weights.items()))
        for ((before, _), gs), errors in zip(by_weights.items(), answers):
            for g, error in zip(gs, errors):
                if error:
                    log.error("worker %s could not read its weights before back from %s: %s", g.address, before,
                              error, extra={"worker": g.address})

    def _sync_weights(self, group: _Group) -> None:
        """Has a group that serves other weights than the tree's read those (answered by weights_done with no one
        waiting): for a group whose engine connected it from the weights as they were before an update."""
        served = group.info["weights_path"], group.info["weight_version"]
        if self.weights and served != (self.weights, self.weight_version):
            self._to_engine(group.engine, ["weights", group.group_id, 0, self.weights, False, self.weight_version])

    async def _ask_groups(self, groups: list[_Group], op: str, *args: Any, if_gone: Any) -> list:
        """Each group's engine's answer to [op, group id, ticket, *args], in the groups' order; `if_gone` for a
        group that goes before it answers."""
        ticket = next(self._req_ids)
        waits = []
        for g in groups:
            future = self.loop.create_future()
            self._group_waits[ticket, g.group_id] = future, if_gone
            waits.append(future)
            self._to_engine(g.engine, [op, g.group_id, ticket, *args])
        return await asyncio.gather(*waits)

    def _answered(self, ticket: int, gid: int, answer: Any) -> None:
        future, _ = self._group_waits.pop((ticket, gid), (None, None))
        if future is not None and not future.done():
            future.set_result(answer)

    # ---- the prefix cache, reset by a front-end ---------------------------------------------------------
    async def _reset_prefix_cache(self, frontend: int, req_id: int) -> None:
        """Has every group drop the cached blocks no running request holds; replies how many, over all groups."""
        dropped = sum(await self._ask_groups(list(self.groups.values()), "reset_prefix_cache",
                                             if_gone=0))  # its caches went with it
        log.info("prefix cache reset: %d cached block(s) dropped", dropped)
        self._reply(frontend, req_id, dropped_blocks=dropped)

    # ---- metrics ----------------------------------------------------------------------------------
    async def gather_metrics(self) -> list[str]:
        """Every live process's exposition (those that answer within METRICS_TIMEOUT_S)."""
        futures = []
        for kind, children in (("frontend", self.frontends), ("engine", self.engines)):
            for index in children:
                req_id = next(self._req_ids)
                future = self._metrics[req_id] = self.loop.create_future()
                name = ipc.frontend_name(index) if kind == "frontend" else ipc.engine_name(index)
                self.out.send(name, ["metrics", req_id])
                futures.append((req_id, future))
        done, _ = await asyncio.wait([f for _, f in futures], timeout=METRICS_TIMEOUT_S)
        for req_id, future in futures:
            self._metrics.pop(req_id, None)
        return [f.result() for f in done]

    def serve_metrics(self, port: int, host: str) -> None:
        supervisor = self
        labels = {"model_name": Path(self.args.model).name}  # as the workers name it (their folder's name)

        class TreeCollector:
            def collect(self):
                texts = asyncio.run_coroutine_threadsafe(supervisor.gather_metrics(), supervisor.loop).result(
                    METRICS_TIMEOUT_S * 2)
                yield from with_labels(merge(texts), labels)

        registry = CollectorRegistry()
        registry.register(TreeCollector())
        serve(registry, port, host)
        log.info("metrics on %s:%d/metrics", host, port, extra={"metrics_port": port})

    # ---- life -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._receiving = asyncio.ensure_future(self._receive())
        for index in range(self.num_frontends):
            self._spawn("frontend", index)
        self._spawn("engine", 0)  # the first worker group's, starting beside the front-ends
        await asyncio.gather(*(c.ready for c in self.frontends.values()))
        if self.args.metrics_port:
            self.serve_metrics(self.args.metrics_port, self.args.host)
        for address in self.args.worker:
            await self.add_static(address)
        log.info("serving on %s:%d with %d worker group(s), %d front-end(s)", self.args.host, self.port,
                 len(self.groups), self.num_frontends)

    async def drain(self, timeout: float) -> None:
        """SIGTERM: new requests get UNAVAILABLE and readiness NOT_SERVING; running ones finish within timeout;
        then every process stops."""
        self.accepting = False
        for task in list(self._reconnecting.values()):
            task.cancel()
        self._to_frontends(["drain"])
        deadline = self.loop.time() + timeout
        while len(self._drained) < len(self.frontends) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        self._to_frontends(["exit"])
        for index in self.engines:
            self._to_engine(index, ["stop_all"])
        children = [*self.frontends.values(), *self.engines.values()]
        for child in children:
            self.loop.remove_reader(child.process.sentinel)
        for child in children:
            await asyncio.to_thread(child.process.join, 10)
            if child.process.is_alive():
                child.process.kill()
        if self._receiving is not None:
            self._receiving.cancel()
        self.out.close()
        self.inbox.close(0)
        shutil.rmtree(self.run_dir, ignore_errors=True)


async def run(args, argv: list[str]) -> None:
    supervisor = Supervisor(args, argv)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        supervisor.loop.add_signal_handler(sig, stop.set)
    await supervisor.start()
    await stop.wait()
    await supervisor.drain(args.drain_timeout)
