"""The host KV tier through the services: a real CPU worker (qwen3-tiny) whose GPU-side pool cannot hold the
load, with a host pool behind it. Streams preempt one another, their blocks go out to the host and come back
in, and every stream's greedy tokens still equal transformers'; the scheduler's counters show the copies,
and afterwards every block is free."""
from __future__ import annotations

import functools
import random

import pytest

from client import Client
from client.launcher import LocalCluster, free_port
from tests import sim_cluster
from tests.sim_cluster import sample, scrape
from tests.test_faults import SCHED_ARGS, all_idle, join, start_streams
from tests.test_tensor_parallel import _hf_generate

pytestmark = pytest.mark.timeout(300)
wait_for = functools.partial(sim_cluster.wait_for, timeout=60.0)
MAX_NEW = 24


@pytest.fixture(scope="module")
def offload_cluster(tiny_model_dir, tmp_path_factory):
    metrics_port = free_port()
    # 12 blocks of 16 tokens: two or three of the eight sequences (up to 64 positions each) at a time. Each step
    # waits 20 ms first, so that all eight arrive before the pool fills however loaded the machine: which blocks are
    # swapped out, and whether a resumed sequence finds them still on the GPU, then depends on the plans alone.
    c = LocalCluster(tiny_model_dir, num_workers=1,
                     worker_args=["--num-blocks", "12", "--block-size", "16", "--max-num-seqs", "8",
                                  "--kv-offload-gib", "0.01", "--log-format", "text", "--debug-step-delay", "0.02"],
                     scheduler_args=[*SCHED_ARGS, "--metrics-port", str(metrics_port)],
                     log_dir=tmp_path_factory.mktemp("offload-logs")).start(timeout=240)
    c.metrics_port = metrics_port
    yield c
    c.stop()


def test_streams_swapped_out_and_back_in_equal_transformers(offload_cluster, tiny_model_dir):
    rng = random.Random(23)
    prompts = [[rng.randrange(1, 150000) for _ in range(rng.randint(20, 40))] for _ in range(8)]
    requests = [dict(token_ids=p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True) for p in prompts]
    with Client(offload_cluster.address, timeout=120) as client:
        info = client.model_info(timeout=10)["workers"][0]
        assert info["num_blocks"] == 12 and info["num_host_blocks"] > 12
        streams = join(start_streams(client, requests))
        for s in streams:
            assert s.error is None, s.error
        assert [s.token_ids for s in streams] == _hf_generate(tiny_model_dir, prompts, MAX_NEW)
        wait_for("every block free", lambda: all_idle(client))
    samples = scrape(offload_cluster.metrics_port)
    assert sample(samples, "splitserve:num_preemptions_total") > 0
    assert sample(samples, "splitserve:kv_blocks_swapped_out_total") > 0
    assert sample(samples, "splitserve:kv_blocks_swapped_in_total") > 0
    assert sample(samples, "splitserve:prefix_cache_hit_tokens_total", tier="host") > 0
    assert sample(samples, "splitserve:kv_host_blocks_used") > 0


def test_a_host_tier_is_kept_only_where_a_block_comes_back_faster_than_it_is_prefilled(tmp_path):
    """tier_policy's rule, and the simulated worker applying it from its cost model: Qwen3-0.6B's shapes with
    the H200 fit (a 29 MB block over 25 GB/s against 256 tokens at 2.7 us) report no host tier at handshake; a
    model whose tokens cost 20 us to prefill (an 8B's) keeps the tier asked for."""
    from bench.common import write_config_only
    from common.limits import Limits
    from worker_svc.runtime.simulated import SimulatedRunner, StepCost
    from worker_svc.runtime.tier_policy import host_tier_pays

    assert host_tier_pays(1e-3, 5e-6, 256) and not host_tier_pays(1e-3, 3e-6, 256)
    model = write_config_only("qwen3-0.6b", tmp_path / "qwen3-0.6b")
    limits = Limits(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=4096)
    runner = SimulatedRunner(model, 64, 256, limits, StepCost(), kv_offload_bytes=1 << 30)
    assert runner.describe().num_host_blocks == 0
    runner = SimulatedRunner(model, 64, 256, limits, StepCost(per_token_us=20.0), kv_offload_bytes=1 << 30)
    assert runner.describe().num_host_blocks == (1 << 30) // runner.block_bytes > 0


def test_a_worker_times_a_prefill_and_a_block_copy_for_the_rule(tiny_model_dir, monkeypatch, caplog):
    """What a GPU worker measures before keeping its tier, run on the CPU (where the tier is always kept, for
    tests): a full prefill step's time per token and a block's copy in from the pool, handed to the rule with
    the block size, and logged with the decision."""
    import logging

    from worker_svc.runtime import model_runner
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(tiny_model_dir, RunnerConfig(device="cpu", num_blocks=64, block_size=16,
                                                      kv_offload_bytes=1 << 20))
    assert runner.describe().num_host_blocks > 0
    seen = []
    monkeypatch.setattr(model_runner, "host_tier_pays", lambda *a: seen.append(a) or False)
    with caplog.at_level(logging.INFO, logger="splitserve.worker"):
        assert runner._host_tier_pays() is False
    (copy_s, prefill_s, block_size), = seen
    assert 0 < copy_s < 1 and 0 < prefill_s < 1 and block_size == 16
    assert "host KV tier dropped" in caplog.text
    assert not runner.kv_cache[:, :, :8].any()  # the timed blocks came in as zeros
