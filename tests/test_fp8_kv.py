"""The fp8 KV cache (`--kv-cache-dtype fp8`) on a CPU, qwen3-tiny in float32 over the torch backend:

- it computes what a full-precision cache holding the same e4m3 values computes (the quantisation is the
  only change), and reports itself and its larger block count at the handshake;
- against a full-precision cache, the logits stay within the bounds stated below (random weights make this
  model far more sensitive than a trained one: even a bfloat16 cache moves 2.4 % of its argmaxes);
- prefix hits and drops with recompute give the tokens of a plain run (fp8 every time);
- the checkpoint's k_scale / v_scale are used by an fp8 cache and by nothing else;
- through the services: a worker with an fp8 cache serves the in-process engine's tokens.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from client import Client
from client.launcher import LocalCluster
from common.limits import Limits
from offline.llm import LLM
from scheduler_svc.sampling import SamplingParams
from tests.paged_driver import PagedDriver, prefill_logits
from worker_svc.kernels import attention, reference
from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.timeout(300)

FP8 = torch.float8_e4m3fn
LENS = [60, 120, 200, 90, 150, 30, 250, 180]
# Bounds against a float32 cache, on these prompts (measured: KL 0.46 nats, argmax agreement 67 %; a
# bfloat16 cache: 0.0018 and 97.6 %). A cache that lost or misplaced values lands near chance.
MAX_MEAN_KL, MIN_ARGMAX_AGREEMENT = 0.7, 0.6


def _runner(model_dir, kv_cache_dtype: str = "fp8", **kw) -> ModelRunner:
    kw.setdefault("num_blocks", 256)
    return ModelRunner(model_dir, RunnerConfig(device="cpu", dtype="float32", block_size=16,
                                               limits=Limits(max_num_seqs=16), kv_cache_dtype=kv_cache_dtype, **kw))


def _prompts(lens=LENS, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 150000) for _ in range(n)] for n in lens]


def _logits(runner: ModelRunner, seqs: list[list[int]]) -> torch.Tensor:
    """Every position's logits of one prefill over the sequences (each token reads the cache it was written to)."""
    return torch.cat(prefill_logits(runner, seqs))


def _e4m3_in_full_precision(runner: ModelRunner) -> None:
    """Makes a float32-cache runner store K and V rounded through e4m3 (what an fp8 cache with scale 1 holds)."""
    def store(qkv, positions, cos_sin, q_w, k_w, eps, k_cache, v_cache, slots, heads, kv_heads, k_scale=1.0,
              v_scale=1.0):
        q = reference.qk_norm_rope_store(qkv, positions, cos_sin, q_w, k_w, eps, k_cache, v_cache, slots, heads,
                                         kv_heads)
        for cache in (k_cache, v_cache):
            rows = cache.view(-1, kv_heads, cache.shape[-1])
            rows[slots] = rows[slots].to(FP8).to(cache.dtype)
        return q

    kernels = dataclasses.replace(runner.kernels, qk_norm_rope_store=store)
    for layer in runner.model.layers:
        layer.self_attn.kernels = kernels


def test_an_fp8_cache_computes_what_a_full_precision_cache_of_the_same_values_does(tiny_model_dir):
    prompts = _prompts()
    fp8 = _runner(tiny_model_dir)
    emulated = _runner(tiny_model_dir, "auto")
    _e4m3_in_full_precision(emulated)
    assert fp8.kv_cache.dtype == FP8 and emulated.kv_cache.dtype == torch.float32
    torch.testing.assert_close(_logits(fp8, prompts), _logits(emulated, prompts), atol=2e-4, rtol=1e-5)


def test_the_handshake_reports_the_cache_and_its_blocks(tiny_model_dir):
    memory = 1 << 22
    fp8, full = (_runner(tiny_model_dir, kv, num_blocks=None, kv_cache_memory=memory) for kv in ("fp8", "auto"))
    a, b = fp8.describe(), full.describe()
    assert (a.kv_cache_dtype, b.kv_cache_dtype, a.dtype) == ("float8_e4m3fn", "float32", "float32")
    assert a.num_blocks == 4 * b.num_blocks  # a byte per value instead of four, in the same memory
    assert fp8.kernels.attention.name == "torch"


