"""Our Qwen3 on the paged runtime against transformers' Qwen3ForCausalLM on the same project-written
checkpoints, fp32 on CPU."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import transformers

from common.limits import Limits
from protos import worker_pb2 as pb
from tests.paged_driver import PagedDriver, prefill_logits, run_with_drops
from worker_svc.checkpoints.writer import make_model
from worker_svc.kernels.uploads import pack_aligned
from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

PROMPT_LENS = [5, 17, 1, 33, 16, 9, 40, 24]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "tied": tiny_model_dir,
        "untied": make_model("qwen3-tiny-untied", root / "untied", seed=1),
        "sharded": make_model("qwen3-tiny", root / "sharded", seed=2, max_shard_size="2MB"),
    }


def _prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 150000) for _ in range(PROMPT_LENS[i % len(PROMPT_LENS)])] for i in range(n)]


def _hf(model_dir) -> transformers.Qwen3ForCausalLM:
    return transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _runner(model_dir, max_num_seqs: int = 16, **kw) -> ModelRunner:
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 16)
    return ModelRunner(model_dir, RunnerConfig(device="cpu", dtype="float32", limits=Limits(max_num_seqs=max_num_seqs),
                                               **kw))


@pytest.mark.parametrize("kind", ["tied", "untied", "sharded"])
def test_logits_match_transformers(checkpoints, kind):
    model_dir = checkpoints[kind]
    runner, hf = _runner(model_dir), _hf(model_dir)
    prompts = _prompts()
    with torch.inference_mode():
        for p, ours in zip(prompts, prefill_logits(runner, prompts)):
            torch.testing.assert_close(ours, hf(torch.tensor([p])).logits[0], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def reference(checkpoints):
    """transformers' greedy generations of 32 tokens for the 8 prompts, on the tied checkpoint."""
    hf = _hf(checkpoints["tied"])
    outs = []
    with torch.inference_mode():
        for p in _prompts():
            out = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                              pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def _generate(driver: PagedDriver, prompts, max_new=32) -> list[list[int]]:
    seqs = [driver.add(p, max_new) for p in prompts]
    driver.run_all()
    return [s.generated for s in seqs]


@pytest.mark.parametrize("chunk", [1 << 30, 7, 5])
def test_greedy_equals_generate_chunked_and_scattered(checkpoints, reference, chunk):
    """Chunk sizes that do not divide the block size; blocks scattered at random; the batch mixes
    prefill chunks of long prompts with decodes of short ones."""
    driver = PagedDriver(_runner(checkpoints["tied"]), chunk=chunk, shuffle_seed=chunk)
    assert _generate(driver, _prompts()) == reference


def test_greedy_with_prefix_reuse(checkpoints, reference):
    """A second request reuses the first one's full prefix blocks and skips their compute."""
    runner = _runner(checkpoints["tied"])
    driver = PagedDriver(runner, shuffle_seed=3)
    prompts = _prompts()
    first = driver.add(prompts[6], 32)  # 40 tokens: two full blocks of 16
    driver.run_step()
    shared = first.blocks[:2]
    extended = prompts[6][:32] + prompts[3]
    second = driver.add(extended, 32, prefix_blocks=shared)
    computed_before = second.computed
    driver.run_all()
    assert computed_before == 32
    hf = _hf(checkpoints["tied"])
    ref = hf.generate(torch.tensor([extended]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                      pad_token_id=0)[0, len(extended):].tolist()
    assert second.generated == ref
    assert first.generated == reference[6]


def test_a_decode_step_runs_a_prompts_last_token_from_the_plan(checkpoints, reference):
    """A step of one token per row where a row runs the last token of its prompt (a one-token chunk)
    beside a decode: the decode step feeds that row from the plan and the other from the device."""
    runner = _runner(checkpoints["tied"])
    fed_from_plan, run = [], runner.decode.run

    def spy(inputs, all_greedy):
        fed_from_plan.append(int((inputs.input_ids >= 0).sum()))
        return run(inputs, all_greedy)

    runner.decode.run = spy
    driver = PagedDriver(runner, chunk=8)
    prompts = _prompts()
    seqs = [driver.add(prompts[i], 32) for i in (0, 5)]  # 5 and 9 tokens: the 9 run as 8, then 1
    driver.run_all()
    assert fed_from_plan[0] == 1 and set(fed_from_plan[1:]) == {0}
    assert [s.generated for s in seqs] == [reference[0], reference[5]]


def test_greedy_after_drop_and_recompute(checkpoints, reference):
    """Sequences whose blocks are dropped mid-generation recompute from prompt plus generated tokens."""
    driver = PagedDriver(_runner(checkpoints["tied"]), chunk=11, shuffle_seed=5)
    seqs = [driver.add(p, 32) for p in _prompts()]
    run_with_drops(driver, seqs, drop_at=(4, 9))
    assert [s.generated for s in seqs] == reference


def test_bad_words_ban_a_words_last_token_where_its_first_ones_end_the_output(checkpoints, reference):
    """A bad word of two tokens taken from a greedy output: its second token is never sampled right after its first,
    so the output leaves the reference there; a row beside it without one is unchanged; and a sequence dropped just
    after the first token recomputes its recent tokens from those it generated, and is banned alike."""
    ref = reference[0]
    word = pb.BadWord(token_ids=ref[4:6])
    params = pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, logprobs=-1, bad_words=[word])
    driver = PagedDriver(_runner(checkpoints["tied"]), chunk=11)
    banned, plain = driver.add(_prompts()[0], 12, params), driver.add(_prompts()[0], 12)
    driver.run_all()
    assert plain.generated == ref[:12]
    assert banned.generated[:5] == ref[:5] and banned.generated[5] != ref[5]
    driver = PagedDriver(_runner(checkpoints["tied"]), chunk=11)
    dropped = driver.add(_prompts()[0], 12, params)
    while len(dropped.generated) < 5:
        driver.run_step()
    driver.drop(dropped)
    driver.run_all()
    assert dropped.generated == banned.generated


