"""Offline batch generation (nano-vLLM's LLM.generate): prompts in, texts out, with a progress bar."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from client.client import build_request
from client.scores import cross_encoder_pairs, pair_scores, score_plan
from common import model_files
from common.usage import Usage
from offline.executor import InProcessExecutor
from scheduler_svc.beam_search import beam_search
from scheduler_svc.config import config_from_options
from scheduler_svc.engine import LLMEngine
from scheduler_svc.output import class_probs, embedding
from scheduler_svc.requests import InvalidRequest, prompt_ids
from scheduler_svc.executor import Executor
from scheduler_svc.sampling import MAX_LOGPROBS, SamplingParams, generation_defaults
from scheduler_svc.sequence import TokenLogprob
from scheduler_svc.tokenizer import load_tokenizer


@dataclass(slots=True)
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., when asked (prompt_logprobs)
    pooled: list[float] | None = None  # an embedding request's (SamplingParams.pooling) pooled row


class _Lockstep:
    """Joins the steps of concurrent beam searches into one generate call: a search's next_tokens waits until every
    search still running has asked for its step."""

    def __init__(self, next_tokens: Callable[[list[list[int]]], list[list[tuple[int, float]]]], searches: int):
        self._next_tokens, self._running = next_tokens, searches
        self._asked: list[tuple[list[list[int]], asyncio.Future]] = []

    async def next_tokens(self, prompts: list[list[int]], k: int) -> list[list[tuple[int, float]]]:
        asked = asyncio.get_running_loop().create_future()
        self._asked.append((prompts, asked))
        self._step()
        return await asked

    def leave(self) -> None:
        self._running -= 1
        self._step()

    def _step(self) -> None:
        if not self._asked or len(self._asked) < self._running:
            return
        asked, self._asked = self._asked, []
        try:
            tops = self._next_tokens([p for prompts, _ in asked for p in prompts])
        except Exception as e:
            for _, future in asked:
                future.set_exception(e)
            return
        for prompts, future in asked:
            future.set_result(tops[:len(prompts)])
            tops = tops[len(prompts):]


@dataclass
class BeamOutput:
    text: str
    token_ids: list[int]
    cumulative_logprob: float  # summed over token_ids (and the EOS that ended it, if one did)
    finish_reason: str  # "stop" (an EOS) or "length"


class LLM:
    """Options: the Limits fields (max_num_seqs, max_num_batched_tokens, max_model_len: the scheduler and the
    worker get the same), SchedulerConfig's other fields, and without an executor RunnerConfig's (device,
    dtype, block_size, ...; vLLM's enforce_eager for cuda_graphs=False) for the in-process ModelRunner.
    generation_config and override_generation_config: as the scheduler's --generation-config and
    --override-generation-config, what generate() samples with where it is given no SamplingParams (vLLM's)."""

    def __init__(self, model_dir: str | Path, executor: Executor | None = None, *, generation_config: str = "auto",
                 override_generation_config: dict[str, Any] | None = None, **options: Any):
        self._sampling_defaults = generation_defaults(model_dir, generation_config, override_generation_config)
        if "enforce_eager" in options:
            options["cuda_graphs"] = not options.pop("enforce_eager")
        config, options = config_from_options(options)
        if executor is None:
            from worker_svc.runtime.model_runner import RunnerConfig  # imports torch: only here, only when asked

            executor = InProcessExecutor.for_model(model_dir, RunnerConfig(limits=config.limits, **options))
        elif options:
            raise TypeError(f"unknown options {sorted(options)} (an executor was given)")
        self.model_dir = model_dir
        # the caller's own process: a chat template passed to chat() is trusted
        self.engine = LLMEngine(model_dir, executor, config,
                                tokenizer=load_tokenizer(model_dir, trust_request_chat_template=True))

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the generation config's defaults (the model's generation_config.json with
        generation_config "auto")."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
    ) -> list[GenerationOutput]:
        """Outputs in the order of the prompts. priority: vLLM's, one per prompt, lower served earlier (the engine's
        larger-is-more-urgent negated)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")

        engine = self.engine
        todo = deque(zip(prompts, sampling_params, (-p for p in priority)))
        order: list[str] = []
        texts: dict[str, list[str]] = {}
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}
        prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        done: dict[str, GenerationOutput] = {}
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        num_tokens = 0
        try:
            while todo or engine.has_unfinished():
                # Feed the queue up to its bound rather than all at once.
                while todo and engine.scheduler.num_waiting < engine.scheduler.config.max_waiting:
                    prompt, params, urgency = todo.popleft()
                    rid = engine.add_request(prompt, params, priority=urgency)
                    order.append(rid)
                    texts[rid], tokens[rid] = [], []
                for out in engine.step():
                    rid = out.request_id
                    texts[rid].append(out.text)
                    tokens[rid].extend(out.token_ids)
                    if out.logprobs:
                        logprobs.setdefault(rid, []).extend(out.logprobs)
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[rid] = out.prompt_logprobs
                    num_tokens += len(out.token_ids)
                    if out.finished:
                        text = "".join(texts.pop(rid))
                        done[rid] = GenerationOutput(text, tokens.pop(rid), out.finish_reason, out.usage,
                                                     logprobs.pop(rid, None), prompt_logprobs.pop(rid, None),
                                                     out.pooled)
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{num_tokens / (time.perf_counter() - start):.0f}", refresh=False)
        finally:
            bar.close()
        return [done[rid] for rid in order]

    def beam_search(self, prompts: str | list[int] | Seq[str | list[int]], beam_width: int, max_tokens: int, *,
                    ignore_eos: bool = False, length_penalty: float = 1.0, lora: str = "") -> list[list[BeamOutput]]:
        """vLLM's LLM.beam_search: for each prompt, the beam_width best beams of a beam search (as the Generate call's
        use_beam_search: scheduler_svc/beam_search.py), best first. The prompts are searched in lockstep: each step's
        beams of every prompt still searching in one batch."""
        if not 1 <= beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be in [1, {MAX_LOGPROBS // 2}], got {beam_width}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        tokenizer = self.engine.tokenizer
        step = SamplingParams(max_tokens=1, temperature=0.0, seed=0, ignore_eos=True, logprobs=2 * beam_width,
                              lora=lora)

        def next_tokens(step_prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
            return [o.logprobs[0].top or [] for o in self.generate(step_prompts, step, use_tqdm=False)]

        async def search(ids: list[int], steps: _Lockstep) -> list[BeamOutput]:
            try:
                beams = await beam_search(steps.next_tokens, ids, beam_width, max_tokens, tokenizer.eos_token_ids,
                                          ignore_eos, length_penalty)
            finally:
                steps.leave()
            return [BeamOutput(tokenizer.decode(b.tokens), b.tokens, b.logprob, b.finish_reason) for b in beams]

        async def search_all() -> list[list[BeamOutput]]:
            steps = _Lockstep(next_tokens, len(prompts))
            ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
            return list(await asyncio.gather(*(search(i, steps) for i in ids)))

        return asyncio.run(search_all())

    def chat(self, messages: Seq[dict[str, Any]] | Seq[Seq[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True, *,
             tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             add_generation_prompt: bool | None = None, continue_final_message: bool = False,
             chat_template: str | None = None) -> list[GenerationOutput]:
        """vLLM's LLM.chat: one conversation (OpenAI's messages) or a list of them, each rendered by the model's chat
        template (or `chat_template`, a jinja template's text) as the Generate call renders `chat` (tools and template
        keyword arguments reach the template), then generated; outputs in the order of the conversations. ValueError
        where the template refuses one."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            request = build_request(messages=list(conversation), tools=tools, chat_template_kwargs=chat_template_kwargs,
                                    continue_final_message=continue_final_message, chat_template=chat_template)
            if add_generation_prompt is not None:
                request.chat.add_generation_prompt = add_generation_prompt
            try:
                prompts.append(prompt_ids(request, self.engine.tokenizer, self.engine.tokenizer.vocab_size))
            except InvalidRequest as e:
                raise ValueError(str(e)) from None
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: str | list[int] | Seq[str | list[int]], dimensions: int | None = None,
              normalize: bool | None = None, use_tqdm: bool = True, lora: str = "") -> list[list[float]]:
        """Embeddings in the order of the prompts, as the Embed call makes them (README, "Embeddings"): the model's
        pooling (under the LoRA adapter `lora` where given), the first `dimensions` values, L2-normalised unless
        `normalize` is False (default: the model's)."""
        if self.engine.worker_info.labels:
            raise ValueError("this model is a sequence classifier (its worker's head is a classifier's): use classify")
        pooling = model_files.pooling(self.model_dir)
        params = SamplingParams(max_tokens=0, temperature=0.0, pooling=pooling.kind, lora=lora)
        outs = self.generate(prompts, params, use_tqdm)
        normalize = pooling.normalize if normalize is None else normalize
        return [embedding(o.pooled, pooling.kind, o.usage.prompt_tokens, dimensions, normalize) for o in outs]

    def classify(self, prompts: str | list[int] | tuple[str, str] | Seq[str | list[int] | tuple[str, str]],
                 use_tqdm: bool = True, lora: str = "") -> list[list[float]]:
        """A sequence classifier's probabilities of each label (its worker's labels) for each prompt, in
        order, as the Classify call gives them: a text, token ids, or a (text, text_pair) tuple that the tokenizer
        joins (a cross-encoder's query and document)."""
        info = self.engine.worker_info
        if not info.labels:
            raise ValueError("this model is not a sequence classifier (config.json, with hf_overrides, names no "
                             "ForSequenceClassification): use embed")
        if isinstance(prompts, (str, tuple)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.engine.tokenizer.encode_pair(*p) if isinstance(p, tuple) else p for p in prompts]
        outs = self.generate(ids, SamplingParams(max_tokens=0, temperature=0.0, pooling=info.label_pooling, lora=lora),
                             use_tqdm)
        return [class_probs(o.pooled, info.label_activation) for o in outs]

    def score(self, text_1: str | list[int] | Seq[str | list[int]], text_2: str | list[int] | Seq[str | list[int]],
              use_tqdm: bool = True) -> list[float]:
        """Each pair's score, paired as the Client's score pairs them (one text against one, one against many, or the
        i-th of each list): the cosine similarity of their embeddings, or a cross-encoder's probability."""
        plan = score_plan(text_1, text_2)
        if labels := self.engine.worker_info.labels:
            return [p[0] for p in self.classify(cross_encoder_pairs(plan, labels), use_tqdm)]
        return pair_scores(plan, self.embed(plan.inputs, use_tqdm=use_tqdm))

    def load_lora(self, name: str, path: str | Path) -> None:
        """Loads the LoRA adapter in the PEFT folder `path` under `name`, which SamplingParams.lora then names; where
        max_cpu_loras adapters are held already, the least recently used one makes room (it is read again from its
        folder when a request needs it). ValueError where it cannot: a name in use, or what the worker cannot read or
        serve."""
        self._update_adapter(name, str(path))

    def unload_lora(self, name: str) -> None:
        """Drops the LoRA adapter (loaded here or at start). ValueError where it is not loaded."""
        self._update_adapter(name, "")

    def reset_prefix_cache(self) -> int:
        """vLLM's LLM.reset_prefix_cache: drops every cached prefix (in both KV tiers), so that the next prompts are
        computed whole; returns how many cached blocks were dropped."""
        return self.engine.scheduler.block_manager.forget_free()

    def update_weights(self, path: str | Path) -> None:
        """Reads the model's weights again from another checkpoint of it at `path` (a trainer's new weights: SGLang's
        update_weights_from_disk), in place, and drops every cached prefix; the next prompts run on them. ValueError
        where the worker cannot (the folder holds another model, or is missing): it serves the weights it had."""
        error = self.engine.core.settle_weights(str(path))  # nothing else runs between generate calls
        if error:
            raise ValueError(error)

    def _update_adapter(self, name: str, path: str) -> None:
        if not name:
            raise ValueError("a LoRA adapter needs a name")
        self.engine.scheduler.adapters.update(name, path)
        for outcome in self.engine.core.settle_adapters():  # nothing else runs between generate calls
            if outcome.error:
                raise ValueError(outcome.error)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
