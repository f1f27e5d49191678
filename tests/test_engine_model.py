"""Greedy generation through LLMEngine / LLM over the in-process executor (the worker's ModelRunner in
this process, same plan/result contract as the gRPC worker) equals transformers' generate token for
token: pipeline depths 3, 2 and 1, chunked prefills, block pressure that forces preemption and resume by
recompute, and prefix-cache hits. fp32 on CPU, qwen3-tiny."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from offline.executor import InProcessExecutor
from offline.llm import LLM
from scheduler_svc.config import config_from_options
from scheduler_svc.engine import LLMEngine
from scheduler_svc.sampling import SamplingParams
from worker_svc.runtime.model_runner import RunnerConfig

pytestmark = pytest.mark.timeout(300)

PROMPT_LENS = [5, 17, 1, 13, 22, 9]
MAX_NEW = 24


def _prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(0, 150000) for _ in range(n)] for n in PROMPT_LENS]


def _greedy(**overrides) -> SamplingParams:
    # ignore_eos: transformers' reference runs with min_new_tokens, so it never stops early either
    return SamplingParams(**{"max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True, **overrides})


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return transformers.Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _hf_generate(hf, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(hf) -> list[list[int]]:
    return [_hf_generate(hf, p) for p in _prompts()]


def _engine(model_dir, *, num_blocks: int, block_size: int, kv_offload_bytes: int = 0, **config) -> LLMEngine:
    config.setdefault("max_num_seqs", 8)
    config, _ = config_from_options(config)
    executor = InProcessExecutor.for_model(model_dir, RunnerConfig(device="cpu", dtype="float32", num_blocks=num_blocks,
                                                                   block_size=block_size, limits=config.limits,
                                                                   kv_offload_bytes=kv_offload_bytes))
    return LLMEngine(model_dir, executor, config)


def _run(engine: LLMEngine, max_steps: int = 5000, on_output=None) -> dict:
    """request id -> (tokens, text, finish reason, usage); checks the engine's invariants every step. on_output:
    called with every final output."""
    tokens: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    done: dict[str, tuple] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            assert out.request_id not in done, "output after the final one"
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            if out.finished:
                done[out.request_id] = (tokens[out.request_id], texts[out.request_id], out.finish_reason, out.usage)
                if on_output is not None:
                    on_output(out)
        engine.scheduler.check()
    raise AssertionError(f"no end after {max_steps} steps")


@pytest.mark.parametrize("depth", [3, 2, 1], ids=["depth3", "depth2", "serial"])
def test_llm_generate_equals_transformers(tiny_model_dir, reference, depth):
    """The offline API, roomy pool: every prompt admitted at once, one mixed batch of prefills."""
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=64, block_size=16, max_num_seqs=8,
             pipeline_depth=depth) as llm:
        outs = llm.generate(_prompts(), _greedy(), use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
        assert all(o.finish_reason == "length" for o in outs)
        assert [o.usage.completion_tokens for o in outs] == [MAX_NEW] * len(outs)
        assert [o.usage.prompt_tokens for o in outs] == PROMPT_LENS
        tok = llm.engine.tokenizer
        assert [o.text for o in outs] == [tok.decode(r) for r in reference]
        sched = llm.engine.scheduler
        assert sched.num_preemptions == 0
        assert sched.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("depth", [3, 1], ids=["depth3", "serial"])
def test_greedy_under_block_pressure_with_preemption(tiny_model_dir, reference, depth):
    """16 blocks of 4 tokens cannot hold the six sequences at once: decodes preempt the newest running
    sequence, which later resumes by recompute and re-hits its own cached full blocks. Small token
    budget and chunk cap: prompts are prefilled in chunks, mixed with decodes."""
    engine = _engine(tiny_model_dir, num_blocks=16, block_size=4, pipeline_depth=depth, max_num_batched_tokens=16,
                     long_prefill_token_threshold=6)
    try:
        ids = [engine.add_request(p, _greedy()) for p in _prompts()]
        done = _run(engine)
        assert [done[r][0] for r in ids] == reference
        assert all(done[r][2] == "length" for r in ids)
        sched = engine.scheduler
        assert sched.num_preemptions > 0
        # The prompts share no prefix: every hit is a resumed sequence finding its own blocks again.
        assert sched.num_prefix_hit_tokens > 0
        assert sched.block_manager.num_free_blocks == 16
        assert not sched.running and not sched.waiting
    finally:
        engine.close()


@pytest.mark.parametrize("depth", [3, 1], ids=["depth3", "serial"])
def test_greedy_with_a_host_tier_swaps_out_and_back_in(tiny_model_dir, reference, depth):
    """The same pressure with a host KV pool behind the 16 blocks: the full blocks of preempted sequences move
    to the host when the GPU needs their room and are swapped back in when their sequence resumes (real
    copies between the two tensors); every sequence still equals transformers, and both tiers end free."""
    engine = _engine(tiny_model_dir, num_blocks=16, block_size=4, pipeline_depth=depth, max_num_batched_tokens=16,
                     long_prefill_token_threshold=6, kv_offload_bytes=32 << 20)
    try:
        ids = [engine.add_request(p, _greedy()) for p in _prompts()]
        done = _run(engine)
        assert [done[r][0] for r in ids] == reference
        sched, bm = engine.scheduler, engine.scheduler.block_manager
        assert sched.num_preemptions > 0 and bm.host is not None
        assert bm.num_swapped_out > 0 and bm.num_swapped_in > 0 and sched.num_host_hit_tokens > 0
        assert bm.num_free_blocks == 16
        bm.check([])  # the host tier's index and reuse order, nothing held past its plan
    finally:
        engine.close()


def test_a_prefix_evicted_to_the_host_comes_back_from_it(tiny_model_dir, hf):
    """A finished request's prefix is pushed out of the 12 GPU blocks by unrelated traffic; the same prefix
    again is served from the host tier (swapped in, not prefilled) and continues as transformers does."""
    rng = random.Random(7)
    prefix = [rng.randrange(0, 150000) for _ in range(40)]
    first, second = prefix + [5, 6], prefix + [rng.randrange(0, 150000) for _ in range(5)]
    engine = _engine(tiny_model_dir, num_blocks=12, block_size=8, kv_offload_bytes=32 << 20)
    try:
        sched, bm = engine.scheduler, engine.scheduler.block_manager
        engine.add_request(first, _greedy(max_tokens=4))
        _run(engine)
        for _ in range(3):  # 3 x 12 blocks of other tokens: every cached GPU block is reused
            engine.add_request([rng.randrange(0, 150000) for _ in range(80)], _greedy(max_tokens=8))
            _run(engine)
        assert bm.num_swapped_out >= 5
        assert sched.num_host_hit_tokens == 0
        b = engine.add_request(second, _greedy(max_tokens=12))
        got = _run(engine)[b]
        assert got[3].cached_prompt_tokens == 40 and sched.num_host_hit_tokens == 40
        assert got[0] == _hf_generate(hf, second, 12)
        assert bm.num_free_blocks == 12
    finally:
        engine.close()


def test_prefix_cache_hit_reports_cached_tokens(tiny_model_dir, hf):
    """A second request that shares a long prefix with a finished one computes only its new tail,
    reports the hit in usage, and still generates exactly what transformers does."""
    rng = random.Random(99)
    prefix = [rng.randrange(0, 150000) for _ in range(40)]
    first, second = prefix + [11, 12, 13], prefix + [rng.randrange(0, 150000) for _ in range(7)]
    engine = _engine(tiny_model_dir, num_blocks=64, block_size=8)
    try:
        a = engine.add_request(first, _greedy(max_tokens=12))
        got_a = _run(engine)[a]
        assert got_a[3].cached_prompt_tokens == 0
        b = engine.add_request(second, _greedy(max_tokens=12))
        got_b = _run(engine)[b]
        assert got_b[3].prompt_tokens == len(second)
        assert got_b[3].cached_prompt_tokens == 40  # five full blocks of 8
        assert got_a[0] == _hf_generate(hf, first, 12)
        assert got_b[0] == _hf_generate(hf, second, 12)
        # The same prompt again: everything but the last token is a hit (it must be computed).
        c = engine.add_request(second, _greedy(max_tokens=12))
        got_c = _run(engine)[c]
        assert got_c[3].cached_prompt_tokens == (len(second) - 1) // 8 * 8
        assert got_c[0] == got_b[0]
        # A cache salt: hits only among requests of the same salt, the same tokens whatever the salt.
        for salt, cached in (("tenant-a", 0), ("tenant-b", 0), ("tenant-a", 40), ("", 40)):
            d = engine.add_request(second, _greedy(max_tokens=12, cache_salt=salt))
            got_d = _run(engine)[d]
            assert got_d[3].cached_prompt_tokens == cached and got_d[0] == got_b[0], salt
        assert engine.scheduler.block_manager.num_free_blocks == 64
    finally:
        engine.close()


def test_llm_reset_prefix_cache_computes_the_next_prompts_whole(tiny_model_dir):
    prompt = [(7 * i) % 5000 + 1 for i in range(40)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=32, block_size=16, max_num_seqs=4) as llm:
        first = llm.generate([prompt], greedy, use_tqdm=False)[0]
        assert llm.generate([prompt], greedy, use_tqdm=False)[0].usage.cached_prompt_tokens == 32
        assert llm.reset_prefix_cache() == 2
        cold = llm.generate([prompt], greedy, use_tqdm=False)[0]
        assert cold.usage.cached_prompt_tokens == 0 and cold.token_ids == first.token_ids


def test_llm_takes_vllms_enforce_eager(tiny_model_dir):
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=32, block_size=16, enforce_eager=True) as llm:
        assert not llm.engine.executor.runner.config.cuda_graphs


def test_llm_samples_with_the_models_generation_config_where_given_no_params(tiny_model_dir):
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=32, block_size=16) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.95, top_k=20)
    with LLM(tiny_model_dir, generation_config="vllm", device="cpu", dtype="float32", num_blocks=32,
             block_size=16) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_text_of_prompts_that_end_inside_a_character(tiny_model_dir, hf):
    """Random token ids can end a prompt inside a UTF-8 character (byte-level tokens). The streamed text
    is that of the generated tokens alone: none of the prompt's text leaks into it."""
    prompts = [[1167, 75241, 88541, 17423, 122562, 155], [17423, 88541], [155]]
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=32, block_size=16, max_num_seqs=4) as llm:
        outs = llm.generate(prompts, _greedy(max_tokens=16), use_tqdm=False)
        tok = llm.engine.tokenizer
        for p, o in zip(prompts, outs):
            assert o.token_ids == _hf_generate(hf, p, 16)
            assert o.text == tok.decode(o.token_ids)