def test_fp8_logits_stay_within_the_stated_bounds_of_a_full_precision_cache(tiny_model_dir):
    prompts = _prompts()
    full = _logits(_runner(tiny_model_dir, "auto"), prompts).log_softmax(-1)
    fp8 = _logits(_runner(tiny_model_dir), prompts).log_softmax(-1)
    kl = (full.exp() * (full - fp8)).sum(-1)
    agreement = (full.argmax(-1) == fp8.argmax(-1)).float().mean()
    assert float(kl.mean()) < MAX_MEAN_KL and float(agreement) > MIN_ARGMAX_AGREEMENT, (kl.mean(), agreement)


@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny", "mistral-tiny", "qwen3-moe-tiny", "gemma3-tiny"])
def test_prefix_hits_and_recompute_give_the_tokens_of_a_plain_run(preset, tiny_model_dir, tmp_path):
    """Every architecture over an fp8 cache (Mistral's and Gemma's windows, Qwen3-MoE's experts included)."""
    from worker_svc.checkpoints.writer import make_model

    if preset != "qwen3-tiny":
        tiny_model_dir = make_model(preset, tmp_path / preset)
    prompts = _prompts([40, 17, 33, 9], seed=3)
    plain = PagedDriver(_runner(tiny_model_dir))
    seqs = [plain.add(p, 24) for p in prompts]
    plain.run_all()
    want = [s.generated for s in seqs]

    chunked = PagedDriver(_runner(tiny_model_dir), chunk=7, shuffle_seed=1)
    seqs = [chunked.add(p, 24) for p in prompts]
    for step in range(10):
        chunked.run_step()
        if step in (3, 7):
            chunked.drop(seqs[step % 4])
    chunked.run_all()
    assert [s.generated for s in seqs] == want

    shared = PagedDriver(_runner(tiny_model_dir), shuffle_seed=2)
    first = shared.add(prompts[0], 24)
    shared.run_step()
    again = shared.add(prompts[0], 24, prefix_blocks=first.blocks[:2])  # 32 of its 40 prompt tokens cached
    shared.run_all()
    assert again.generated == first.generated == want[0]


def test_checkpoint_kv_scales_serve_an_fp8_cache_only(tiny_model_dir, tmp_path):
    model = tmp_path / "scaled"
    model.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "model.safetensors":
            (model / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tiny_model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.25, 0.75])  # per head: the largest serves
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    fp8 = _runner(model)
    scales = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in fp8.model.layers]
    assert scales == [(0.5, 0.75), (2.0, 2.0)]
    full = _runner(model, "auto")
    assert [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in full.model.layers] == [(1.0, 1.0)] * 2
    # a scale changes what the cache holds, not what it means: the model still reads it as before
    ref = _logits(_runner(tiny_model_dir), _prompts(LENS[:3])).log_softmax(-1)
    got = _logits(fp8, _prompts(LENS[:3])).log_softmax(-1)
    assert float((ref.exp() * (ref - got)).sum(-1).mean()) < MAX_MEAN_KL
    assert float(fp8.kv_cache[0, 0].float().abs().max()) > float(fp8.kv_cache[0, 1].float().abs().max())


def test_flash_attn_refuses_an_fp8_cache_and_auto_avoids_it():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="cannot read a float8_e4m3fn KV cache"):
        attention.resolve("flash_attn", cpu, torch.float8_e4m3fn)
    assert attention.resolve("auto", cpu, torch.float8_e4m3fn) == "torch"
    assert attention.resolve("triton", cpu, torch.float8_e4m3fn) == "triton"


def test_a_worker_with_an_fp8_cache_serves_the_in_process_engines_tokens(tiny_model_dir, tmp_path):
    prompts = _prompts([12, 30, 5], seed=8)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", block_size=16, num_blocks=128, kv_cache_dtype="fp8",
              max_num_seqs=8)
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    worker = ["--dtype", "float32", "--block-size", "16", "--num-blocks", "128", "--kv-cache-dtype", "fp8",
              "--max-num-seqs", "8"]
    with LocalCluster(tiny_model_dir, worker_args=worker, scheduler_args=["--max-num-seqs", "8"],
                      log_dir=tmp_path) as cluster, Client(cluster.address, timeout=120) as client:
        (status,) = client.model_info()["workers"]
        assert status["kv_cache_dtype"] == "float8_e4m3fn" and status["num_blocks"] == 128
        assert status["projection_dtype"] == "float32"  # FP8 projections are --quantization's (test_fp8_linear.py)
        got = [client.complete(token_ids=p, max_tokens=16, temperature=0.0, ignore_eos=True)[0].token_ids
               for p in prompts]
    assert got == want
