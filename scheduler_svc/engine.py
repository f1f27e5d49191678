"""The engine of one worker group with its text, in one process: EngineCore's tokens turned into text deltas by
each request's detokenizer (stop strings included). The offline LLM and the tests run it; the service splits
the same two halves over processes (engine_proc.py: the core; frontend.py: the text)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine_core import EngineCore
from scheduler_svc.executor import Executor
from scheduler_svc.output import OutputState, RequestOutput
from scheduler_svc.requests import check_params, check_prompt_ids
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.sequence import Sequence
from scheduler_svc.tokenizer import ModelTokenizer, load_tokenizer

__all__ = ["EngineRequest", "LLMEngine", "RequestOutput"]

log = logging.getLogger("splitserve.scheduler")


@dataclass(slots=True)
class EngineRequest:
    """A request in an engine: its sequence and its text so far. A request that moves to another engine takes
    both along: its tokens so far (prompt and every token already streamed), resolved seed, limits and
    detokenizer state, so the caller sees exactly the tokens and text it would have seen."""
    seq: Sequence
    text: OutputState

    @property
    def request_id(self) -> str:
        return self.seq.request_id


class LLMEngine:
    def __init__(self, model_dir: str | Path, executor: Executor, config: SchedulerConfig | None = None,
                 tokenizer: ModelTokenizer | None = None):
        self.tokenizer = tokenizer or load_tokenizer(model_dir)
        self.core = EngineCore(executor, config or SchedulerConfig(), self.tokenizer.eos_token_ids)
        self.executor, self.scheduler, self.config = executor, self.core.scheduler, self.core.config
        self.worker_info = self.core.worker_info
        self._vocab_size = self.worker_info.vocab_size or self.tokenizer.vocab_size
        self._requests: dict[str, EngineRequest] = {}
        self._by_seq: dict[int, EngineRequest] = {}
        self._next_id = 1
        self._aborted: list[RequestOutput] = []  # returned by the next step()

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request (the engine's edge: validated here, a text prompt tokenized, the seed drawn when
        none is given). A larger priority is more urgent. Raises ValueError (bad input, or it does not fit the
        worker) or QueueFullError."""
        params = params if params is not None else SamplingParams()
        check_params(params, self._vocab_size)
        if params.bad_words:
            params = dataclasses.replace(params)  # the caller's object stays as it gave it
            params.resolve_bad_words(lambda word: self.tokenizer.encode(word, add_special_tokens=False),
                                     self._vocab_size)
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
        """Queue a request validated at the edge, its seed resolved. block_hashes: its prompt's, when the
        caller has them already (routing). Raises ValueError when it does not fit the worker, or its id is in
        use; QueueFullError."""
        request_id = request_id if request_id is not None else str(self._next_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self.core.add(prompt_ids, params, priority=priority, request_id=request_id,
                            block_hashes=block_hashes or ())
        self._next_id += 1
        text = OutputState(request_id, self.tokenizer.tokenizer, prompt_ids, len(prompt_ids), params)
        self._requests[request_id] = self._by_seq[seq.seq_id] = EngineRequest(seq, text)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request in any state; its final output (reason "abort") comes from the next step()."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self.core.abort(req.seq)
        self._aborted.append(self._abort_output(req.seq))
        return True

    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def move_out(self, waiting_only: bool = False) -> list[EngineRequest]:
        """Takes every unfinished request out (or only those not running on the worker), with no output: they
        continue in another engine (move_in)."""
        moved = self.core.move_out([r.seq for r in self._requests.values()], waiting_only)
        out = [self._by_seq[seq.seq_id] for seq in moved]
        for seq in moved:
            self._forget(seq)
        return out

    def move_in(self, req: EngineRequest, block_hashes: list[int] | None = None) -> str:
        """Continues a request moved out of another engine: queued with its prompt plus the tokens generated so
        far (recompute), the same seed and limits, ahead of the queue's QueueFull bound. Raises ValueError when
        it does not fit this worker (model length, blocks)."""
        old = req.seq
        if old.request_id in self._requests:
            raise ValueError(f"request id {old.request_id!r} is already in use")
        seq = self.core.add(old.token_ids, old.params, prompt_len=old.prompt_len, priority=old.priority,
                            request_id=old.request_id, block_hashes=block_hashes or (), force=True)
        seq.num_cached_tokens = old.num_cached_tokens
        seq.logprobs = old.logprobs
        self._requests[seq.request_id] = self._by_seq[seq.seq_id] = EngineRequest(seq, req.text)
        return seq.request_id

    @property
    def step_observer(self):
        return self.core.step_observer

    @step_observer.setter
    def step_observer(self, observer) -> None:
        self.core.step_observer = observer

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished() or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        for seq in self.core.step():
            outputs.append(self._output(seq))
        for name, why, seqs in self.scheduler.take_lost():
            log.error("LoRA adapter %s could not be read again; its %d waiting request(s) end (reason abort): %s",
                      name, len(seqs), why)
            outputs += [self._abort_output(seq) for seq in seqs]
        return outputs

    def close(self) -> None:
        self.core.close()

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self._by_seq[seq.seq_id].text
        text.cached_tokens = seq.num_cached_tokens
        first = text.num_output == 0  # its prompt's logprobs, when asked, go with its first output
        out, stop_string = text.output(seq.token_ids[-1], seq.finish_reason, seq.logprobs[-1] if seq.logprobs else None)
        if first and seq.prompt_logprobs is not None:
            out.prompt_logprobs, out.prompt_token_ids = seq.prompt_logprobs, seq.token_ids[:seq.prompt_len]
        out.pooled = seq.pooled
        if stop_string:
            self.core.stop(seq)
        if out.finished:
            self._forget(seq)
        return out

    def _abort_output(self, seq: Sequence) -> RequestOutput:
        """The final output of a request ended out of turn (reason "abort"); the engine forgets it."""
        text = self._by_seq[seq.seq_id].text
        text.cached_tokens = seq.num_cached_tokens
        self._forget(seq)
        return RequestOutput(seq.request_id, [], "", True, "abort", usage=text.usage())

    def _forget(self, seq: Sequence) -> None:
        del self._requests[seq.request_id]
        del self._by_seq[seq.seq_id]
