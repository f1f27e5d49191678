"""A worker group as the scheduler sees it: its LLMEngine (Scheduler and BlockManager) over a gRPC
executor, driven by a thread of its own so that the engine loop never waits on client streams."""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from protos import splitserve_pb2 as api
from scheduler_svc.engine import EngineConfig, LLMEngine, RequestOutput
from scheduler_svc.grpc_executor import GrpcExecutor, WorkerUnavailable
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.tokenizer import ModelTokenizer

log = logging.getLogger("splitserve.scheduler")


class WorkerGroup:
    def __init__(self, address: str, model_dir: str | Path, tokenizer: ModelTokenizer, config: EngineConfig,
                 on_outputs: Callable[[list[RequestOutput]], None],
                 on_failure: Callable[["WorkerGroup", list[str], Exception], None]):
        self.address = address
        self.engine = LLMEngine(model_dir, GrpcExecutor(address), config, tokenizer)
        self.info = self.engine.worker_info
        self.alive = True
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
    def add(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.num_requests += 1
        with self._queued_lock:
            self._queued_tokens += len(prompt_ids)
        self._commands.put((self._add_request, (prompt_ids, params, request_id), future))
        self._wake.set()
        return future

    def _add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> str:
        try:
            return self.engine.add_request(prompt_ids, params, request_id)
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

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        return self.engine.scheduler.block_manager.cached_prefix_len(token_ids)

    def _drain(self) -> None:
        while True:
            try:
                fn, args, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(*args)
            except Exception as e:  # bad input or a full queue: the caller turns it into a status
                if future is not None:
                    future.set_exception(e)
            else:
                if future is not None:
                    future.set_result(result)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain()
                if not self.engine.has_unfinished():
                    self._wake.wait(1.0)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if outputs:
                    self._on_outputs(outputs)
        except WorkerUnavailable as e:
            self.alive = False
            log.error("worker group %s failed: %s", self.address, e)
            self._drain()
            self._on_failure(self, self.engine.unfinished_request_ids(), e)
