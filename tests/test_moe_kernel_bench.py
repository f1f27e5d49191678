"""bench/moe_kernel.py on the CPU, in Triton's interpreter, at tiny shapes: the sweep writes its results and
a table that pastes into kernels/moe.py; the candidates it prunes; kernels built in worker processes.
No speed is asserted."""
from __future__ import annotations

import json
import os

import pytest
import torch

from bench import moe_kernel
from bench.moe_kernel import Shape, block_ms, fits, paste_table, table_keys
from worker_svc.kernels import moe
from worker_svc.kernels.moe import MoeConfig, Tiles

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")

TINY = ["--device", "cpu", "--dtype", "float32", "--experts", "4", "--top-k", "2", "--hidden", "64",
        "--intermediate", "32", "--block-m", "16", "--block-n", "32,64", "--block-k", "32", "--warps", "4",
        "--stages", "2", "--reps", "1"]


def test_the_sweep_writes_results_and_a_table_that_pastes_into_moe_py(tmp_path):
    from bench.__main__ import main

    out = tmp_path / "moe_kernel.json"
    main(["moe-kernel", *TINY, "--tokens", "3,20", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "moe_kernel" and doc["command"].split()[1:3] == ["-m", "bench.moe_kernel"]
    assert out.with_suffix(".md").read_text().startswith("# moe_kernel")
    rows = doc["results"]
    assert [r["tokens"] for r in rows] == [3, 20]
    for r in rows:
        assert r["searched"] == "full" and r["trials"] > 1 and r["best_us"] > 0 and r["routed_mb"] > 0
        assert r["best_us"] <= r["table_us"]  # the table's config is among those timed
    trials = json.loads((tmp_path / "moe_kernel_trials.json").read_text())
    assert trials and not [t for t in trials if "error" in t]
    table = {}
    exec("HOPPER_CONFIGS = {\n" + (tmp_path / "moe_kernel_table.txt").read_text() + "}",
         {"MoeConfig": MoeConfig, "Tiles": Tiles}, table)
    table = table["HOPPER_CONFIGS"][(64, 32)]  # the shape's entry: (hidden, intermediate)
    for r in rows:
        best = moe.lookup(table, r["tokens"])
        assert (best.block_m, moe_kernel.describe(best.gate_up), moe_kernel.describe(best.down)) == (
            r["block_m"], r["gate_up"], r["down"])


def test_table_keys_are_cuda_graph_batch_sizes_between_the_measured_counts():
    tokens = [int(t) for t in moe_kernel.TOKENS.split(",")]
    assert table_keys(tokens) == [2, 16, 32, 80, 176, 352, 720, 2048, 8192, 16384]
    assert table_keys([130, 140]) == [144, 144]  # never below a count's own batch size
    a, b = MoeConfig(16), MoeConfig(32)
    literal = paste_table({1: a, 8: a, 130: b, 4096: b, 16384: a}, Shape(128, 8, 2048, 768))
    table = {}
    exec("HOPPER_CONFIGS = {\n" + literal + "\n}", {"MoeConfig": MoeConfig, "Tiles": Tiles}, table)
    assert table["HOPPER_CONFIGS"] == {(2048, 768): {32: a, 8192: b, 16384: a}}  # neighbours with one config: one


def test_the_candidates_suit_the_shapes():
    shape = Shape(128, 8, 2048, 768)
    assert block_ms(1, shape, [16, 32, 64, 128]) == [16, 32]
    assert block_ms(16384, shape, [16, 32, 64, 128]) == [64, 128]
    assert fits(16, Tiles(64, 64, 4, 3), 1536, 2048)
    assert not fits(128, Tiles(256, 256, 8, 2), 1536, 2048)  # past shared memory
    assert not fits(128, Tiles(256, 64, 4, 3), 1536, 2048)  # 256 accumulators a thread
    assert not fits(16, Tiles(32, 64, 8, 3), 1536, 2048)  # 8 warps for 512 outputs
    assert not fits(16, Tiles(64, 256, 4, 5), 2048, 768)  # 4 tiles to prefetch of K's 3
    assert not fits(16, Tiles(64, 64, 4, 3), 32, 2048) and fits(16, Tiles(64, 64, 4, 3), 33, 2048)
    # e4m3 experts: K tiles within a block of scales, half the shared memory, twice the registers
    assert fits(16, Tiles(64, 128, 4, 3), 1536, 2048, fp8=True) and not fits(16, Tiles(64, 256, 4, 3), 1536, 2048, True)
    assert fits(128, Tiles(128, 128, 8, 4), 1536, 2048, True) and not fits(128, Tiles(128, 128, 8, 4), 1536, 2048)
    assert fits(128, Tiles(128, 64, 4, 3), 1536, 2048) and not fits(128, Tiles(128, 64, 4, 3), 1536, 2048, True)


def test_the_fp8_sweep_times_e4m3_experts_against_the_loop_over_their_codes(tmp_path, faithful_fp8):
    """--fp8: the experts as served in e4m3 128 x 128 blocks, every config checked against the loop over the same
    codes (none mismatches), K tiles at most a block, and the table's config the fp8 one (moe.fp8_config's on a
    CPU, where no table is measured: the default's)."""
    out = tmp_path / "moe_kernel.json"
    moe_kernel.main(["--device", "cpu", "--dtype", "float32", "--experts", "4", "--top-k", "2", "--hidden", "128",
                     "--intermediate", "128", "--block-m", "16", "--block-n", "32,64", "--block-k", "64,128,256",
                     "--warps", "4", "--stages", "2", "--reps", "1", "--tokens", "5", "--fp8", "--out", str(out)])
    row, = json.loads(out.read_text())["results"]
    assert row["searched"] == "full" and row["best_us"] > 0
    assert row["routed_mb"] == round(row["experts_routed"] * 3 * 128 * 128 / 1e6, 1)  # a byte a weight
    trials = json.loads((tmp_path / "moe_kernel_trials.json").read_text())
    assert len(trials) > 2 and not [t for t in trials if "error" in t]
    assert {t["gate_up"].split("/")[1] for t in trials} == {"64", "128"}


def test_kernels_build_in_worker_processes(capsys):
    shape = Shape(4, 2, 64, 32)
    jobs = [("gate_up", 16, Tiles(32, 32, 4, 2)), ("down", 16, Tiles(64, 64, 4, 2))]
    assert moe_kernel.build_all(jobs, shape, 2, "cpu", torch.float32, False) == set()
    assert "built 2 kernels" in capsys.readouterr().out
    bad = ("gate_up", 16, Tiles(48, 32, 4, 2))  # not a power of two: does not build
    assert [job for job, _ in moe_kernel._build([bad, *jobs], shape, "cpu", torch.float32, False)] == [bad]

