"""Offline batch generation (nano-vLLM's LLM.generate): prompts in, texts out, with a progress bar."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from scheduler_svc.engine import EngineConfig, LLMEngine, Usage
from scheduler_svc.executor import Executor
from scheduler_svc.sampling import SamplingParams

_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
_SHARED_FIELDS = frozenset({"max_num_seqs", "max_num_batched_tokens", "max_model_len"})


@dataclass(slots=True)
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None


def in_process_executor(model_dir: str | Path, **worker_options: Any) -> Executor:
    """The worker's ModelRunner in this process (imports torch: only here, only when asked)."""
    from worker_svc.executor import InProcessExecutor

    return InProcessExecutor(model_dir, **worker_options)


class LLM:
    """`config` takes EngineConfig fields; any other option goes to the default in-process executor."""

    def __init__(self, model_dir: str | Path, executor: Executor | None = None, **config: Any):
        engine_options = {k: v for k, v in config.items() if k in _ENGINE_FIELDS}
        # limits both sides must agree on go to the engine and to the default executor's worker
        worker_options = {k: v for k, v in config.items() if k not in _ENGINE_FIELDS or k in _SHARED_FIELDS}
        if executor is None:
            executor = in_process_executor(model_dir, **worker_options)
        elif set(worker_options) - _SHARED_FIELDS:
            raise TypeError(f"unknown options {sorted(worker_options)} (an executor was given)")
        self.engine = LLMEngine(model_dir, executor, EngineConfig(**engine_options))

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerationOutput]:
        """Outputs in the order of the prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")

        engine = self.engine
        todo = deque(zip(prompts, sampling_params))
        order: list[str] = []
        texts: dict[str, list[str]] = {}
        tokens: dict[str, list[int]] = {}
        done: dict[str, GenerationOutput] = {}
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        num_tokens = 0
        try:
            while todo or engine.has_unfinished():
                # Feed the queue up to its bound rather than all at once.
                while todo and engine.scheduler.num_waiting < engine.scheduler.config.max_waiting:
                    rid = engine.add_request(*todo.popleft())
                    order.append(rid)
                    texts[rid], tokens[rid] = [], []
                for out in engine.step():
                    texts[out.request_id].append(out.text)
                    tokens[out.request_id].extend(out.token_ids)
                    num_tokens += len(out.token_ids)
                    if out.finished:
                        rid = out.request_id
                        text = "".join(texts.pop(rid))
                        done[rid] = GenerationOutput(text, tokens.pop(rid), out.finish_reason, out.usage)
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{num_tokens / (time.perf_counter() - start):.0f}", refresh=False)
        finally:
            bar.close()
        return [done[rid] for rid in order]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
