"""An engine process of the scheduler tree: the EngineCore of each worker group the supervisor gives it, each
on a thread of its own over the group's Execute stream; token ids out, columnar, one message per front-end per
step, with the group's load and prefix-cache events for the front-ends' routers.

A group lives as long as one Execute stream to its worker: when the stream breaks (the worker died, restarted,
stopped answering pings, or a step made no progress: see grpc_executor), the group is dead for good: its
front-ends are told which of their requests it held ("down"), so that they continue them elsewhere, and the
supervisor that it is gone ("group_down"), so that it retries the address.

Messages in (ipc.py): connect, add, abort, stop, forget (a front-end is gone), drain, snapshot, lora (load or
unload an adapter), weights (read the weights again from a folder), reset_prefix_cache, metrics, stop_all. Messages
out: to front-ends ack, out, moved, down, ended (requests aborted here); to the supervisor group_up, connect_failed,
group_down, group_left, lora_done, weights_done, reset_done, metrics.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import zmq

from common.util import freeze_heap
from scheduler_svc import ipc
from scheduler_svc.adapters import AdapterError
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine_core import EngineCore, NotServedHere
from scheduler_svc.grpc_executor import GrpcExecutor, WatchConfig, WorkerUnavailable
from scheduler_svc.metrics import EngineMetrics
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.scheduler import QueueFullError
from scheduler_svc.sequence import Sequence

log = logging.getLogger("splitserve.scheduler")


@dataclass(slots=True)
class Connect:
    """How to reach a worker: what a connect message carries."""
    group_id: int
    address: str
    timeout: float
    wait_for_ready: bool
    stale_epoch: int | None
    adapters: dict[str, str]  # the tree's LoRA adapters loaded ("": unloaded) while serving, by name
    weights: str  # the folder the tree's weights were read from while serving ("": none was)
    weight_version: str  # the name UpdateWeights gave them


@dataclass(slots=True)
class _Owned:
    seq: Sequence
    frontend: int
    key: int


@dataclass(slots=True)
class _Outputs:
    """One step's outputs for one front-end."""
    keys: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finished: list[list] = field(default_factory=list)  # [index, finish reason]
    # [index, prompt tokens the prefix cache served, prompt logprobs as [token, logprob, top] or None]
    first: list[list] = field(default_factory=list)
    logprobs: list | None = None  # per output: None, or (logprob, [(token id, logprob) of the top n])


