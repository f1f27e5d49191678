"""The benchmark scripts end to end on a CPU: each runs with --simulate (real scheduler and simulated
worker processes on loopback) on a tiny workload and writes its results. No speed is asserted."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import common

SIM = ["--simulate", "--block-size", "16", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
       "--max-model-len", "512"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """config.json, generation_config.json and the tokenizer of qwen3-tiny: all --simulate reads."""
    return common.write_config_only("qwen3-tiny", tmp_path_factory.mktemp("bench") / "qwen3-tiny")


def _load(out: Path, name: str, module: str) -> dict:
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == name
    for key in ("command", "commit", "gpu", "date", "params", "results"):
        assert key in doc, key
    assert doc["command"].split()[1:3] == ["-m", module]
    assert out.with_suffix(".md").read_text().startswith(f"# {name}")
    return doc


def _positive(row: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] > 0, (key, row[key])


def test_online(model: Path, tmp_path: Path) -> None:
    from bench import online

    out = tmp_path / "online.json"
    # a pool of 6 blocks of 16 holds two requests at once: the urgent ones (a share of half: 2, 3 and 5) find it full
    online.main(["--model", str(model), *SIM, "--rates", "50,inf", "--num-requests", "6", "--max-input", "32",
                 "--max-output", "12", "--warmup", "2", "--num-blocks", "6", "--urgent-share", "0.5",
                 "--out", str(out)])
    doc = _load(out, "online", "bench.online")
    rows = doc["results"]
    assert [r["rate_req_s"] for r in rows] == [50.0, "inf"]
    for r in rows:
        assert r["requests"] == 6 and r["errors"] == 0
        _positive(r, "seconds", "achieved_req_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
                  "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms")
        assert r["ttft_p99_ms"] >= r["ttft_p50_ms"] and r["itl_p99_ms"] >= r["itl_p50_ms"]
        assert 0 <= r["slo_met_pct"] <= 100 and 0 <= r["goodput_req_s"] <= r["achieved_req_s"] + 1e-9
        _positive(r, "ttft_p50_urgent_ms", "ttft_p99_urgent_ms", "ttft_p50_others_ms", "ttft_p99_others_ms")


def test_embed(model: Path, tmp_path: Path) -> None:
    from bench.__main__ import main

    out = tmp_path / "embed.json"
    main(["embed", "--model", str(model), *SIM, "--inputs", "12", "--input-len", "40", "--batch", "5",
          "--concurrency", "2", "--out", str(out)])
    rows = _load(out, "embed", "bench.embed")["results"]
    assert [r["path"] for r in rows] == ["in-process (simulated worker)", "grpc services (simulated worker)"]
    for r in rows:
        assert r["inputs"] == 12 and r["tokens"] == 480
        _positive(r, "seconds", "tokens_per_s", "floor_tokens_per_s")
        assert r["pct_of_floor"] >= 0  # the simulated worker keeps no floor


def test_rerank(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--rerank on a real model on the CPU (the simulated worker serves no classifier): Classify calls."""
    from bench.__main__ import main

    out = tmp_path / "rerank.json"
    main(["embed", "--model", str(tiny_model_dir), "--device", "cpu", "--block-size", "16", "--max-num-seqs", "8",
          "--max-num-batched-tokens", "128", "--inputs", "6", "--input-len", "20", "--batch", "3", "--concurrency", "2",
          "--rerank", "--out", str(out)])
    rows = _load(out, "rerank", "bench.embed")["results"]
    assert [r["path"] for r in rows] == ["in-process", "grpc services"]
    for r in rows:
        assert r["inputs"] == 6 and r["tokens"] == 120
        _positive(r, "seconds", "tokens_per_s", "floor_tokens_per_s")  # a CPU's share of an H200's floor rounds to 0


