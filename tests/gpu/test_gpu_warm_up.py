"""A fresh worker on the GPU builds every kernel it needs before it reports SERVING: after readiness, traffic
of every step shape within its limits (prefills from 1 token to the batch budget, chunks over cached prefixes,
decode batches from 1 to max_num_seqs, mixed steps, sampling and greedy, and rows that need the general sampler:
a grammar, logprobs, penalties, a bias, filters, bad words) builds nothing
(`splitserve:worker_kernel_builds_total{phase="serving"}` stays 0). One worker per attention choice and KV
cache dtype, with FP8 projections and packed 4-bit ones, and a MoE's experts in 16 bits and FP8. Run: pytest tests/gpu (skipped without
a CUDA GPU)."""
from __future__ import annotations

import concurrent.futures
import random

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(900)]

from client import Client  # noqa: E402
from client.launcher import LocalCluster, free_port  # noqa: E402
from tests.sim_cluster import sample, scrape  # noqa: E402

LIMITS = ["--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--max-model-len", "1024"]  # the model's


def _traffic(address: str) -> None:
    rng = random.Random(0)
    lens = [1, 2, 15, 16, 17, 100, 255, 256, 257, 600, 1000, 1015]
    shared = [rng.randrange(0, 10000) for _ in range(700)]
    requests = [([rng.randrange(0, 10000) for _ in range(n)], 8) for n in lens]
    requests += [(shared + [rng.randrange(0, 10000) for _ in range(n)], 4) for n in (1, 30, 300)]  # prefix hits
    with Client(address, timeout=300) as client, concurrent.futures.ThreadPoolExecutor(64) as pool:
        list(pool.map(lambda r: client.complete(token_ids=r[0], max_tokens=r[1], ignore_eos=True, temperature=0.0),
                      requests))
        for batch in (1, 3, 8, 31, 64):  # decode batches of every size class
            list(pool.map(lambda k: client.complete(token_ids=[k + 1, 2, 3], max_tokens=40, ignore_eos=True,
                                                    temperature=0.7 if k % 2 else 0.0, seed=k), range(batch)))
        # what sends rows through the general sampler (float32 logits): alone, and beside free rows
        special = [dict(structured={"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}),
                   dict(logprobs=2), dict(prompt_logprobs=1), dict(repetition_penalty=1.2), dict(logit_bias={5: 3.0}),
                   dict(top_p=0.9), dict(top_k=20), dict(min_p=0.05), dict(allowed_token_ids=[5, 11, 220]),
                   dict(bad_words=["hello", "the world"])]
        for extra in special:
            client.complete(token_ids=[7, 8, 9], max_tokens=8, temperature=0.7, seed=1, **extra)
            list(pool.map(lambda k: client.complete(token_ids=[k + 1, 5, 6], max_tokens=24, temperature=0.7, seed=k,
                                                    **(extra if k % 4 == 0 else {})), range(16)))


@pytest.mark.parametrize("preset,worker_flags", [
    ("qwen3-small", []), ("qwen3-small", ["--attention", "triton"]), ("qwen3-small", ["--kv-cache-dtype", "fp8"]),
    ("qwen3-small", ["--quantization", "fp8"]), ("qwen3-30b-a3b", []), ("qwen3-30b-a3b", ["--quantization", "fp8"]),
    ("qwen3-small-gptq", ["--quantization", "packed"])],
    ids=["auto", "triton", "fp8", "fp8_projections", "moe", "moe_fp8_experts", "packed_int4"])
def test_a_fresh_worker_builds_no_kernel_after_it_reports_serving(tmp_path, preset, worker_flags):
    """(qwen3-30b-a3b: its first layer, whose experts' shape has measured tile tables, 16-bit and FP8;
    qwen3-small-gptq: qwen3-small as a 4-bit GPTQ checkpoint, served packed.)"""
    from tests.quantized_checkpoints import gptq_folder
    from worker_svc.checkpoints.writer import make_model

    layers = 1 if preset == "qwen3-30b-a3b" else None
    model = make_model(preset.removesuffix("-gptq"), tmp_path / "m", seed=0, dtype="bfloat16", num_layers=layers)
    if preset.endswith("-gptq"):
        model = gptq_folder(model, tmp_path / "gptq")
    port = free_port()
    worker = ["--metrics-port", str(port), *LIMITS, *worker_flags]
    with LocalCluster(model, device="cuda", worker_args=worker, scheduler_args=LIMITS,
                      log_dir=tmp_path / "logs") as cluster:
        before = scrape(port)
        assert sample(before, "splitserve:worker_kernel_builds_total", phase="warm_up") > 0
        _traffic(cluster.address)
        after = scrape(port)
    built = [line for log in (tmp_path / "logs").glob("worker*.log") for line in log.read_text().splitlines()
             if "built while serving" in line]
    assert sample(after, "splitserve:worker_kernel_builds_total", phase="serving") == 0, built[:20]


def test_a_fresh_encoder_worker_builds_no_kernel_after_it_reports_serving(tmp_path):
    """An encoder (BERT's layout; attention both ways, each input whole in one step): embeddings of every length up to
    the model's, one at a time and many per step, build nothing after readiness."""
    from worker_svc.checkpoints.writer import make_model

    model = make_model("bert-tiny", tmp_path / "m", seed=0, dtype="bfloat16")
    port = free_port()
    limits = ["--max-num-seqs", "64", "--max-num-batched-tokens", "128"]
    with LocalCluster(model, device="cuda", worker_args=["--metrics-port", str(port), *limits],
                      scheduler_args=limits, log_dir=tmp_path / "logs") as cluster:
        assert sample(scrape(port), "splitserve:worker_kernel_builds_total", phase="warm_up") > 0
        rng = random.Random(0)
        inputs = [[rng.randrange(2, 5000) for _ in range(n)] for n in (1, 2, 7, 16, 17, 63, 64, 100, 127, 128)]
        with Client(cluster.address, timeout=300) as client, concurrent.futures.ThreadPoolExecutor(16) as pool:
            for item in inputs:
                client.embed([item])
            client.embed(inputs)
            list(pool.map(lambda k: client.embed([inputs[k % len(inputs)]] * (k % 5 + 1)), range(48)))
        after = scrape(port)
    built = [line for log in (tmp_path / "logs").glob("worker*.log") for line in log.read_text().splitlines()
             if "built while serving" in line]
    assert sample(after, "splitserve:worker_kernel_builds_total", phase="serving") == 0, built[:20]