class EngineGroup:
    """One worker group: its EngineCore driven by a thread of its own. Every engine mutation happens on that
    thread; other threads hand it commands."""

    def __init__(self, connect: Connect, config: SchedulerConfig, eos_token_ids, watch: WatchConfig,
                 credentials, context: zmq.Context, run_dir: str, engine_index: int, frontends: int,
                 metrics: EngineMetrics):
        """frontends: how many front-ends there are (0..frontends-1): each gets the group's load and events."""
        self.group_id, self.address = connect.group_id, connect.address
        executor = GrpcExecutor(connect.address, connect.timeout, watch, connect.wait_for_ready, credentials)
        try:
            self.core = EngineCore(executor, config, eos_token_ids, scheduler_id=f"engine-{engine_index}")
            if self.core.worker_info.epoch == connect.stale_epoch:
                raise WorkerUnavailable(f"worker {connect.address} is still at the epoch of its previous stream")
            executor.open(self._stream_ended)
            self._sync_adapters(connect.adapters)
            if connect.weights and self.core.worker_info.weights_path != connect.weights:
                if error := self.core.settle_weights(connect.weights):
                    raise RuntimeError(f"worker {connect.address} could not read the weights the others serve from "
                                       f"{connect.weights}: {error}")
                self.core.worker_info.weights_path = connect.weights  # as the supervisor is told (_group_info)
        except BaseException:
            executor.close()
            raise
        self.executor = executor
        self.info = self.core.worker_info
        # the name of the weights that compute its tokens, sent with its load: a front-end stamps a completion's last
        # message with it, in order with the tokens (GenerateResponse.weight_version)
        self.weight_version = connect.weight_version if connect.weights else self.info.weights_path
        self._version_asked = ""  # an update's, until its outcome
        self.scheduler = self.core.scheduler
        self.scheduler.block_manager.record_events = True
        self.core.step_observer = metrics.step_observer(connect.address)
        self.alive = True
        self.num_requests = 0
        self._context, self._run_dir, self._engine_index = context, run_dir, engine_index
        self._frontends = range(frontends)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._owned: dict[tuple[int, int], _Owned] = {}
        self._by_seq: dict[int, _Owned] = {}
        self._last_load: dict[int, tuple] = {}  # per front-end, the load it was last sent
        self._drain_deadline: float | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"engine-{connect.address}")
        self._thread.start()

    def _sync_adapters(self, adapters: dict[str, str]) -> None:
        """Before the group serves: loads the tree's adapters its worker lacks and drops those the tree unloaded,
        so that it joins serving what the others serve; an adapter it cannot load is left out (logged)."""
        mine = self.core.scheduler.adapters
        unloads = [(name, path) for name, path in adapters.items() if not path and name in mine.served]
        loads = [(name, path) for name, path in adapters.items() if path and name not in mine.served]
        for ops in (unloads, loads):  # unloads first: they make room for the loads
            for name, path in ops:
                try:
                    mine.update(name, path)
                except AdapterError as e:
                    log.warning("worker %s: LoRA adapter %s: %s", self.address, name, e,
                                extra={"worker": self.address})
            for outcome in self.core.settle_adapters():
                if outcome.error:
                    log.warning("worker %s: %s", self.address, outcome.error, extra={"worker": self.address})

    # ---- from other threads -----------------------------------------------------------------------
    def command(self, message: list) -> None:
        self._commands.put(message)
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.executor.close()

    def _stream_ended(self) -> None:
        self._wake.set()

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        out = ipc.Outboxes(self._context, self._run_dir)
        try:
            while not self._stopping:
                self._apply_commands(out)
                if self._drain_deadline is not None and self._drained(out):
                    return
                if not self.core.has_unfinished():
                    self.executor.check()  # an idle worker that went away
                    self._send_load(out, {})
                    self._wake.wait(1.0)
                    self._wake.clear()
                    continue
                self._send(out, self.core.step())
                if self.scheduler.lost:
                    self._send_lost(out)
                if self.scheduler.adapters.outcomes:
                    for o in self.scheduler.adapters.take_outcomes():
                        self._adapter_done(out, o.ticket, o.code, o.error)
                for o in self.scheduler.take_weights_outcomes() if self.scheduler.weights_outcomes else ():
                    if not o.error:
                        self.weight_version = self._version_asked
                    out.send(ipc.SUPERVISOR, ["weights_done", self._engine_index, self.group_id, o.ticket, o.error])
        except Exception as e:
            if self._stopping:
                return
            if isinstance(e, WorkerUnavailable):
                log.error("worker group %s failed: %s", self.address, e, extra={"worker": self.address})
            else:
                log.exception("worker group %s: engine failed", self.address, extra={"worker": self.address})
            self.alive = False
            self._fail(out, str(e))
        finally:
            out.close()

    def _fail(self, out: ipc.Outboxes, reason: str) -> None:
        """Tells every front-end which of its requests this group held, and the supervisor that it is gone."""
        by_frontend: dict[int, list[int]] = {}
        for owned in self._owned.values():
            by_frontend.setdefault(owned.frontend, []).append(owned.key)
        for message in self._drain_queue():  # adds queued since: their front-ends move them too
            if message[0] == "add":
                by_frontend.setdefault(message[1], []).append(message[2])
        for f, keys in by_frontend.items():
            out.send(ipc.frontend_name(f), ["down", self.group_id, ipc.ints(keys), reason])
        out.send(ipc.SUPERVISOR, ["group_down", self._engine_index, self.group_id, self.address, self.info.epoch,
                                  reason])
        self.executor.close()

    def _drain_queue(self) -> list[list]:
        messages = []
        while True:
            try:
                messages.append(self._commands.get_nowait())
            except queue.Empty:
                return messages

    def _apply_commands(self, out: ipc.Outboxes) -> None:
        for message in self._drain_queue():
            op = message[0]
            if op == "add":
                self._add(out, message)
            elif op == "abort":
                _, f, keys = message
                for key in ipc.unints(keys):
                    owned = self._owned.pop((f, key), None)
                    if owned is not None:
                        del self._by_seq[owned.seq.seq_id]
                        self.core.abort(owned.seq)
            elif op == "stop":
                owned = self._owned.pop((message[1], message[2]), None)
                if owned is not None:
                    del self._by_seq[owned.seq.seq_id]
                    self.core.stop(owned.seq)
            elif op == "forget":
                for owned in [o for o in self._owned.values() if o.frontend == message[1]]:
                    del self._owned[owned.frontend, owned.key], self._by_seq[owned.seq.seq_id]
                    self.core.abort(owned.seq)
            elif op == "drain":  # [drain, group, grace, whether queued requests have another group to go to]
                self._drain_deadline = time.monotonic() + max(0.0, message[2])
                if message[3]:
                    self._move_out(out, waiting_only=True)
            elif op == "snapshot":
                self._send_load(out, {}, snapshot=message[1])
            elif op == "lora":  # [lora, group, ticket, name, path ("": unload)]
                _, _, ticket, name, path = message
                try:
                    self.scheduler.adapters.update(name, path, ticket)
                except AdapterError as e:
                    self._adapter_done(out, ticket, e.code, str(e))
            elif op == "weights":  # [weights, group, ticket, path, whether the requests held end now, version]
                try:
                    self.scheduler.update_weights(message[3], message[2])
                    self._version_asked = message[5]
                except ValueError as e:  # another is asked for: nothing aborted for this one
                    out.send(ipc.SUPERVISOR, ["weights_done", self._engine_index, self.group_id, message[2], str(e)])
                else:
                    if message[4]:
                        self._abort_all(out)
            elif op == "reset_prefix_cache":  # [reset_prefix_cache, group, ticket]
                dropped = self.scheduler.block_manager.forget_free()
                self._send_load(out, {})  # the front-ends' routers learn the hashes are gone now, not a step later
                out.send(ipc.SUPERVISOR, ["reset_done", self._engine_index, self.group_id, message[2], dropped])

    def _abort_all(self, out: ipc.Outboxes) -> None:
        """Every sequence the group holds ends now (reason "abort"), each front-end told which of its requests."""
        seqs = [owned.seq for owned in self._owned.values()]
        for seq in seqs:
            self.core.abort(seq)
        self._leave(out, seqs, "", "ended")

    def _adapter_done(self, out: ipc.Outboxes, ticket: int, code: str, error: str) -> None:
        out.send(ipc.SUPERVISOR, ["lora_done", self._engine_index, self.group_id, ticket, code, error,
                                  list(self.scheduler.adapters.served)])

    def _add(self, out: ipc.Outboxes, message: list) -> None:
        _, f, key, _group, prompt_len, ids, params, priority, force, hashes = message
        try:
            if self._drain_deadline is not None:
                raise WorkerUnavailable(f"worker {self.address} drains")
            seq = self.core.add(list(ipc.unints(ids, "i")), SamplingParams(**params), prompt_len=prompt_len,
                                priority=priority, request_id=f"{f}:{key}", block_hashes=ipc.unints(hashes, "Q"),
                                force=force)
        except QueueFullError as e:
            out.send(ipc.frontend_name(f), ["ack", self.group_id, key, "full", str(e)])
            return
        except (WorkerUnavailable, NotServedHere) as e:  # another group may take it
            out.send(ipc.frontend_name(f), ["ack", self.group_id, key, "gone", str(e)])
            return
        except ValueError as e:
            out.send(ipc.frontend_name(f), ["ack", self.group_id, key, "fit", str(e)])
            return
        self._owned[f, key] = self._by_seq[seq.seq_id] = _Owned(seq, f, key)
        self.num_requests += 1
        out.send(ipc.frontend_name(f), ["ack", self.group_id, key, "", ""])

    def _send_lost(self, out: ipc.Outboxes) -> None:
        """LoRA adapters this group could not read again (Scheduler.lost): the requests that waited for one leave the
        group (its front-ends continue them where another group serves the adapter, else end them with why), and
        the supervisor learns that the group no longer serves it."""
        for name, why, seqs in self.scheduler.take_lost():
            log.warning("worker %s: LoRA adapter %s could not be read again, %d request(s) under it leave: %s",
                        self.address, name, len(seqs), why, extra={"worker": self.address})
            reason = f"LoRA adapter {name!r} could not be read again from its folder ({why})"
            self._leave(out, seqs, reason)
            self._adapter_done(out, 0, "UNAVAILABLE", reason)

    def _move_out(self, out: ipc.Outboxes, waiting_only: bool = False) -> int:
        moved = self.core.move_out([o.seq for o in self._owned.values()], waiting_only)
        self._leave(out, moved, "")
        return len(moved)

    def _leave(self, out: ipc.Outboxes, seqs: list[Sequence], why: str, op: str = "moved") -> None:
        """These sequences, out of the scheduler already, leave the group: each front-end is told which of its
        requests to continue elsewhere ("moved", with why; "": the group drains), or to end ("ended": aborted here)."""
        by_frontend: dict[int, list[int]] = {}
        for seq in seqs:
            owned = self._by_seq.pop(seq.seq_id, None)
            if owned is not None:
                del self._owned[owned.frontend, owned.key]
                by_frontend.setdefault(owned.frontend, []).append(owned.key)
        for f, keys in by_frontend.items():
            out.send(ipc.frontend_name(f), [op, self.group_id, ipc.ints(keys), why])

    def _drained(self, out: ipc.Outboxes) -> bool:
        """While draining: once nothing runs here, or the grace period is over, moves the rest out, closes the
        stream and tells the supervisor; True then."""
        if self._owned and time.monotonic() < self._drain_deadline:
            return False
        moved = self._move_out(out)
        self.alive = False
        self.executor.close()
        out.send(ipc.SUPERVISOR, ["group_left", self._engine_index, self.group_id, self.address, self.info.epoch,
                                  moved])
        return True

    def _send(self, out: ipc.Outboxes, sequences: list[Sequence]) -> None:
        """One message per front-end with outputs: its tokens, finishes, first outputs and logprobs."""
        outputs: dict[int, _Outputs] = {}
        by_seq = self._by_seq
        for seq in sequences:
            owned = by_seq.get(seq.seq_id)
            if owned is None:
                continue
            o = outputs.get(owned.frontend)
            if o is None:
                o = outputs[owned.frontend] = _Outputs()
            i = len(o.keys)
            o.keys.append(owned.key)
            o.tokens.append(seq.token_ids[-1])
            if len(seq.token_ids) == seq.num_sent_tokens + 1:  # its first token of this incarnation
                prompt = None if seq.prompt_logprobs is None else [
                    [lp.token_id, lp.logprob, lp.top] for lp in seq.prompt_logprobs]
                pooled = None if seq.pooled is None else ipc.floats(seq.pooled)
                o.first.append([i, seq.num_cached_tokens or 0, prompt, seq.scheduled_at, pooled])
            if seq.logprobs:  # asked for, and the worker gave them (a simulated worker gives none)
                if o.logprobs is None:
                    o.logprobs = [None] * i
                lp = seq.logprobs[-1]
                o.logprobs.append([lp.logprob, lp.top])
            elif o.logprobs is not None:
                o.logprobs.append(None)
            if seq.finish_reason is not None:
                o.finished.append([i, seq.finish_reason])
                del by_seq[seq.seq_id], self._owned[owned.frontend, owned.key]
        self._send_load(out, outputs)

    def _send_load(self, out: ipc.Outboxes, outputs: dict[int, _Outputs], snapshot: int | None = None) -> None:
        """The outputs, and to every front-end the group's load and prefix-cache events when they changed."""
        sched = self.scheduler
        bm = sched.block_manager
        load = (sched.num_waiting, sched.num_waiting_tokens, sched.num_running, bm.num_free_blocks,
                bm.num_cached_blocks, sched.num_preemptions, self.num_requests, self.weight_version)
        stored, removed = bm.take_events()
        events = [ipc.ints(stored, "Q"), ipc.ints(removed, "Q")] if stored or removed else None
        for f in self._frontends:
            o = outputs.get(f)
            if o is None and events is None and snapshot != f and self._last_load.get(f) == load:
                continue
            self._last_load[f] = load
            message = ["out", self.group_id, list(load), events]
            if snapshot == f:
                message[3] = [ipc.ints(bm.cached_hashes(), "Q"), b"", True]
            if o is not None:
                message += [ipc.ints(o.keys), ipc.ints(o.tokens, "i"), o.finished, o.first, o.logprobs]
            out.send(ipc.frontend_name(f), message)


