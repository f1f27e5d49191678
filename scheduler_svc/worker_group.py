"""A worker group as the scheduler sees it: its LLMEngine (Scheduler and BlockManager) over a gRPC
executor, driven by a thread of its own so that the engine loop never waits on client streams."""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path

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
        self._on_outputs, self._on_failure = on_outputs, on_failure
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"engine-{address}")
        self._thread.start()

    # Called from other threads: every engine mutation happens on the engine thread.
    def add(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((self.engine.add_request, (prompt_ids, params, request_id), future))
        self._wake.set()
        return future

    def abort(self, request_id: str) -> None:
        self._commands.put((self.engine.abort_request, (request_id,), None))
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.close()

    def load(self) -> tuple[int, int, int]:
        """(waiting prompt tokens, running sequences, free blocks): an unlocked, approximate read."""
        sched = self.engine.scheduler
        return sched.num_waiting_tokens, sched.num_running, sched.block_manager.num_free_blocks

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
