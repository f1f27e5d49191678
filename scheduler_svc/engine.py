"""The engine loop over one worker group: requests in, schedule -> submit -> receive -> update, text
deltas out. With pipelining the plans of steps N+1 and N+2 are submitted before the result of step N is
read (depth 3), so the worker never waits for the scheduler's Python or the gRPC round trip."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protos import worker_pb2
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.executor import PROTOCOL_VERSION, Executor
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.sequence import Sequence, SequenceStatus, TokenLogprob
from scheduler_svc.tokenizer import ModelTokenizer, load_tokenizer


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 0  # 0 = the worker's
    long_prefill_token_threshold: int = 0  # 0 = max_num_batched_tokens // 4
    max_waiting: int = 4096
    enable_prefix_caching: bool = True
    # Steps handed to the worker before the oldest one's result is read (1: serial). With 3 the worker
    # already holds step N+2 when N ends, so the result -> plan round trip through gRPC (~0.2 ms on a
    # loaded host) hides behind a whole step even at batch 1 (bench.latency --simulate: 0.91 -> 0.73 ms
    # per token against 0.71 in-process); a finished sequence costs one wasted decode more.
    pipeline_depth: int = 3


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


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
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer


@dataclass(slots=True)
class Orphan:
    """A request taken out of an engine (its worker died or drains) to go on in another one by recompute:
    its tokens so far (prompt and every token already streamed), resolved seed, limits and detokenizer
    state travel with it, so the client sees exactly the tokens and text it would have seen."""
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
        config: EngineConfig | None = None,
        tokenizer: ModelTokenizer | None = None,
    ):
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer or load_tokenizer(model_dir)
        self.executor = executor
        info = executor.describe(
            worker_pb2.DescribeRequest(
                protocol_version=PROTOCOL_VERSION,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                scheduler_id="engine",
            )
        )
        if info.protocol_version != PROTOCOL_VERSION:
            raise RuntimeError(f"worker speaks protocol {info.protocol_version}, scheduler {PROTOCOL_VERSION}")
        self.worker_info = info
        max_model_len = min(config.max_model_len or info.max_model_len, info.max_model_len)
        # The worker refuses plans beyond what it answered it can hold (0: it did not say).
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=info.num_blocks,
                block_size=info.block_size,
                max_model_len=max_model_len,
                max_num_seqs=min(config.max_num_seqs, info.max_num_seqs or config.max_num_seqs),
                max_num_batched_tokens=min(config.max_num_batched_tokens,
                                           info.max_num_batched_tokens or config.max_num_batched_tokens),
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                max_waiting=config.max_waiting,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
            eos_token_ids=self.tokenizer.eos_token_ids,
            epoch=info.epoch,
        )
        self._vocab_size = info.vocab_size or self.tokenizer.vocab_size
        if config.pipeline_depth < 1:
            raise ValueError("pipeline_depth must be at least 1")
        self._depth = config.pipeline_depth
        self._in_flight = 0
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._next_seq_id = 1
        self._aborted: list[RequestOutput] = []  # returned by the next step()
        # Metrics hook (scheduler_svc.metrics.StepObserver): plan(plan) after each submit, result(result)
        # after each receive, on this engine's thread. None: no metrics.
        self.step_observer = None

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request (a larger priority is more urgent); raises ValueError (bad input) or
        QueueFullError."""
        params = params if params is not None else SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            if token_ids and not 0 <= min(token_ids) <= max(token_ids) < self._vocab_size:
                raise ValueError(f"prompt token ids must be in [0, {self._vocab_size})")
        seq_id = self._next_seq_id
        request_id = request_id if request_id is not None else str(seq_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(seq_id, token_ids, params, params.resolved_seed(), request_id=request_id, priority=priority)
        self.scheduler.add(seq)
        self._next_seq_id += 1
        detok = IncrementalDetokenizer(self.tokenizer.tokenizer, token_ids, params.skip_special_tokens, params.stop)
        self._requests[request_id] = self._by_seq[seq_id] = _Request(seq, detok)
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

    def detach(self, waiting_only: bool = False) -> list[Orphan]:
        """Takes every unfinished request out (or only those not running on the worker), with no output:
        they continue elsewhere (adopt()). Their blocks come back; tokens of steps still in flight are
        dropped (never streamed), so each orphan holds exactly what its client has seen."""
        orphans = []
        for req in list(self._requests.values()):
            seq = req.seq
            if waiting_only and seq.status is SequenceStatus.RUNNING:
                continue
            self.scheduler.abort(seq.seq_id)
            self._forget(seq)
            orphans.append(Orphan(seq, req.detokenizer))
        return orphans

    def adopt(self, orphan: Orphan) -> str:
        """Continues a request detached from another engine: it is queued with its prompt plus the tokens
        generated so far (recompute), the same seed and limits, and ahead of the queue's QueueFull bound.
        Raises ValueError when it does not fit this worker (model length, blocks)."""
        old = orphan.seq
        if old.request_id in self._requests:
            raise ValueError(f"request id {old.request_id!r} is already in use")
        seq = Sequence(self._next_seq_id, list(old.token_ids), old.params, old.seed, request_id=old.request_id,
                       prompt_len=old.prompt_len, priority=old.priority)
        seq.num_cached_tokens = old.num_cached_tokens
        seq.logprobs = old.logprobs
        self.scheduler.add(seq, force=True)
        self._next_seq_id += 1
        self._requests[seq.request_id] = self._by_seq[seq.seq_id] = _Request(seq, orphan.detokenizer)
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
                if reason is None:
                    self.scheduler.finish(seq.seq_id, "stop")
                reason = seq.finish_reason = "stop"
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

    def _usage(self, seq: Sequence) -> Usage:
        return Usage(seq.prompt_len, seq.num_output_tokens, seq.num_cached_tokens or 0)

    def _forget(self, seq: Sequence) -> None:
        del self._requests[seq.request_id]
        del self._by_seq[seq.seq_id]