def test_llm_returns_prompt_and_token_logprobs_as_transformers_computes_them(tiny_model_dir, hf):
    """The offline API's prompt_logprobs (prompt tokens 1.., top 2) and logprobs of its greedy tokens, through
    chunked prefill (8 tokens a step), equal transformers' log-softmax; max_tokens 0 scores the prompt alone."""
    prompts = [p for p in _prompts() if len(p) > 1]
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=64, block_size=16, max_num_seqs=8,
             max_num_batched_tokens=8) as llm:
        outs = llm.generate(prompts, _greedy(max_tokens=4, logprobs=0, prompt_logprobs=2), use_tqdm=False)
        scored = llm.generate(prompts[:2], _greedy(max_tokens=0, ignore_eos=False, prompt_logprobs=0),
                              use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.token_ids
        with torch.inference_mode():
            lp = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        want = [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
        got = [x.logprob for x in out.prompt_logprobs] + [x.logprob for x in out.logprobs]
        assert got == pytest.approx(want, abs=1e-4)
        top = lp[:len(prompt) - 1].topk(2, -1)
        assert [[t for t, _ in x.top] for x in out.prompt_logprobs] == top.indices.tolist()
    for out, ref in zip(scored, outs):
        assert out.token_ids == [] and out.finish_reason == "length"
        assert [x.logprob for x in out.prompt_logprobs] == pytest.approx([x.logprob for x in ref.prompt_logprobs],
                                                                         abs=1e-4)


def test_embeddings_pool_as_transformers_beside_generations(tiny_model_dir, hf, reference):
    """Embedding requests (max_tokens 0, a pooling) of a generative checkpoint, each pooling in turn, in steps of
    32 tokens beside greedy generations that ask for logprobs: the last row, the first, and the sum of every row
    (the engine sums a mean's chunks) of transformers' final hidden states; the generations are unchanged. The long
    input fills max_model_len: a pooled input samples no token, so it needs no room for one."""
    engine = _engine(tiny_model_dir, num_blocks=64, block_size=16, max_num_batched_tokens=32, max_model_len=70)
    prompts = _prompts()
    long = [(7 * i) % 1000 for i in range(70)]
    for kind in ("last", "cls", "mean"):
        for i, p in enumerate([long, *prompts[:3]]):
            engine.add(p, SamplingParams(max_tokens=0, temperature=0.0, seed=0, pooling=kind), f"{kind}{i}")
    for i, p in enumerate(prompts):
        engine.add(p, _greedy(logprobs=0, seed=0), f"gen{i}")
    pooled = {}
    done = _run(engine, on_output=lambda out: pooled.__setitem__(out.request_id, out.pooled))
    for i, ref in enumerate(reference):
        tokens, _, reason, _ = done[f"gen{i}"]
        assert tokens == ref and reason == "length"
    for kind in ("last", "cls", "mean"):
        for i, p in enumerate([long, *prompts[:3]]):
            with torch.inference_mode():
                states = hf.model(torch.tensor([p])).last_hidden_state[0]
            want = {"last": states[-1], "cls": states[0], "mean": states.sum(0)}[kind]
            tokens, _, reason, usage = done[f"{kind}{i}"]
            assert tokens == [] and reason == "length" and usage.prompt_tokens == len(p)
            torch.testing.assert_close(torch.tensor(pooled[f"{kind}{i}"]), want, rtol=1e-4, atol=1e-4)


def test_llm_embed_normalises_the_last_state_and_takes_dimensions(tiny_model_dir, hf):
    """The offline API's embed: a checkpoint without sentence-transformers modules pools its last token's state,
    normalised; `dimensions` keeps the first values (then normalised), normalize=False the state as it is; score:
    the cosine of two embeddings."""
    prompts = ["The capital of France", [5, 6, 7, 8]]
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=32, block_size=16) as llm:
        full, short = llm.embed(prompts, use_tqdm=False), llm.embed(prompts, dimensions=8, use_tqdm=False)
        raw = llm.embed(prompts[1], normalize=False, use_tqdm=False)[0]
        (score,) = llm.score(prompts[0], [prompts[1]], use_tqdm=False)
        tokenizer = llm.engine.tokenizer
    assert score == pytest.approx(float(torch.tensor(full[0]) @ torch.tensor(full[1])), abs=1e-5)
    for prompt, vector, head in zip(prompts, full, short):
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        with torch.inference_mode():
            last = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(vector), last / last.norm(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(head), last[:8] / last[:8].norm(), rtol=1e-4, atol=1e-5)
    with torch.inference_mode():
        last = hf.model(torch.tensor([prompts[1]])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(raw), last, rtol=1e-4, atol=1e-4)


def test_llm_chat_renders_each_conversation_as_transformers_does(tiny_model_dir, hf):
    """LLM.chat (vLLM's): each conversation rendered by the checkpoint's own template as transformers' tokenizer renders
    it (Qwen3's enable_thinking reaching it), then generated as transformers generates from those ids."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    conversations = [[{"role": "user", "content": "What is 2 + 2?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=32, block_size=16, max_num_seqs=4) as llm:
        outs = llm.chat(conversations, _greedy(max_tokens=4), use_tqdm=False,
                        chat_template_kwargs={"enable_thinking": False})
        for conversation, out in zip(conversations, outs):
            ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, enable_thinking=False,
                                                tokenize=True, return_dict=False)
            assert out.usage.prompt_tokens == len(ids)
            assert out.token_ids == _hf_generate(hf, list(ids), 4)
        (one,) = llm.chat(conversations[0], _greedy(max_tokens=4), use_tqdm=False,
                          chat_template_kwargs={"enable_thinking": False})
        assert one.token_ids == outs[0].token_ids
        with pytest.raises(ValueError, match="continue_final_message"):
            llm.chat(conversations[0], continue_final_message=True, add_generation_prompt=True, use_tqdm=False)
        # vLLM's chat_template argument: the caller's own template, rendered in place of the checkpoint's
        own = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
        (mine,) = llm.chat(conversations[0], _greedy(max_tokens=4), use_tqdm=False, chat_template=own)
        ids = tokenizer("user: What is 2 + 2?\nassistant:", add_special_tokens=False).input_ids
        assert mine.usage.prompt_tokens == len(ids) and mine.token_ids == _hf_generate(hf, ids, 4)


def test_bad_words_are_tokenized_as_vllm_and_keep_their_tokens_out(tiny_model_dir):
    """vLLM's bad_words: each word tokenized as it is (its leading spaces dropped) and after one space where that gives
    other tokens of the same count; offline, a word of one token of a greedy output never comes, and a word of two
    never has its second token right after its first: the output follows the plain one until then."""
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=64, block_size=16, max_num_seqs=8) as llm:
        tokenizer, vocab = llm.engine.tokenizer, llm.engine.worker_info.vocab_size

        def resolved(*words: str) -> list[list[int]]:
            params = SamplingParams(bad_words=list(words))
            params.resolve_bad_words(lambda w: tokenizer.encode(w, add_special_tokens=False), vocab)
            return params.bad_words_token_ids

        enc = lambda w: tokenizer.encode(w, add_special_tokens=False)  # noqa: E731
        assert resolved("hello", "  hello") == [enc("hello"), enc(" hello")] * 2
        assert enc(" hello") != enc("hello")
        (base,) = llm.generate([_prompts()[0]], _greedy(max_tokens=16), use_tqdm=False)
        out = base.token_ids
        one = next(k for k in range(len(out)) if [out[k]] in resolved(tokenizer.decode([out[k]])))
        two = next(k for k in range(len(out) - 1) if out[k:k + 2] in resolved(tokenizer.decode(out[k:k + 2])))
        (no_one, no_two) = llm.generate([_prompts()[0]] * 2, [
            _greedy(max_tokens=16, bad_words=[tokenizer.decode([out[one]])]),
            _greedy(max_tokens=16, bad_words=[tokenizer.decode(out[two:two + 2])])], use_tqdm=False)
    assert out[one] not in no_one.token_ids and no_one.token_ids[:one] == out[:one]
    assert no_two.token_ids[:two + 1] == out[:two + 1] and no_two.token_ids[two + 1] != out[two + 1]


def test_allowed_token_ids_restrict_every_sampled_token(tiny_model_dir, hf):
    """vLLM's allowed_token_ids: greedy picks transformers' argmax among them at every position (prefill and decode
    steps); sampled tokens (with logprobs, beside unrestricted rows) are all among them."""
    allowed = [11, 220, 1000, 5000, 151643]
    prompts = _prompts()[:3]
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=64, block_size=16, max_num_seqs=8) as llm:
        greedy = llm.generate(prompts, _greedy(max_tokens=6, allowed_token_ids=allowed), use_tqdm=False)
        params = [SamplingParams(max_tokens=6, temperature=1.0, seed=i, ignore_eos=True, logprobs=1,
                                 allowed_token_ids=allowed if i % 2 else []) for i in range(4)]
        sampled = llm.generate(prompts[:1] * 4, params, use_tqdm=False)
    for prompt, out in zip(prompts, greedy):
        ids = list(prompt)
        for token in out.token_ids:
            with torch.inference_mode():
                logits = hf(torch.tensor([ids])).logits[0, -1]
            assert token == allowed[int(logits[allowed].argmax())]
            ids.append(token)
    assert all(set(o.token_ids) <= set(allowed) for o in sampled[1::2])
    assert not all(set(o.token_ids) <= set(allowed) for o in sampled[0::2])