def _group_info(group: EngineGroup) -> dict:
    info = group.info
    return {"model": info.model, "dtype": info.dtype, "num_blocks": info.num_blocks, "block_size": info.block_size,
            "max_model_len": group.scheduler.max_model_len, "vocab_size": info.vocab_size, "epoch": info.epoch,
            "device": info.device, "kv_cache_dtype": info.kv_cache_dtype or info.dtype,
            "projection_dtype": info.projection_dtype or info.dtype,
            "num_host_blocks": info.num_host_blocks, "sliding_window": info.sliding_window,
            "hidden_size": info.hidden_size, "embedding_only": info.embedding_only,
            "lora_adapters": list(group.scheduler.adapters.served), "labels": list(info.labels),
            "label_activation": info.label_activation, "label_pooling": info.label_pooling or "last",
            "weights_path": info.weights_path, "weight_version": group.weight_version}


def engine_main(index: int, run_dir: str, argv: list[str], frontends: int, parent) -> None:
    """Entry point of engine process `index`: serves the groups the supervisor connects, until told to stop
    or the supervisor is gone (`parent`: a pipe end that breaks then)."""
    from scheduler_svc import cli

    ipc.become_child(f"engine {index}", parent)
    args = cli.parse_child_args(argv)
    watch = cli.watch_config(args)
    credentials = args.tls.channel_credentials if args.tls is not None else None
    from scheduler_svc.tokenizer import load_tokenizer

    eos = load_tokenizer(args.model).eos_token_ids
    context = zmq.Context()
    inbox = ipc.inbox(context, run_dir, ipc.engine_name(index))
    out = ipc.Outboxes(context, run_dir)
    groups: dict[int, EngineGroup] = {}
    metrics = EngineMetrics(lambda: [g for g in groups.values() if g.alive])
    # from connecting threads: (message for the supervisor, the new group or None), taken by this thread
    replies: queue.SimpleQueue = queue.SimpleQueue()

    def connect(c: Connect) -> None:
        try:
            group = EngineGroup(c, args.config, eos, watch, credentials() if credentials else None, context, run_dir,
                                index, frontends, metrics)
        except Exception as e:  # WorkerUnavailable, another protocol version, ...
            replies.put((["connect_failed", index, c.group_id, c.address, f"{type(e).__name__}: {e}",
                          isinstance(e, WorkerUnavailable)], None))
            return
        replies.put((["group_up", index, c.group_id, c.address, _group_info(group)], group))

    threading.Thread(target=_watchdog, args=(groups, watch), daemon=True, name="step-watchdog").start()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    freeze_heap()
    out.send(ipc.SUPERVISOR, ["hello", "engine", index, os.getpid()])
    while True:
        while not replies.empty():
            reply, group = replies.get()
            if group is not None:
                groups[group.group_id] = group
            out.send(ipc.SUPERVISOR, reply)
        if not poller.poll(50):
            continue
        message = ipc.unpack(inbox.recv())
        op = message[0]
        if op == "connect":
            threading.Thread(target=connect, args=(Connect(*message[1:]),), daemon=True,
                             name=f"connect-{message[2]}").start()
        elif op in ("add", "drain", "snapshot", "lora", "weights", "reset_prefix_cache"):
            group = groups.get(message[3] if op == "add" else message[2] if op == "snapshot" else message[1])
            if group is not None and group.alive:
                group.command(message)
            elif op == "add":  # gone meanwhile: its front-end moves it
                out.send(ipc.frontend_name(message[1]), ["ack", message[3], message[2], "gone", "worker group gone"])
            elif op == "drain":
                out.send(ipc.SUPERVISOR, ["group_left", index, message[1], "", 0, 0])
            elif op == "lora":
                out.send(ipc.SUPERVISOR, ["lora_done", index, message[1], message[2], "UNAVAILABLE",
                                          "the worker group is gone", []])
            elif op == "weights":
                out.send(ipc.SUPERVISOR, ["weights_done", index, message[1], message[2], None])
            elif op == "reset_prefix_cache":
                out.send(ipc.SUPERVISOR, ["reset_done", index, message[1], message[2], 0])
        elif op in ("abort", "stop"):
            group = groups.get(message[3])
            if group is not None and group.alive:
                group.command(message[:3])
        elif op == "forget":
            for group in groups.values():
                if group.alive:
                    group.command(message)
        elif op == "fail":  # the worker registered again at another epoch: this stream is gone
            group = groups.get(message[1])
            if group is not None and group.alive:
                group.executor.fail(message[2])
                group.command(["noop"])
        elif op == "metrics":
            out.send(ipc.SUPERVISOR, ["metrics", message[1], metrics.text()])
        elif op == "stop_all":
            for group in groups.values():
                group.stop()
            out.close()
            inbox.close(0)
            context.term()
            return
        for gid in [gid for gid, g in groups.items() if not g.alive and not g._thread.is_alive()]:
            del groups[gid]


def _watchdog(groups: dict[int, EngineGroup], watch: WatchConfig) -> None:
    """The step-progress watchdog over every group of this engine (the heartbeat and the stream watch
    themselves)."""
    interval = min(1.0, max(0.05, watch.step_timeout / 10))
    while True:
        time.sleep(interval)
        for group in list(groups.values()):
            if group.alive and (reason := group.executor.check_progress()):
                log.error("watchdog: %s", reason, extra={"worker": group.address})