def test_untied_generation_matches(checkpoints):
    model_dir = checkpoints["untied"]
    hf = _hf(model_dir)
    prompts = _prompts(3, seed=9)
    driver = PagedDriver(_runner(model_dir), chunk=6)
    ours = _generate(driver, prompts, max_new=16)
    for p, got in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          pad_token_id=0)[0, len(p):].tolist()
        assert got == ref


def test_uploads_start_on_16_byte_boundaries():
    """Triton specialises kernels on pointer alignment: every uploaded view must start aligned, whatever
    the sizes and dtypes before it, or serving would compile new kernel variants."""
    rng = np.random.default_rng(0)
    dtypes = [np.int64, np.int32, np.float32]
    arrays = [rng.integers(0, 100, size).astype(dtypes[i % 3]) for i, size in enumerate((0, 1, 3, 5, 8, 2, 0, 7))]
    arrays.append(rng.random((3, 3)).astype(np.float32))  # a 2-D array travels flattened
    flat, starts = pack_aligned(arrays)
    assert flat.dtype == np.uint8 and all(start % 16 == 0 for start in starts)
    for a, start in zip(arrays, starts):
        assert np.array_equal(flat[start:start + a.nbytes].view(a.dtype), a.reshape(-1))


class _DeviceTensor:
    """Stands for a GPU tensor on a CPU machine: what a step's results read (is_cuda, an asynchronous copy to the
    host) and nothing else."""
    is_cuda = True

    def __init__(self, host: torch.Tensor):
        self.host = host

    def to(self, device: str, non_blocking: bool = False, copy: bool = False) -> torch.Tensor:
        return self.host.clone()


@pytest.mark.parametrize("part", ["pooled", "prompt"])
def test_a_step_that_samples_nothing_waits_for_its_results_copy(monkeypatch, part):
    """A step of embeddings or of a prompt's middle chunk (pooled rows or prompt logprobs, no sampled token): its
    result is read only after the event recorded behind the copies of its device tensors to the host."""
    from worker_svc.runtime.model_runner import PendingStep, PooledRows, PromptScores

    events = []

    class Event:
        def __init__(self):
            self.calls = []
            events.append(self)

        def record(self):
            self.calls.append("record")

        def synchronize(self):
            self.calls.append("synchronize")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    values = _DeviceTensor(torch.arange(6, dtype=torch.float32))
    parts = {"pooled": PooledRows([7], [0], [3], values),
             "prompt": PromptScores([7], [0], [6], [0], values, None, None)}
    pending = PendingStep(3, [7], None, [], 0.0, **{part: parts[part]})
    assert [e.calls for e in events] == [["record"]]
    res = pending.result()
    assert events[0].calls == ["record", "synchronize"]
    assert list(res.pooled if part == "pooled" else res.prompt_logprobs) == list(range(6))


def test_a_closed_runner_holds_neither_its_model_nor_its_kv_cache(tiny_model_dir):
    """After close nothing keeps the model or the KV cache alive (its LoRA slots, graphs, batch), so another runner
    in the same process can take the GPU's memory (a bench's in-process run, then its services)."""
    import gc
    import weakref

    runner = ModelRunner(tiny_model_dir, RunnerConfig(device="cpu", dtype="float32", num_blocks=16, block_size=16,
                                                      max_loras=1))
    model, cache = weakref.ref(runner.model), weakref.ref(runner.kv_cache)
    runner.close()
    gc.collect()
    assert model() is None and cache() is None