def test_latency_through_dispatch(model: Path, tmp_path: Path) -> None:
    from bench.__main__ import main

    out = tmp_path / "latency.json"
    main(["latency", "--model", str(model), *SIM, "--repeats", "2", "--prompt-len", "16", "--output-len", "12",
          "--warmup", "1", "--out", str(out)])
    doc = _load(out, "latency", "bench.latency")
    rows = doc["results"]
    assert [r["path"] for r in rows] == ["in-process (simulated worker)", "grpc services (simulated worker)"]
    for r in rows:
        assert r["requests"] == 2 and r["errors"] == 0 and r["output_tokens"] == 12
        _positive(r, "ttft_p50_ms", "ms_per_token_p50", "ms_per_token_mean", "ms_per_token_p99", "tokens_per_s")
        assert r["ms_per_token_p99"] >= r["ms_per_token_p50"]


def test_prefix(model: Path, tmp_path: Path) -> None:
    from bench import prefix

    out = tmp_path / "prefix.json"
    # one request at a time: every request after its prefix's first hits exactly the prefix's 3 full blocks
    prefix.main(["--model", str(model), *SIM, "--num-prefixes", "2", "--per-prefix", "3", "--prefix-len", "48",
                 "--suffix-len", "8", "--output-len", "4", "--max-concurrency", "1", "--warmup", "1",
                 "--out", str(out)])
    doc = _load(out, "prefix", "bench.prefix")
    on, off = doc["results"]
    assert (on["prefix_caching"], off["prefix_caching"]) == ("on", "off")
    for r in (on, off):
        assert r["requests"] == 6 and r["errors"] == 0 and r["prompt_tokens"] == 6 * 56
        _positive(r, "seconds", "output_tokens_per_s", "total_tokens_per_s", "ttft_p50_ms")
    assert on["cached_prompt_tokens"] == 4 * 48
    assert on["hit_rate"] == on["ideal_hit_rate"] == round(4 * 48 / (6 * 56), 4)
    assert off["cached_prompt_tokens"] == 0 and off["hit_rate"] == 0.0


