"""The engine loop over one worker group: requests in, schedule -> submit -> receive -> update, text
deltas out. With pipelining, `pipeline_depth` plans are submitted before the oldest one's result is read,
so the worker never waits for the scheduler's Python or the gRPC round trip."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from common.limits import Limits
from common.usage import Usage
from protos import WORKER_PROTOCOL_VERSION, worker_pb2
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.executor import Executor
from scheduler_svc.requests import check_params, check_prompt_ids
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import Sequence, SequenceStatus, TokenLogprob
from scheduler_svc.tokenizer import ModelTokenizer, load_tokenizer


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new since the previous output
    text: str  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    logprobs: list[TokenLogprob] | None = None  # for token_ids, when asked for
    usage: Usage | None = None  # on the final output
    stop_reason: str | None = None  # with reason "stop": the stop string, or the stop token's id in decimal


@dataclass(slots=True)
class EngineRequest:
    """A request in an engine: its sequence and its detokenizer. A request that moves to another engine (its
    worker died or drains) takes both along: its tokens so far (prompt and every token already streamed),
    resolved seed, limits and detokenizer state, so the client sees exactly the tokens and text it would
    have seen."""
    seq: Sequence
    detokenizer: IncrementalDetokenizer

    @property
    def request_id(self) -> str:
        return self.seq.request_id


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        executor: Executor,
        config: SchedulerConfig | None = None,
        tokenizer: ModelTokenizer | None = None,
    ):
        config = config or SchedulerConfig()
        self.tokenizer = tokenizer or load_tokenizer(model_dir)
        self.executor = executor
        limits = config.limits
        info = executor.describe(
            worker_pb2.DescribeRequest(
                protocol_version=WORKER_PROTOCOL_VERSION,
                max_num_seqs=limits.max_num_seqs,
                max_num_batched_tokens=limits.max_num_batched_tokens,
                max_model_len=limits.max_model_len,
                scheduler_id="engine",
            )
        )
        if info.protocol_version != WORKER_PROTOCOL_VERSION:
            raise RuntimeError(f"worker speaks protocol {info.protocol_version}, scheduler {WORKER_PROTOCOL_VERSION}")
        self.worker_info = info
        # The worker refuses plans beyond what it answered it can hold (0: it did not say).
        worker = Limits(info.max_num_seqs or limits.max_num_seqs,
                        info.max_num_batched_tokens or limits.max_num_batched_tokens, info.max_model_len)
        self.config = dataclasses.replace(config, limits=limits.within(worker))
        self.scheduler = Scheduler(self.config, info.num_blocks, info.block_size, self.tokenizer.eos_token_ids,
                                   info.epoch)
        self._vocab_size = info.vocab_size or self.tokenizer.vocab_size
        self._depth = self.config.pipeline_depth
        self._in_flight = 0
        self._requests: dict[str, EngineRequest] = {}
        self._by_seq: dict[int, EngineRequest] = {}
        self._next_seq_id = 1
        self._aborted: list[RequestOutput] = []  # returned by the next step()
        # Metrics hook (scheduler_svc.metrics.StepObserver): plan(plan) after each submit, result(result)
        # after each receive, on this engine's thread. None: no metrics.
        self.step_observer = None

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request given by the engine's own caller (offline): validated here, a text prompt tokenized,
        the seed drawn when none is given. A larger priority is more urgent. Raises ValueError (bad input, or
        it does not fit the worker) or QueueFullError."""
        params = params if params is not None else SamplingParams()
        check_params(params, self._vocab_size)
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
            check_prompt_ids(token_ids, self._vocab_size, "prompt")
        else:
            token_ids = list(prompt)
            check_prompt_ids(token_ids, self._vocab_size, "prompt token ids")
        if params.seed is None:
            params = dataclasses.replace(params, seed=params.resolved_seed())
        return self.add(token_ids, params, request_id, priority)

    def add(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, priority: int = 0,
            block_hashes: list[int] | None = None) -> str:
        """Queue a request validated at the edge (add_request, or the service's requests.parse_generate), its
        seed resolved. block_hashes: its prompt's, when the caller has them already (routing). Raises
        ValueError when it does not fit the worker, or its id is in use; QueueFullError."""
        seq_id = self._next_seq_id
        request_id = request_id if request_id is not None else str(seq_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(seq_id, list(prompt_ids), params, request_id=request_id, priority=priority,
                       block_hashes=list(block_hashes or ()))
        self.scheduler.add(seq)
        self._next_seq_id += 1
        detok = IncrementalDetokenizer(self.tokenizer.tokenizer, prompt_ids, params.skip_special_tokens, params.stop)
        self._requests[request_id] = self._by_seq[seq_id] = EngineRequest(seq, detok)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request in any state; its final output (reason "abort") comes from the next step()."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self.scheduler.abort(req.seq.seq_id)
        self._aborted.append(RequestOutput(request_id, [], "", True, "abort", usage=self._usage(req.seq)))
        self._forget(req.seq)
        return True

    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def move_out(self, waiting_only: bool = False) -> list[EngineRequest]:
        """Takes every unfinished request out (or only those not running on the worker), with no output:
        they continue in another engine (move_in). Their blocks come back; tokens of steps still in flight
        are dropped (never streamed), so each request holds exactly what its client has seen."""
        moving = []
        for req in list(self._requests.values()):
            seq = req.seq
            if waiting_only and seq.status is SequenceStatus.RUNNING:
                continue
            self.scheduler.abort(seq.seq_id)
            self._forget(seq)
            moving.append(req)
        return moving

    def move_in(self, req: EngineRequest, block_hashes: list[int] | None = None) -> str:
        """Continues a request moved out of another engine: it is queued with its prompt plus the tokens
        generated so far (recompute), the same seed and limits, and ahead of the queue's QueueFull bound.
        block_hashes: of its tokens' full blocks at this worker's block size, when the caller has them.
        Raises ValueError when it does not fit this worker (model length, blocks)."""
        old = req.seq
        if old.request_id in self._requests:
            raise ValueError(f"request id {old.request_id!r} is already in use")
        seq = Sequence(self._next_seq_id, list(old.token_ids), old.params, request_id=old.request_id,
                       prompt_len=old.prompt_len, priority=old.priority, block_hashes=list(block_hashes or ()))
        seq.num_cached_tokens = old.num_cached_tokens
        seq.logprobs = old.logprobs
        self.scheduler.add(seq, force=True)
        self._next_seq_id += 1
        self._requests[seq.request_id] = self._by_seq[seq.seq_id] = EngineRequest(seq, req.detokenizer)
        return seq.request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight > 0 or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan is not None:
            self.executor.submit(plan)
            self._in_flight += 1
            if self.step_observer is not None:
                self.step_observer.plan(plan)
        outputs = self._aborted
        self._aborted = []
        if self._in_flight and (plan is None or self._in_flight >= self._depth):
            result = self.executor.receive()
            self._in_flight -= 1
            if self.step_observer is not None:
                self.step_observer.result(result)
            for seq in self.scheduler.update(result):
                outputs.append(self._output(seq))
        return outputs

    def close(self) -> None:
        self.executor.close()

    def _output(self, seq: Sequence) -> RequestOutput:
        detokenizer = self._by_seq[seq.seq_id].detokenizer
        token = seq.token_ids[-1]
        reason = seq.finish_reason
        stop_reason = None
        if reason == "stop":  # a stop token (EOS or stop_token_ids): not part of the text
            text = detokenizer.flush()
            stop_reason = str(token)
        else:
            text, stopped = detokenizer.add(token, len(seq.token_ids) >= seq.min_len)
            if stopped:
                self.scheduler.stop(seq)
                reason = seq.finish_reason
                stop_reason = detokenizer.stop_string
            elif reason is not None:
                text += detokenizer.flush()
        out = RequestOutput(
            seq.request_id, [token], text, reason is not None, reason, [seq.logprobs[-1]] if seq.logprobs else None,
            stop_reason=stop_reason,
        )
        if reason is not None:
            out.usage = self._usage(seq)
            self._forget(seq)
        return out

    @staticmethod
    def _usage(seq: Sequence) -> Usage:
        return Usage(seq.prompt_len, seq.num_output_tokens, seq.num_cached_tokens or 0)

    def _forget(self, seq: Sequence) -> None:
        del self._requests[seq.request_id]
        del self._by_seq[seq.seq_id]