def test_worker_cli_offers_every_attention_backend_kv_cache_dtype_and_quantization():
    """The CLI lists them without importing torch; the lists are kernels/attention.py's, model/config.py's and
    runtime/model_runner.py's."""
    from worker_svc import cli
    from worker_svc.kernels import attention
    from worker_svc.model.config import KV_CACHE_DTYPES
    from worker_svc.runtime.model_runner import QUANTIZATIONS

    assert cli.ATTENTION_NAMES == attention.NAMES
    assert cli.KV_CACHE_DTYPE_NAMES == tuple(KV_CACHE_DTYPES)
    assert cli.QUANTIZATION_NAMES == QUANTIZATIONS


def test_worker_cli_takes_vllms_spellings():
    """--enforce-eager, --kv-offloading-size and -tp: vLLM's names of --no-cuda-graphs, --kv-offload-gib and
    --tensor-parallel-size."""
    from worker_svc import cli

    args = cli.build_parser().parse_args(["serve", "--model", "m", "--enforce-eager", "--kv-offloading-size", "4",
                                          "-tp", "2"])
    assert args.no_cuda_graphs and args.kv_offload_gib == 4.0 and args.tensor_parallel_size == 2
    args = cli.build_parser().parse_args(["serve", "--model", "m"])
    assert not args.no_cuda_graphs and args.kv_offload_gib == 0.0


def test_kernel_builds_are_counted_by_phase_through_the_cute_compilers_forms():
    """runtime/kernel_builds.py and kernels/build_hooks.py: what is built before serving_from_now() is warm-up, after it serving; the wrapper
    put over cute.compile counts plain calls and `compile[options](...)` calls and passes the rest through."""
    from worker_svc.kernels.build_hooks import CountedCompile
    from worker_svc.runtime.kernel_builds import KernelBuilds

    class FakeCompile:
        compile_to = "passed through"

        def __call__(self, fn, *args):
            return ("compiled", fn.__name__, args)

        def __getitem__(self, options):
            return self

    builds = KernelBuilds()
    counted = CountedCompile(FakeCompile(), builds.count)
    assert counted(test_uploads_start_on_16_byte_boundaries, 1) == ("compiled",
                                                                    "test_uploads_start_on_16_byte_boundaries", (1,))
    builds.serving_from_now()
    counted["--opt"](test_uploads_start_on_16_byte_boundaries)
    builds.count("triton kernel")
    assert (builds.warm_up, builds.serving) == (1, 2) and counted.compile_to == "passed through"
    builds.serving_from_now(False)
    builds.count("another warm-up")
    assert (builds.warm_up, builds.serving) == (2, 2)


def test_prompt_logprobs_are_scored_chunk_by_chunk(checkpoints):
    """The worker scores each prompt chunk's positions (prompt_logprobs), a chunk of 7 at a time beside other
    sequences, and again after a drop and recompute; every value equals transformers' log-softmax."""
    from protos import worker_pb2 as pb

    model_dir = checkpoints["tied"]
    runner, hf = _runner(model_dir), _hf(model_dir)
    results: list[pb.StepResult] = []
    execute = runner.execute

    def spy(plan):
        pending = execute(plan)
        result = pending.result
        pending.result = lambda: results.append(result()) or results[-1]
        return pending

    runner.execute = spy
    driver = PagedDriver(runner, chunk=7, shuffle_seed=4)
    asked = pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, logprobs=-1, prompt_logprobs=2)
    prompts = _prompts(3, seed=11)
    scored = driver.add(prompts[0] + prompts[1], 4, params=asked)
    driver.add(prompts[2], 4)
    driver.run_step()
    driver.drop(scored)
    driver.run_all()
    prompt = scored.tokens[:scored.prompt_len]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    seen: dict[int, list[float]] = {}
    for res in results:
        at = 0
        for sid, start, count in zip(res.prompt_seq_ids, res.prompt_starts, res.prompt_counts):
            assert sid == scored.seq_id
            for k in range(count):
                seen.setdefault(start + k, []).append(res.prompt_logprobs[at + k])
                top = res.prompt_top_token_ids[2 * (at + k):2 * (at + k) + 2]
                assert list(top) == ref[start + k].topk(2).indices.tolist()
            at += count
    assert sorted(seen) == list(range(len(prompt) - 1))
    assert any(len(v) == 2 for v in seen.values())  # the first chunk, scored again after the drop
    for p, values in seen.items():
        assert all(abs(v - ref[p, prompt[p + 1]].item()) < 1e-4 for v in values)