def test_all_offline_simulated(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m bench all` hands the shared flags on (here to offline alone: both paths)."""
    from bench.__main__ import main

    main(["all", "--model", str(model), *SIM, "--results-dir", str(tmp_path), "--only", "offline",
          "--offline-args", "--num-seqs 3 --max-input 100 --max-output 100"])
    doc = _load(tmp_path / "offline.json", "offline", "bench.offline")
    in_process, services, batch = doc["results"]
    assert in_process["path"] == "in-process (simulated worker)"
    assert services["path"] == "grpc services (simulated worker)"
    assert batch["path"] == "grpc services, stream_interval 0 (simulated worker)"
    assert in_process["output_tokens"] == services["output_tokens"] == batch["output_tokens"] > 0
    assert "| grpc services (simulated worker) |" in capsys.readouterr().out


def test_offline_short_workload_runs_twice_beside_its_floor(model: Path, tmp_path: Path) -> None:
    from bench import offline

    out = tmp_path / "offline.json"
    offline.main(["--model", str(model), *SIM, "--workload", "short", "--num-seqs", "12", "--runs", "2",
                  "--stream-intervals", "1", "--out", str(out)])
    rows = _load(out, "offline", "bench.offline")["results"]
    assert [(r["path"], r["run"]) for r in rows] == [(f"{p} (simulated worker)", run) for p in ("in-process",
                                                     "grpc services") for run in (1, 2)]
    for r in rows:
        _positive(r, "seconds", "tokens_per_s", "floor_tokens_per_s", "pct_of_floor")
        assert r["output_tokens"] == rows[0]["output_tokens"] and 12 * 100 <= r["output_tokens"] <= 12 * 300
        assert abs(r["pct_of_floor"] - 100 * r["tokens_per_s"] / r["floor_tokens_per_s"]) < 0.1


def test_floor_of_the_offline_workload_is_the_figure_the_project_quotes() -> None:
    """bench/floor.py on Qwen3-0.6B's shapes: ~34k output tokens/s for nano-vLLM's workload at bf16; an fp8 KV
    cache moves half the KV bytes; more running sequences never lower it."""
    from bench.floor import ModelShape, floor_tokens_per_s
    from bench.workload import offline, short
    from worker_svc.checkpoints.presets import get_preset

    shape = ModelShape.from_config(get_preset("qwen3-0.6b"))
    assert 590e6 < shape.params < 760e6  # 0.6B parameters, the tied embedding once
    work = [(len(r.prompt_ids), r.max_tokens) for r in offline()]
    bf16, fp8 = floor_tokens_per_s(shape, work), floor_tokens_per_s(shape, work, kv_bytes=1)
    assert 32_000 < bf16 < 36_000 and 1.5 * bf16 < fp8 < 2 * bf16
    many = [(len(r.prompt_ids), r.max_tokens) for r in short(512)]
    assert floor_tokens_per_s(shape, many, max_num_seqs=64) < floor_tokens_per_s(shape, many, max_num_seqs=512)
    bert = ModelShape.from_config(get_preset("bge-base-en-v1.5"))  # an encoder: MLPs of two projections, no LM head,
    assert bert.params == 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 151936 * 768  # attention both ways
    assert bert.prompt_pairs(10) == 12 * 100


def test_floor_of_a_windowed_model_reads_only_inside_its_windows() -> None:
    """Mistral-7B's 4,096-token window: a query after 10,000 tokens reads 4,096 keys a layer, a prompt of 10,000
    multiplies no more pairs than its windows hold; Gemma 3 1B's global layers (every sixth) read everything."""
    from bench.floor import ModelShape
    from worker_svc.checkpoints.presets import get_preset

    mistral, gemma = (ModelShape.from_config(get_preset(p)) for p in ("mistral-7b", "gemma-3-1b"))
    assert mistral.keys_read(10_000) == 32 * 4096 and mistral.keys_read(100) == 32 * 100
    assert mistral.prompt_pairs(10_000) == 32 * (4096 * 4097 // 2 + (10_000 - 4096) * 4096)
    assert mistral.prompt_pairs(4096) == 32 * 4096 * 4097 // 2
    local = len(gemma.windows)
    assert 0 < local < gemma.layers and gemma.keys_read(10_000) == (gemma.layers - local) * 10_000 + local * 512


def test_floor_of_a_moe_reads_the_experts_its_tokens_route_to() -> None:
    """Qwen3-30B-A3B: 3.3B parameters active per token (as published), a one-token step reads its 8 experts of
    each layer, a large step all 128."""
    from bench.floor import ModelShape
    from worker_svc.checkpoints.presets import get_preset

    shape = ModelShape.from_config(get_preset("qwen3-30b-a3b"))
    dense = shape.params
    assert abs(shape.active_params() / 1e9 - 3.3) < 0.1
    assert shape.weights_read(1) == dense + 8 * shape.expert_params
    assert abs(shape.weights_read(100_000) - (dense + 128 * shape.expert_params)) < 1
    assert round((dense + 128 * shape.expert_params) / 1e9, 2) == 30.53  # every weight, as written


def test_decode_step_floor_weighs_a_moe_step_against_its_routed_experts() -> None:
    """A decode step's floor is its bytes (weights, routed experts, KV) at the bandwidth, averaged over the decode
    steps; the routed experts are part of it (none for a dense model), and one sequence reads its context, the
    weights and its 8 experts a layer."""
    from bench.floor import H200_BYTES_PER_S, ModelShape, decode_step_floor
    from bench.workload import offline
    from worker_svc.checkpoints.presets import get_preset

    work = [(len(r.prompt_ids), r.max_tokens) for r in offline()]
    moe = ModelShape.from_config(get_preset("qwen3-30b-a3b"))
    step, experts = decode_step_floor(moe, work)
    assert 0 < experts < step and 1.1 < step / experts < 1.5
    assert decode_step_floor(ModelShape.from_config(get_preset("qwen3-0.6b")), work)[1] == 0
    one, one_experts = decode_step_floor(moe, [(100, 3)])  # two decode steps, at contexts 101 and 102
    assert one_experts * H200_BYTES_PER_S == 8 * moe.expert_params * 2
    kv = moe.kv_bytes_per_token(2) * (101 + 102 + 2) / 2  # the context read plus the token written
    assert abs(one * H200_BYTES_PER_S - (moe.params * 2 + one_experts * H200_BYTES_PER_S + kv)) < 1


@pytest.mark.parametrize("gateway", [False, True], ids=["grpc", "gateway"])
def test_scale(tmp_path: Path, gateway: bool) -> None:
    from bench import scale

    out = tmp_path / "scale.json"
    scale.main(["--preset", "qwen3-tiny", "--workers", "1,2", "--requests-per-worker", "6", "--max-input", "24",
                "--max-output", "10", "--client-procs", "2", "--burst", "40", "--out", str(out),
                *(["--gateway", "--gateway-args", "--workers 2"] if gateway else [])])
    rows = _load(out, "scale", "bench.scale")["results"]
    assert [(r["workers"], r["stream_interval"], r["pass"]) for r in rows] == [
        (n, i, p) for n in (1, 2) for i, p in ((1, "offline"), (0, "offline"), (1, "burst"))]
    for r in rows:
        assert r["error_statuses"] == {} and r["short_streams"] == 0 and r["path"] == ("gateway" if gateway else "grpc")
        assert r["output_tokens"] > 0 and r["streams"] == (40 if r["pass"] == "burst" else 6 * r["workers"])
        _positive(r, "seconds", "tokens_per_s")
        roles = {"supervisor", "frontend", "engine", "worker", "client", *(["gateway"] * gateway)}
        assert set(r["cpu_s_per_1k_tokens"]) == set(r["busiest_core_share"]) == roles, r
        assert all(v >= 0 for v in [*r["cpu_s_per_1k_tokens"].values(), *r["busiest_core_share"].values()])
        if r["pass"] == "offline":
            _positive(r, "ratio", "n_x_one_worker")
    assert [r["ratio"] for r in rows if r["workers"] == 1 and r["pass"] == "offline"] == [1.0, 1.0]


def test_fp8_accuracy(tmp_path: Path) -> None:
    """The fp8 cache scored against the model's-dtype cache on a real (tiny) model: KL and greedy agreement."""
    from bench.__main__ import main

    out = tmp_path / "fp8_accuracy.json"
    main(["fp8-accuracy", "--preset", "qwen3-tiny", "--device", "cpu", "--dtype", "float32", "--num-seqs", "2",
                       "--prompt-len", "16", "--output-len", "12", "--out", str(out)])
    # the control row is the GPU's only; qwen3-tiny's projections are no whole 128 x 128 blocks: none is FP8
    row, projections = _load(out, "fp8_accuracy", "bench.fp8_accuracy")["results"]
    assert row["against"] == "fp8 cache" and row["tokens"] == 2 * 12
    assert projections["against"] == "fp8 projections, float32 cache" and projections["mean_kl"] == 0
    assert 0 < row["p50_kl"] <= row["max_kl"] and 0 < row["mean_kl"] <= row["max_kl"]
    assert 0 < row["greedy_agreement"] <= 1


def test_offline_with_constrained_requests_counts_what_they_wrote(model: Path, tmp_path: Path) -> None:
    """--structured: a share of the requests under a JSON schema (they may end early, so tokens are counted), and
    the services pass again unconstrained with each request as long as it ran."""
    from bench.__main__ import main

    out = tmp_path / "offline.json"
    main(["offline", "--model", str(model), *SIM, "--num-seqs", "4", "--max-input", "100", "--max-output", "100",
          "--structured", "0.5", "--stream-intervals", "0", "--out", str(out)])
    doc = _load(out, "offline", "bench.offline")
    assert [r["path"] for r in doc["results"]] == [
        "in-process, 50% constrained (simulated worker)",
        "grpc services, stream_interval 0, 50% constrained (simulated worker)",
        "grpc services, stream_interval 0, free at the constrained lengths (simulated worker)"]
    assert all(0 < r["output_tokens"] <= 4 * 100 for r in doc["results"])
    assert doc["results"][1]["output_tokens"] == doc["results"][2]["output_tokens"]


@pytest.mark.parametrize("worker,pace,rates", [(["--device", "cpu"], ["--think-time", "0.01"], [0]),
                                               (["--simulate"], ["--request-rate", "100,200"], [100, 200])],
                         ids=["cpu-worker", "simulated-worker-paced"])
def test_multiturn_with_the_host_tier_off_and_on(tmp_path: Path, worker: list[str], pace: list[str],
                                                 rates: list[float]) -> None:
    """Conversations whose histories outgrow the GPU pool, on a real (tiny) CPU worker (users reading between
    turns) or a simulated one (which times the copies it does not make; turns sent at two rates, a round each on
    the same clusters): the run with the host tier swaps blocks out and back in in every round (its counters show
    both), the run without it none."""
    from bench.__main__ import main

    out = tmp_path / "multiturn.json"
    main(["multiturn", "--preset", "qwen3-tiny", *worker, "--block-size", "16", "--conversations", "8",
          "--turns", "3", "--user-tokens", "40", "--output-tokens", "8", *pace, "--out", str(out)])
    rows = _load(out, "multiturn", "bench.multiturn")["results"]
    assert [(r["run"], r["request_rate"]) for r in rows] == [(run, rate) for run in ("tier off", "tier on")
                                                               for rate in rates]
    for off, on in zip(rows[:len(rates)], rows[len(rates):]):
        assert off["errors"] == on["errors"] == 0 and off["turns"] == on["turns"] == 8 * 3
        assert off["swapped_out_blocks"] == off["swapped_in_blocks"] == 0
        assert off["host_gib"] == off["host_blocks"] == 0
        assert on["host_blocks"] > 0  # a tiny model's blocks come back faster than they prefill: the tier is kept
        assert on["swapped_out_blocks"] > 0 and on["swapped_in_blocks"] > 0 and on["swap_gb_s"] > 0
        assert on["cached_prompt_share"] > 0  # a swap-in is a prompt served from the host tier
    assert out.with_suffix(".md").read_text().count("ratios") == len(rates)


def test_multiturn_pacer_sends_no_turn_before_its_seeded_time() -> None:
    """--request-rate's send times: the i-th slot comes no earlier than the sum of the first i exponential gaps
    its seed draws (the same seed, the same schedule: the tier-off and tier-on runs get the same one)."""
    import asyncio
    import random
    import time

    from bench.multiturn import Pacer

    pacer, sent = Pacer(2000.0, seed=5), []
    start = pacer.next

    async def send_all() -> None:
        for _ in range(50):
            await pacer.slot()
            sent.append(time.perf_counter())

    asyncio.run(send_all())
    rng = random.Random(5)
    due = [start]
    for _ in range(50):
        due.append(due[-1] + rng.expovariate(2000.0))
    assert all(t >= d - 1e-6 for t, d in zip(sent, due))
    assert pacer.next >= due[-1] - 1e-9


def test_grpc_stream_floor_counts_every_message_on_both_loops(tmp_path: Path) -> None:
    """bench grpc-stream: every message written is read, and both sides' CPU per message is measured."""
    from bench.__main__ import main

    out = tmp_path / "grpc_stream.json"
    main(["grpc-stream", "--streams", "8", "--messages", "250", "--repeats", "1", "--out", str(out)])
    rows = _load(out, "grpc_stream", "bench.grpc_stream")["results"]
    assert [r["loop"] for r in rows] == ["asyncio", "uvloop"]
    assert all(r["messages"] == 2000 and r["server_cpu_us_per_message"] > 0 for r in rows)


def test_grpc_accept_times_every_new_call_under_a_streaming_load(tmp_path: Path) -> None:
    """bench grpc-accept: every probe call is timed from its send to its handler, while the load is read."""
    from bench.__main__ import main

    out = tmp_path / "grpc_accept.json"
    main(["grpc-accept", "--streams", "4", "--new-calls", "6", "--tick", "0.02", "--out", str(out)])
    (row,) = _load(out, "grpc_accept", "bench.grpc_accept")["results"]
    assert row["streams"] == 4 and row["new_calls"] == 6 and row["load_messages_per_s"] > 0
    assert 0 <= row["wait_ms_p50"] <= row["wait_ms_p90"] <= row["wait_ms_max"]


def test_runner_step_decode_and_prefill_on_a_cpu(tmp_path: Path) -> None:
    """The ModelRunner alone, fed plans the way the GPU runs feed it: decode batches (without LoRA adapters, then
    under two), then prefill steps whose sequences end as the next ones start; then LoRA adapters read and placed."""
    from bench.__main__ import main

    for extra in (["--loras", "0,2"], ["--prefill", "64"], ["--loras", "2", "--place"]):
        out = tmp_path / f"runner_step{len(extra)}{extra[0]}.json"
        main(["runner-step", "--preset", "qwen3-tiny", "--device", "cpu", "--block-sizes", "16", "--batches", "2",
              "--context", "24", "--steps", "2", "--graphs-only", *extra, "--out", str(out)])
        rows = _load(out, "runner_step", "bench.runner_step")["results"]
        if "--place" in extra:  # reading two adapters into host memory, moving them into a slot in turn
            (row,) = rows
            assert row["adapters"] == 2
            _positive(row, "adapter_mb", "read_ms", "place_ms")
            continue
        assert [row.get("loras") for row in rows] == ([0, 2] if extra[0] == "--loras" else [None])
        for row in rows:
            _positive(row, "step_ms", "tokens_per_s")


def test_lora_loads_times_the_gaps_with_and_without_loads_on_a_cpu(tmp_path: Path) -> None:
    from bench.__main__ import main

    out = tmp_path / "lora_loads.json"
    main(["lora-loads", "--preset", "qwen3-tiny", "--device", "cpu", "--seqs", "4", "--tokens", "12",
          "--prompt-len", "8", "--loads", "2", "--every", "3", "--out", str(out)])
    rows = _load(out, "lora_loads", "bench.lora_loads")["results"]
    assert [(row["run"], row["gaps"]) for row in rows] == [("no loads", 11), ("2 loads", 11)]
    for row in rows:
        _positive(row, "median_ms", "p99_ms", "max_ms")


def test_weight_updates_times_each_update_beside_the_start_up_on_a_cpu(tmp_path: Path) -> None:
    from bench.__main__ import main

    out = tmp_path / "weight_updates.json"
    main(["weight-updates", "--preset", "qwen3-tiny", "--device", "cpu", "--updates", "2", "--out", str(out)])
    rows = _load(out, "weight_updates", "bench.weight_updates")["results"]
    assert [row["run"] for row in rows] == ["start-up from a", "update 1 (to b)", "update 2 (to a)"]
    for row in rows[1:]:
        _positive(row, "seconds", "gb_per_s")


def test_kernel_sass_compiles_the_decode_kernel_for_hopper_without_a_gpu(tmp_path: Path) -> None:
    """Triton's own ptxas compiles the kernel for sm_90 here; the interpreter is off in that process (under it
    nothing is compiled)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "kernel_sass.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, "-m", "bench", "kernel-sass", "--configs", "fp8:64:256:tma,fp8:64:256:tma:f16",
                    "--out", str(out)], check=True, env=env, capture_output=True, timeout=300)
    rows = _load(out, "kernel_sass", "bench.kernel_sass")["results"]
    assert [r["config"] for r in rows] == ["fp8:64:256:tma", "fp8:64:256:tma:f16"]
    for row in rows:
        _positive(row, "registers", "shared_bytes", "loop_instructions")


def test_fused_layer_chain_equals_the_chain_as_run() -> None:
    """bench fused-layer's fused chain (norms as row scales in the GEMM epilogues, residual add and sum of squares
    in o's and down's, SwiGLU in down's prologue) computes what the model's chain computes, in float32 under
    Triton's interpreter, over 3 rows (a partial tile) and 2 layers; the plain Triton GEMMs too."""
    import torch

    from bench.fused_layer import Chains, make_layers

    torch.manual_seed(0)
    layers = make_layers(2, "cpu", torch.float32)
    tiles = {name: (16, 128, 128) for name in ("qkv", "o", "gate_up", "down")}  # few programs: the interpreter's cost
    chains = Chains(layers, torch.randn(3, 1024), tiles)
    chains.unfused()
    ref = chains.out.clone()
    for chain in (chains.fused, lambda: chains.fused(swiglu_prologue=False), lambda: chains.unfused("triton")):
        chains.out.zero_()
        chain()
        torch.testing.assert_close(chains.out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
