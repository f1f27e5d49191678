"""A worker group as the scheduler sees it: its LLMEngine (Scheduler and BlockManager) over a gRPC
executor, driven by a thread of its own so that the engine loop never waits on client streams.

A group lives as long as one Execute stream to its worker: when the stream breaks (the worker died,
restarted, stopped answering pings, or a step made no progress: see grpc_executor), the group is dead
for good and hands its unfinished requests (EngineRequests) to on_failure, to continue elsewhere. A
worker that comes back gets a new group with a fresh block pool."""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from protos import splitserve_pb2 as api
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import EngineRequest, LLMEngine, RequestOutput
from scheduler_svc.grpc_executor import GrpcExecutor, WatchConfig, WorkerUnavailable
from scheduler_svc.prefix_hash import PromptHashes
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.tokenizer import ModelTokenizer

log = logging.getLogger("splitserve.scheduler")


class GroupUnavailable(RuntimeError):
    """The group is dead: route the request elsewhere."""


class WorkerGroup:
    def __init__(self, address: str, model_dir: str | Path, tokenizer: ModelTokenizer, config: SchedulerConfig,
                 on_outputs: Callable[[list[RequestOutput]], None],
                 on_failure: Callable[["WorkerGroup", list[EngineRequest], Exception], None],
                 watch: WatchConfig | None = None, connect_timeout: float = 600.0, wait_for_ready: bool = True,
                 stale_epoch: int | None = None, credentials: grpc.ChannelCredentials | None = None):
        """Connects (Describe, then opens the Execute stream); raises WorkerUnavailable when the worker
        does not answer within connect_timeout, or still answers with stale_epoch (the epoch of the stream
        given up on: the worker has not reset yet). credentials: TLS to the worker (None: plaintext)."""
        self.address = address
        executor = GrpcExecutor(address, connect_timeout, watch, wait_for_ready, credentials)
        try:
            self.engine = LLMEngine(model_dir, executor, config, tokenizer)
            if self.engine.worker_info.epoch == stale_epoch:
                raise WorkerUnavailable(f"worker {address} is still at the epoch of its previous stream")
            executor.open(self._stream_ended)
        except BaseException:
            executor.close()
            raise
        self.info = self.engine.worker_info
        self.block_size = self.info.block_size
        self.alive = True
        self.draining = False  # the worker deregistered: nothing new is routed here
        self._dead = False  # set under _queued_lock: commands after it are refused (GroupUnavailable)
        self.num_requests = 0  # sequences routed here (each of n completions counts)
        # Prompt tokens of requests routed here whose add has not reached the engine thread yet:
        # routing must see them, or a burst of requests all lands on the group that looked idle.
        self._queued_tokens = 0
        self._queued_lock = threading.Lock()
        self._on_outputs, self._on_failure = on_outputs, on_failure
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"engine-{address}")
        self._thread.start()

    # Called from other threads: every engine mutation happens on the engine thread.
    def add(self, hashes: PromptHashes, params: SamplingParams, request_id: str,
            priority: int = 0) -> concurrent.futures.Future:
        """A request validated at the edge, its prompt's hashes computed for routing. The future fails with
        GroupUnavailable when the group is dead (a request queued before it died is added, then handed to
        on_failure with the others)."""
        prompt_ids = hashes.token_ids
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._queued_lock:
            if self._dead:
                future.set_exception(GroupUnavailable(f"worker {self.address} is gone"))
                return future
            self.num_requests += 1
            self._queued_tokens += len(prompt_ids)
            self._commands.put((self._add_request, (prompt_ids, params, request_id, priority,
                                                    hashes.of(self.block_size)), future))
        self._wake.set()
        return future

    def move_in(self, request: EngineRequest, hashes: PromptHashes) -> concurrent.futures.Future:
        """Continues a request moved out of another group (engine.move_in); fails like add()."""
        return self._command(self.engine.move_in, request, hashes.of(self.block_size))

    def move_out(self, waiting_only: bool = False) -> concurrent.futures.Future:
        """Takes unfinished requests out (engine.move_out), to move them elsewhere: a future of
        EngineRequests."""
        return self._command(self.engine.move_out, waiting_only)

    def fail(self, reason: str) -> None:
        """Declares the worker dead (e.g. it registered again with a new epoch): the failure path runs."""
        self.engine.executor.fail(reason)
        self._wake.set()

    @property
    def num_unfinished(self) -> int:
        """Requests in the engine, plus commands not yet run: an unlocked, approximate read."""
        return self.engine.num_unfinished + self._commands.qsize()

    def _command(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._queued_lock:
            if self._dead:
                future.set_exception(GroupUnavailable(f"worker {self.address} is gone"))
                return future
            self._commands.put((fn, args, future))
        self._wake.set()
        return future

    def _stream_ended(self) -> None:
        """On a gRPC thread, when the Execute stream ends: wake the engine thread to notice."""
        self._wake.set()

    def _add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str, priority: int,
                     block_hashes: list[int]) -> str:
        try:
            return self.engine.add(prompt_ids, params, request_id, priority, block_hashes)
        finally:
            with self._queued_lock:
                self._queued_tokens -= len(prompt_ids)

    def abort(self, request_id: str) -> None:
        self._commands.put((self.engine.abort_request, (request_id,), None))
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.close()

    def load(self) -> tuple[int, int, int]:
        """(waiting prompt tokens, routed ones not yet queued included, running sequences, free blocks): an
        unlocked, approximate read."""
        sched = self.engine.scheduler
        return (sched.num_waiting_tokens + self._queued_tokens, sched.num_running,
                sched.block_manager.num_free_blocks)

    def status(self) -> api.WorkerStatus:
        """What GetModelInfo reports of this group: an unlocked, approximate read, like load()."""
        sched = self.engine.scheduler
        bm = sched.block_manager
        return api.WorkerStatus(address=self.address, alive=self.alive, num_blocks=bm.num_blocks,
                                free_blocks=bm.num_free_blocks, cached_blocks=bm.num_cached_blocks,
                                num_running=sched.num_running, num_waiting=sched.num_waiting,
                                num_requests=self.num_requests, num_preemptions=sched.num_preemptions)

    def cached_prefix_tokens(self, hashes: PromptHashes) -> int:
        """Tokens of the prompt its prefix cache would serve now: an unlocked, approximate read."""
        return self.engine.scheduler.block_manager.cached_prefix_len(hashes.token_ids, hashes.of(self.block_size))

    def _drain(self) -> None:
        while True:
            try:
                fn, args, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.set_running_or_notify_cancel():
                if fn == self._add_request:  # the caller gave up (call cancelled) while queued: not added
                    with self._queued_lock:
                        self._queued_tokens -= len(args[0])
                continue
            try:
                result = fn(*args)
            except Exception as e:  # bad input or a full queue: the caller turns it into a status
                if future is not None:
                    future.set_exception(e)
            else:
                if future is not None:
                    future.set_result(result)

    def _run(self) -> None:
        executor = self.engine.executor
        try:
            while not self._stopping:
                self._drain()
                if not self.engine.has_unfinished():
                    executor.check()  # an idle worker that went away
                    self._wake.wait(1.0)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if outputs:
                    self._on_outputs(outputs)
        except Exception as e:
            if self._stopping:
                return
            if isinstance(e, WorkerUnavailable):
                log.error("worker group %s failed: %s", self.address, e, extra={"worker": self.address})
            else:
                log.exception("worker group %s: engine failed", self.address, extra={"worker": self.address})
            self.alive = False
            with self._queued_lock:
                self._dead = True
            self._drain()  # what was queued before: added (then handed over) or aborted
            self._on_failure(self, self.engine.move_out(), e)
            executor.close()
