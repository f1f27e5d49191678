"""The engine loop over one worker group, token ids only: sequences in, schedule -> submit -> receive ->
update, the sequences that received a token out. With pipelining, `pipeline_depth` plans are submitted before
the oldest one's result is read, so the worker never waits for the scheduler's Python or the gRPC round trip.

Text is not made here: the offline LLMEngine (engine.py) and the service's front-ends (frontend.py) turn the
tokens into text and find stop strings, and tell the core through stop()."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from common.limits import Limits
from protos import WORKER_PROTOCOL_VERSION, worker_pb2
from scheduler_svc.adapters import AdapterOutcome, Adapters
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.executor import Executor
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import Sequence, SequenceStatus


class NotServedHere(ValueError):
    """The sequence's LoRA adapter is not served by this group (unloaded or lost since the caller routed it there):
    another group may serve it."""


class EngineCore:
    def __init__(self, executor: Executor, config: SchedulerConfig, eos_token_ids: Iterable[int],
                 scheduler_id: str = "engine"):
        """Shakes hands with the worker (raises RuntimeError on another protocol version); the scheduler plans
        within the smaller of this config's limits and the worker's."""
        self.executor = executor
        limits = config.limits
        info = executor.describe(worker_pb2.DescribeRequest(
            protocol_version=WORKER_PROTOCOL_VERSION, max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens, max_model_len=limits.max_model_len,
            scheduler_id=scheduler_id))
        if info.protocol_version != WORKER_PROTOCOL_VERSION:
            raise RuntimeError(f"worker speaks protocol {info.protocol_version}, scheduler {WORKER_PROTOCOL_VERSION}")
        self.worker_info = info
        # The worker refuses plans beyond what it answered it can hold (0: it did not say).
        worker = Limits(info.max_num_seqs or limits.max_num_seqs,
                        info.max_num_batched_tokens or limits.max_num_batched_tokens, info.max_model_len)
        limits = limits.within(worker)
        if info.encoder:  # a sequence runs whole in one step, and no prefix is reused: its keys depend on later tokens
            limits = dataclasses.replace(limits, max_model_len=min(limits.max_model_len, limits.max_num_batched_tokens))
            config = dataclasses.replace(config, enable_prefix_caching=False)
        self.config = dataclasses.replace(config, limits=limits)
        self.scheduler = Scheduler(self.config, info.num_blocks, info.block_size, eos_token_ids, info.epoch,
                                   info.num_host_blocks, info.sliding_window,
                                   Adapters(list(info.lora_adapters), list(info.lora_slots), info.max_cpu_loras,
                                            list(info.lora_paths),
                                            dict(zip(info.dropped_loras, info.dropped_lora_paths))),
                                   whole_prompts=info.encoder)
        self._depth = self.config.pipeline_depth
        self._in_flight = 0
        self._next_seq_id = 1
        # Metrics hook (scheduler_svc.metrics.StepObserver): plan(plan) after each submit, result(result)
        # after each receive, on the engine's thread. None: no metrics.
        self.step_observer = None

    def add(self, token_ids: list[int], params: SamplingParams, *, prompt_len: int = 0, priority: int = 0,
            request_id: str = "", block_hashes: Iterable[int] = (), force: bool = False) -> Sequence:
        """Queues a sequence validated at the edge, its seed resolved. token_ids may hold generated tokens
        after prompt_len (a request that moved: recompute); force admits it beyond max_waiting (it was admitted
        once already). block_hashes: of its tokens' full blocks, when the caller has them (routing). Raises
        ValueError when it does not fit the worker, QueueFullError."""
        if params.lora and params.lora not in self.scheduler.adapters.served:
            raise NotServedHere(f"LoRA adapter {params.lora!r} is not served by this worker")
        if self.worker_info.embedding_only and not params.pooling:
            raise ValueError("this model has no LM head: it serves embeddings or classifications (Embed, Classify; "
                             "the gateway's /v1/embeddings, /classify), not generations")
        seq = Sequence(self._next_seq_id, list(token_ids), params, request_id=request_id, prompt_len=prompt_len,
                       priority=priority, block_hashes=list(block_hashes))
        self.scheduler.add(seq, force=force)
        self._next_seq_id += 1
        return seq

    def abort(self, seq: Sequence) -> None:
        """Finishes it in any state with reason "abort"; every block it holds comes back."""
        self.scheduler.abort(seq.seq_id)

    def stop(self, seq: Sequence) -> None:
        """A stop string ended seq at its latest token."""
        self.scheduler.stop(seq)

    def move_out(self, sequences: Iterable[Sequence], waiting_only: bool = False) -> list[Sequence]:
        """Takes these sequences out (only those not running on the worker, with waiting_only), to continue
        elsewhere: their blocks come back, and tokens of steps still in flight are dropped."""
        moving = [s for s in sequences if not (waiting_only and s.status is SequenceStatus.RUNNING)]
        for seq in moving:
            self.scheduler.abort(seq.seq_id)
        return moving

    def settle_adapters(self) -> list[AdapterOutcome]:
        """Steps until no LoRA load or unload is pending, and returns their outcomes: where nothing else runs (a
        group before it serves, an offline engine between calls)."""
        adapters = self.scheduler.adapters
        while adapters.pending:
            self.step()
        return adapters.take_outcomes()

    def settle_weights(self, path: str) -> str:
        """Has the worker read its weights again from the checkpoint folder at path, where nothing else runs (a group
        before it serves, an offline engine between calls); returns why it could not ("": done)."""
        self.scheduler.update_weights(path)
        while self.scheduler.weights is not None:
            self.step()
        return self.scheduler.take_weights_outcomes()[-1].error

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight > 0

    def step(self) -> list[Sequence]:
        """Plans a step and, when the pipeline is full (or nothing is left to plan), applies the oldest result.
        Returns the sequences that received a token (token_ids[-1]; finish_reason set when it stopped)."""
        plan = self.scheduler.schedule()
        if plan is not None:
            self.executor.submit(plan)
            self._in_flight += 1
            if self.step_observer is not None:
                self.step_observer.plan(plan)
        if self._in_flight and (plan is None or self._in_flight >= self._depth):
            result = self.executor.receive()
            self._in_flight -= 1
            if self.step_observer is not None:
                self.step_observer.result(result)
            return self.scheduler.update(result)
        return []

    def close(self) -> None:
        self.executor.close()
