"""Tensor parallelism inside one worker (issue 8), on CPUs with gloo, fp32, project-written checkpoints:
- the weight loaders cut the right slices (fake rank and size, KV heads sharded and replicated);
- in a real TP=2 group each rank holds exactly its slices of the checkpoint, the gathered logits are
  the same on every rank and equal transformers', and the KV block count is the minimum over ranks;
- through the full gRPC path (client -> scheduler -> `worker_svc.cli serve --tensor-parallel-size N`)
  greedy generations at TP=2 and at TP=4 (2 KV heads: replicated) equal TP=1 and transformers' generate;
- SIGTERM stops every rank; killing one non-leader rank takes the worker down, and the request in
  flight moves to the other worker (registered with `--scheduler`) and completes there, token-exact.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import multiprocessing as mp
import os
import random
import shutil
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch

from client.client import Client
from client.launcher import LocalCluster
from common.limits import Limits
from protos import WORKER_PROTOCOL_VERSION
from protos import worker_pb2, worker_pb2_grpc
from worker_svc import kernels
from worker_svc.checkpoints.writer import make_model
from worker_svc.model import parallel

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 12
PROMPT_LENS = [5, 19, 1, 33]


# ---- helpers --------------------------------------------------------------------------------------
def _prompts(seed: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 150000) for _ in range(n)] for n in PROMPT_LENS]


def _hf(model_dir: Path):
    from tests.hf_reference import from_pretrained  # transformers: not at module level (the spawned ranks import this)

    return from_pretrained(model_dir, dtype=torch.float32)


def _hf_generate(model_dir: Path, prompts: list[list[int]], n: int = MAX_NEW) -> list[list[int]]:
    hf = _hf(model_dir)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                              pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def _children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            kids.append(int(entry))
    return kids


def _rank_pids(leader: int) -> list[int]:
    """The leader's rank processes (multiprocessing spawn children, not its resource tracker)."""
    out = []
    for pid in _children(leader):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            out.append(pid)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _worker(cluster: LocalCluster):
    return next(p for p in cluster.processes if p.name.startswith("worker-"))


def _generate_all(address: str, prompts: list[list[int]], n: int = MAX_NEW) -> list[list[int]]:
    """All prompts at once, so the worker runs them as mixed batches."""
    def one(p):
        with Client(address, timeout=120) as client:
            [c] = client.complete(token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True)
            assert c.finish_reason == "length"
            return c.token_ids

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _describe(port: int) -> worker_pb2.DescribeResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return worker_pb2_grpc.WorkerStub(channel).Describe(
            worker_pb2.DescribeRequest(protocol_version=WORKER_PROTOCOL_VERSION), timeout=30)


# ---- weight loaders, fake rank and size -----------------------------------------------------------
CPU = kernels.select("cpu")


def _with_rank(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(parallel, "tp_rank", lambda: rank)
    monkeypatch.setattr(parallel, "tp_size", lambda: size)


@pytest.mark.parametrize("heads,kv_heads,size", [(8, 4, 2), (8, 4, 4), (4, 2, 4), (8, 2, 4), (4, 1, 2)])
def test_qkv_loader_shards_or_replicates_kv_heads(monkeypatch, heads, kv_heads, size):
    hidden, d = 8, 4
    q = torch.randn(heads * d, hidden)
    k, v = torch.randn(kv_heads * d, hidden), torch.randn(kv_heads * d, hidden)
    for rank in range(size):
        _with_rank(monkeypatch, rank, size)
        layer = parallel.QKVParallelLinear(hidden, d, heads, kv_heads, CPU)
        for shard_id, t in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, t, shard_id)
        my_heads = list(range(rank * heads // size, (rank + 1) * heads // size))
        # the KV heads those query heads use (GQA groups of heads // kv_heads)
        my_kv = sorted({h // (heads // kv_heads) for h in my_heads})
        assert layer.num_kv_heads == len(my_kv) == max(1, kv_heads // size)
        rows = lambda t, hs: torch.cat([t[h * d:(h + 1) * d] for h in hs])  # noqa: E731
        expected = torch.cat([rows(q, my_heads), rows(k, my_kv), rows(v, my_kv)])
        torch.testing.assert_close(layer.weight.data, expected, rtol=0, atol=0)


def test_linear_and_vocab_loaders(monkeypatch):
    size, hidden, inter, vocab = 4, 8, 16, 30  # 30 rows over 4 ranks: padded to 8 each
    gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    emb = torch.randn(vocab, hidden)
    for rank in range(size):
        _with_rank(monkeypatch, rank, size)
        s = slice(rank * inter // size, (rank + 1) * inter // size)
        gu = parallel.MergedColumnParallelLinear(hidden, [inter, inter], CPU)
        gu.weight.weight_loader(gu.weight, gate, 0)
        gu.weight.weight_loader(gu.weight, up, 1)
        torch.testing.assert_close(gu.weight.data, torch.cat([gate[s], up[s]]), rtol=0, atol=0)
        row = parallel.RowParallelLinear(inter, hidden, CPU)
        row.weight.weight_loader(row.weight, down)
        torch.testing.assert_close(row.weight.data, down[:, s], rtol=0, atol=0)
        e = parallel.VocabParallelEmbedding(vocab, hidden)
        e.weight.weight_loader(e.weight, emb)
        mine = emb[rank * 8:(rank + 1) * 8]
        torch.testing.assert_close(e.weight.data[:len(mine)], mine, rtol=0, atol=0)
        assert not e.weight.data[len(mine):].any()


def test_unreduced_row_parallel_outputs_sum_to_the_layer_with_its_bias_once(monkeypatch):
    """reduce=False (a shared expert's down projection, joining the experts' all-reduce): the ranks' outputs sum to
    x W^T + b, the bias added by one rank only."""
    size, inter, hidden = 4, 16, 8
    w, b, x = torch.randn(hidden, inter), torch.randn(hidden), torch.randn(3, inter)
    total = torch.zeros(3, hidden)
    for rank in range(size):
        _with_rank(monkeypatch, rank, size)
        row = parallel.RowParallelLinear(inter, hidden, CPU, bias=True, reduce=False)
        row.weight.weight_loader(row.weight, w)
        row.bias.weight_loader(row.bias, b)
        s = slice(rank * inter // size, (rank + 1) * inter // size)
        total += row(x[:, s])
    torch.testing.assert_close(total, x @ w.T + b)


# ---- a real TP=2 group: sharded loading, logits, block count --------------------------------------
def _run_ranks(target, size: int, out: Path, *args: str) -> list[dict]:
    """target(rank, size, store port, *args) in a spawned process per rank of one group; what each saved in
    out/rank<r>.pt."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, size, store.port, *args)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * size
    return [torch.load(out / f"rank{r}.pt") for r in range(size)]


def _probe_rank(rank: int, size: int, port: int, model_dir: str, out: str) -> None:
    """One rank of a TP group in its own process: load the model, save its parameters, its logits of
    two prompts and its block count."""
    import torch.distributed as dist

    from worker_svc.kernels.attention import AttentionMetadata
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig
    from worker_svc.runtime.tensor_parallel import _init_process_group

    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=datetime.timedelta(seconds=120))
    _init_process_group(rank, size, store, "cpu")
    # every rank has room for a different number of blocks: the cache gets the minimum
    runner = ModelRunner(model_dir, RunnerConfig(device="cpu", dtype="float32", limits=Limits(max_num_seqs=4),
                                                 kv_cache_memory=(1 << 20) * (2 + rank)))
    params = {}
    for name, p in runner.model.named_parameters():
        if name == "embed_tokens.weight":
            params[name + ".shape"] = torch.tensor(p.shape)
            params[name + ".head"], params[name + ".tail"] = p[:4].clone(), p[-4:].clone()
        else:
            params[name] = p.detach().clone()
    prompts = [[11, 22, 33, 44, 55], [151000, 7, 99, 123456, 5, 6, 7, 8, 9]]
    lens = [len(p) for p in prompts]
    bs = runner.block_size
    page = torch.tensor([[0], [1]], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens])
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32),
        seqused_k=torch.tensor(lens, dtype=torch.int32), page_table=page,
        slot_mapping=page[seq, positions // bs].long() * bs + positions % bs, max_seqlen_q=max(lens),
        query_lens=lens, context_lens=lens)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(sum(prompts, [])), positions, meta)
        logits = runner.model.compute_logits(hidden)
    torch.save({"params": params, "logits": logits, "prompts": prompts, "num_blocks": runner.num_blocks,
                "kv_heads": runner.model.layers[0].self_attn.num_kv_heads,
                "describe_tp": runner.describe().tensor_parallel_size},
               Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory) -> Path:
    """qwen3-tiny-tp: 8 heads, 4 KV heads, head_dim 16, hidden 128, intermediate 256, tied."""
    return make_model("qwen3-tiny-tp", tmp_path_factory.mktemp("tiny-tp") / "model", seed=3)


@pytest.fixture(scope="module")
def tp_reference(tp_model_dir) -> list[list[int]]:
    return _hf_generate(tp_model_dir, _prompts())


def test_tp2_ranks_hold_their_slices_and_gather_the_same_logits(tp_model_dir, tmp_path):
    size = 2
    ranks = _run_ranks(_probe_rank, size, tmp_path, str(tp_model_dir), str(tmp_path))

    from safetensors.torch import load_file
    from worker_svc.model.config import ModelConfig

    ckpt = load_file(str(tp_model_dir / "model.safetensors"))
    cfg = ModelConfig.from_dir(tp_model_dir)
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for rank, got in enumerate(ranks):
        params = got["params"]
        cut = lambda t, dim: t.chunk(size, dim)[rank]  # noqa: E731
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            q, k, v = (ckpt[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
            expected = {
                "self_attn.qkv_proj.weight": torch.cat([cut(q, 0), cut(k, 0), cut(v, 0)]),
                "self_attn.o_proj.weight": cut(ckpt[p + "self_attn.o_proj.weight"], 1),
                "mlp.gate_up_proj.weight": torch.cat([cut(ckpt[p + "mlp.gate_proj.weight"], 0),
                                                      cut(ckpt[p + "mlp.up_proj.weight"], 0)]),
                "mlp.down_proj.weight": cut(ckpt[p + "mlp.down_proj.weight"], 1),
                "self_attn.q_norm.weight": ckpt[p + "self_attn.q_norm.weight"],
                "self_attn.k_norm.weight": ckpt[p + "self_attn.k_norm.weight"],
                "input_layernorm.weight": ckpt[p + "input_layernorm.weight"],
                "post_attention_layernorm.weight": ckpt[p + "post_attention_layernorm.weight"],
            }
            for name, want in expected.items():
                torch.testing.assert_close(params[f"layers.{i}.{name}"], want, rtol=0, atol=0,
                                           msg=lambda m: f"rank {rank} {name} layer {i}: {m}")
        assert params["layers.0.self_attn.qkv_proj.weight"].shape[0] == (heads + 2 * kv) * d // size
        torch.testing.assert_close(params["norm.weight"], ckpt["model.norm.weight"], rtol=0, atol=0)
        emb = cut(ckpt["model.embed_tokens.weight"], 0)
        assert params["embed_tokens.weight.shape"].tolist() == list(emb.shape)  # half the vocabulary
        torch.testing.assert_close(params["embed_tokens.weight.head"], emb[:4], rtol=0, atol=0)
        torch.testing.assert_close(params["embed_tokens.weight.tail"], emb[-4:], rtol=0, atol=0)
        assert got["kv_heads"] == kv // size
        assert got["describe_tp"] == size

    # one block pool: the smallest rank's (rank 0 was given the least memory)
    per_block = 2 * cfg.num_hidden_layers * 16 * (kv // size) * d * 4
    assert {g["num_blocks"] for g in ranks} == {(2 << 20) // per_block}
    # every rank samples from the same gathered logits, bit for bit; and they are transformers'
    torch.testing.assert_close(ranks[0]["logits"], ranks[1]["logits"], rtol=0, atol=0)
    hf = _hf(tp_model_dir)
    start = 0
    with torch.inference_mode():
        for prompt in ranks[0]["prompts"]:
            ref = hf(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(ranks[0]["logits"][start:start + len(prompt)], ref, atol=1e-4, rtol=0)
            start += len(prompt)


def _lora_rank(rank: int, size: int, port: int, model_dir: str, adapter: str, out: str) -> None:
    """One rank of a TP group whose rank 1 cannot read adapter "x" (a disk error there): the load's outcome, the
    adapters each rank holds after it, and a placement of the one every rank read."""
    import torch.distributed as dist

    from worker_svc.model.lora import LoraSlots
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig
    from worker_svc.runtime.tensor_parallel import _init_process_group

    if rank == 1:
        read = LoraSlots._read

        def failing(self, name, folder):
            if name == "x":
                raise ValueError(f"LoRA adapter {name!r}: an I/O error on rank 1")
            return read(self, name, folder)

        LoraSlots._read = failing
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=datetime.timedelta(seconds=120))
    _init_process_group(rank, size, store, "cpu")
    runner = ModelRunner(model_dir, RunnerConfig(device="cpu", dtype="float32", num_blocks=8, max_loras=1,
                                                 max_cpu_loras=2, limits=Limits(max_num_seqs=4)))
    loads = [worker_pb2.LoraAdapter(name=n, path=adapter) for n in "xy"]
    step = runner.execute(worker_pb2.StepPlan(step=1, epoch=runner.epoch, load_loras=loads))
    failed = dict(step.result().failed_loras)
    held = sorted(runner.lora.registered)
    runner.execute(worker_pb2.StepPlan(step=2, epoch=runner.epoch, lora_slots=[worker_pb2.LoraSlot(slot=0, name="y")]))
    torch.save({"failed": failed, "held": held, "slots": list(runner.batch.lora_adapters)},
               Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_tp2_an_adapter_one_rank_cannot_read_is_refused_by_all(tp_model_dir, tmp_path):
    """Ranks that disagree on a LoRA load would place different adapters and fall out of step: an adapter serves
    only where every rank read it, and the leader answers why not."""
    from worker_svc.checkpoints.writer import make_lora_adapter

    adapter = make_lora_adapter(tp_model_dir, tmp_path / "adapter", rank=4)
    leader, follower = _run_ranks(_lora_rank, 2, tmp_path, str(tp_model_dir), str(adapter), str(tmp_path))
    assert list(leader["failed"]) == ["x"] and "another tensor-parallel rank" in leader["failed"]["x"]
    assert "I/O error on rank 1" in follower["failed"]["x"]
    assert leader["held"] == follower["held"] == ["y"] and leader["slots"] == follower["slots"] == ["y"]


def _weights_rank(rank: int, size: int, port: int, model_dir: str, new: str, bad: str, out: str) -> None:
    """One rank of a TP group that reads its weights again from `new` (every rank can), then from `bad` (rank 1
    cannot: a disk error there): the outcomes, and whether its parameters then equal its shards of `new`."""
    import torch.distributed as dist

    from worker_svc.runtime import model_runner
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig
    from worker_svc.runtime.tensor_parallel import _init_process_group

    if rank == 1:
        read = model_runner.load_weights

        def failing(model, folder, names_only=False):
            if str(folder) == bad and not names_only:  # its tensors, not its names
                raise OSError(f"an I/O error on rank 1 reading {folder}")
            return read(model, folder, names_only)

        model_runner.load_weights = failing
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=datetime.timedelta(seconds=120))
    _init_process_group(rank, size, store, "cpu")
    config = RunnerConfig(device="cpu", dtype="float32", num_blocks=8, limits=Limits(max_num_seqs=4))
    runner = ModelRunner(model_dir, config)
    failed = [runner.execute(worker_pb2.StepPlan(step=step, epoch=runner.epoch, load_weights=folder)).result()
              .failed_weights for step, folder in ((1, new), (2, bad))]
    fresh = dict(ModelRunner(new, config).model.named_parameters())
    same = all(torch.equal(p, fresh[name]) for name, p in runner.model.named_parameters())
    torch.save({"failed": failed, "same": same, "path": runner.describe().weights_path}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_tp2_weights_read_again_on_every_rank_or_on_none(tp_model_dir, tmp_path):
    """Every rank reads its shards of the new checkpoint; where one rank cannot, every rank serves the weights it had
    (ranks that disagreed would compute a model nobody loaded), and the leader answers why."""
    new = make_model("qwen3-tiny-tp", tmp_path / "new", seed=4)
    bad = shutil.copytree(new, tmp_path / "bad")
    leader, follower = _run_ranks(_weights_rank, 2, tmp_path, str(tp_model_dir), str(new), str(bad), str(tmp_path))
    assert leader["failed"][0] == follower["failed"][0] == ""
    assert "another tensor-parallel rank" in leader["failed"][1] and "I/O error on rank 1" in follower["failed"][1]
    assert leader["same"] and follower["same"] and leader["path"] == follower["path"] == str(new)


# ---- full gRPC path ------------------------------------------------------------------------------
def _cluster(model_dir: Path, tp: int, tmp: Path, *extra: str) -> LocalCluster:
    return LocalCluster(model_dir, worker_args=["--tensor-parallel-size", str(tp), "--dtype", "float32",
                                                "--num-blocks", "64", "--max-num-seqs", "8", *extra],
                        log_dir=tmp).start(timeout=180)


def _tp1_tokens(model: Path, prompts: list[list[int]], **options):
    """Greedy tokens of one process at TP 1 (offline.LLM with these options), and its runner."""
    from offline.llm import LLM
    from scheduler_svc.sampling import SamplingParams

    with LLM(model, device="cpu", dtype="float32", num_blocks=64, block_size=16, max_num_seqs=8, **options) as llm:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm.engine.executor.runner


def _tp2_tokens(model: Path, prompts: list[list[int]], tmp: Path, *worker_flags: str):
    """Greedy tokens through a cluster whose worker runs at TP 2 with these flags, and its handshake."""
    cluster = _cluster(model, 2, tmp, *worker_flags)
    try:
        return _generate_all(cluster.address, prompts), _describe(cluster.worker_ports[0])
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def tp2_cluster(tp_model_dir, tmp_path_factory):
    cluster = _cluster(tp_model_dir, 2, tmp_path_factory.mktemp("tp2-logs"))
    try:
        yield cluster
    finally:
        cluster.stop()


def test_tp2_generations_equal_tp1_and_transformers(tp2_cluster, tp_model_dir, tp_reference):
    info = _describe(tp2_cluster.worker_ports[0])
    assert info.tensor_parallel_size == 2 and info.num_blocks == 64
    prompts = _prompts()
    got = _generate_all(tp2_cluster.address, prompts)
    assert got == tp_reference
    assert _tp1_tokens(tp_model_dir, prompts)[0] == got


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-moe-tiny", "mixtral-tiny", "qwen2-moe-tiny", "granite-tiny",
                                    "phi4-mini-tiny", "granite-moe-tiny", "glm4-tiny", "glm4-moe-tiny",
                                    "dots1-tiny", "ernie4_5-moe-tiny", "gpt-oss-tiny",
                                    "deepseek-v3-tiny", "olmo2-tiny", "cohere2-tiny", "cohere-tiny",
                                    "starcoder2-tiny", "nemotron-tiny"])
def test_tp2_newcomers_equal_transformers(preset, tmp_path):
    """Under TP = 2: Llama with attention and MLP biases (column biases cut per rank, the row-parallel bias added
    once after the all-reduce), no q/k norms, scaled rope, 6 heads over 2 KV heads; Qwen3-MoE with each rank
    holding 4 of the 8 experts of each layer (and only those), computing them for every token, the all-reduce
    adding the two halves; Qwen2-MoE's shared expert split as a dense MLP, its partial sums joining the experts'
    in that one all-reduce; Granite's residual multiplier folded into each rank's share of o_proj and down_proj;
    Phi-4-mini's partial rope, each rank reordering its own heads' q and k rows (layers.rotary_order); GraniteMoE's
    experts stored whole per projection, each rank taking its experts from the one tensor, its residual multiplier
    folded into them; GLM-4's interleaved half-head rope and q/k/v biases, each rank reordering its heads' rows;
    gpt-oss's sinks cut with their heads and its experts' biases with their experts (the MXFP4 experts dequantised on
    each rank); DeepSeek-V3's latent attention with its q and per-head K / V projections cut by heads, the latent
    ones whole on each rank; OLMo 2's q/k norms over all heads, each rank's sum of squares all-reduced."""
    from offline.executor import InProcessExecutor
    from offline.llm import LLM
    from scheduler_svc.sampling import SamplingParams
    from worker_svc.runtime.model_runner import RunnerConfig
    from worker_svc.runtime.tensor_parallel import TensorParallelRunner

    model_dir = make_model(preset, tmp_path / preset, seed=4)
    # the ranks in-process (rank 0 here, rank 1 spawned): the gRPC path under TP is test_tp2_generations_equal_...'s
    runner = TensorParallelRunner(model_dir, RunnerConfig(dtype="float32", num_blocks=64,
                                                          limits=Limits(max_num_seqs=8)), 2)
    with LLM(model_dir, executor=InProcessExecutor(runner)) as llm:
        assert runner.describe().tensor_parallel_size == 2
        outs = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    assert [o.token_ids for o in outs] == _hf_generate(model_dir, _prompts())


def test_tp2_reranker_scores_equal_tp1(tp_model_dir):
    """A classifier head (here Qwen3-Reranker's, the LM head's "yes" minus "no" rows, vLLM's overrides) is whole on
    every rank, over the final norm's output each rank holds whole: TP = 2 scores as TP = 1."""
    from offline.executor import InProcessExecutor
    from offline.llm import LLM
    from worker_svc.runtime.model_runner import RunnerConfig
    from worker_svc.runtime.tensor_parallel import TensorParallelRunner

    from common.model_files import QWEN3_RERANKER_OVERRIDES as overrides

    query, docs = "What is the capital of China?", ["Beijing is.", "Explain gravity " * 8]
    with LLM(tp_model_dir, dtype="float32", num_blocks=64, block_size=16, hf_overrides=overrides) as llm:
        tp1 = llm.score(query, docs, use_tqdm=False)
    runner = TensorParallelRunner(tp_model_dir, RunnerConfig(dtype="float32", num_blocks=64, hf_overrides=overrides,
                                                             limits=Limits(max_num_seqs=8)), 2)
    with LLM(tp_model_dir, executor=InProcessExecutor(runner)) as llm:
        assert runner.describe().labels == ["yes"]
        assert llm.score(query, docs, use_tqdm=False) == pytest.approx(tp1, abs=1e-5)


def test_expert_weights_keep_only_this_ranks_experts(monkeypatch):
    from worker_svc.model.moe import ExpertWeights

    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(parallel.dist, "get_rank", lambda: 1)
    w = ExpertWeights(num_experts=4, out_features=3, in_features=2, halves=(0, 1))
    assert w.weight.shape == (2, 6, 2) and w.first == 2
    w.weight.data.zero_()
    for e in range(4):
        for half in (0, 1):
            w.weight_loader(w.weight, torch.full((3, 2), 10.0 * e + half), (e, half))
    # experts 2 and 3, each its gate half then its up half; experts 0 and 1 skipped
    assert [w.weight[e, rows].unique().item() for e in (0, 1) for rows in (slice(0, 3), slice(3, 6))] == [
        20.0, 21.0, 30.0, 31.0]


def test_tp2_over_an_fp8_cache_equals_tp1_over_one(tp_model_dir, tmp_path):
    """Each rank quantises its own KV heads, as the one rank of TP 1 quantises all of them."""
    prompts = _prompts(seed=12)
    tp1, _ = _tp1_tokens(tp_model_dir, prompts, kv_cache_dtype="fp8")
    tp2, info = _tp2_tokens(tp_model_dir, prompts, tmp_path, "--kv-cache-dtype", "fp8")
    assert info.tensor_parallel_size == 2 and info.kv_cache_dtype == "float8_e4m3fn"
    assert tp2 == tp1


def test_tp2_with_fp8_projections_equals_tp1_with_them(tmp_path):
    """Each rank quantises its own shard of every projection (whole 128 x 128 blocks on both ranks here: packed
    column-parallel qkv, row-parallel o), and a row-parallel projection's input per 128 of its own columns: the blocks
    and groups of TP 1's, so the same tokens. The MoE's ranks each hold half its experts whole, in FP8 as TP 1 holds
    them."""
    model = make_model("qwen3-moe-fp8", tmp_path / "model", seed=5)
    prompts = _prompts(seed=13)
    tp1, runner = _tp1_tokens(model, prompts, quantization="fp8")
    assert runner.fp8_linears == 2 * 4
    tp2, info = _tp2_tokens(model, prompts, tmp_path, "--quantization", "fp8")
    assert info.projection_dtype == "float8_e4m3fn"
    assert tp2 == tp1


def test_tp2_with_packed_projections_equals_tp1_with_them(tp_model_dir, tmp_path):
    """A GPTQ checkpoint's projections served in its packed integer groups (`--quantization packed`): each rank keeps
    its rows of words and groups of a column-parallel projection (qkv, gate_up) and its columns' words and groups of a
    row-parallel one (o, down: 64 and 128 of their columns, groups of 32), so TP 2 computes TP 1's weights and gives
    its tokens."""
    from tests.quantized_checkpoints import gptq_folder

    model = gptq_folder(tp_model_dir, tmp_path / "gptq")
    prompts = _prompts(seed=14)
    tp1, runner = _tp1_tokens(model, prompts, quantization="packed")
    assert runner.packed_linears == 4 * runner.model_config.num_hidden_layers
    tp2, info = _tp2_tokens(model, prompts, tmp_path, "--quantization", "packed")
    assert info.projection_dtype == "int4"
    assert tp2 == tp1


def test_sigterm_stops_every_rank(tp2_cluster):
    worker = _worker(tp2_cluster)
    ranks = _rank_pids(worker.popen.pid)
    assert len(ranks) == 1
    tp2_cluster.stop()
    assert worker.popen.returncode == 0
    assert _wait_gone(ranks, 15) == []


@pytest.fixture(scope="module")
def tp4_cluster(tiny_model_dir, tmp_path_factory):
    """qwen3-tiny (4 heads, 2 KV heads) at TP=4: one query head per rank, each KV head on two ranks.
    Slowed down a little per step so a request is still running when a rank is killed."""
    cluster = _cluster(tiny_model_dir, 4, tmp_path_factory.mktemp("tp4-logs"), "--debug-step-delay", "0.01")
    try:
        yield cluster
    finally:
        cluster.stop()


def test_tp4_with_replicated_kv_heads_equals_transformers(tp4_cluster, tiny_model_dir):
    info = _describe(tp4_cluster.worker_ports[0])
    assert info.tensor_parallel_size == 4
    prompts = _prompts(seed=9)
    assert _generate_all(tp4_cluster.address, prompts) == _hf_generate(tiny_model_dir, prompts)


def test_killing_a_rank_moves_the_request_in_flight_to_the_other_worker(tp4_cluster):
    worker = _worker(tp4_cluster)
    ranks = _rank_pids(worker.popen.pid)
    assert len(ranks) == 3
    # A second worker (TP=1) joins; with fewer free blocks, the request is routed to the TP=4 one.
    tp4_cluster.start_worker(extra=["--tensor-parallel-size", "1", "--num-blocks", "32",
                                    "--scheduler", tp4_cluster.address])
    with Client(tp4_cluster.address, timeout=180) as client:
        deadline = time.monotonic() + 120
        while client.model_info()["num_workers"] < 2:
            assert time.monotonic() < deadline, "the second worker did not register"
            time.sleep(0.2)
        request = dict(token_ids=[1, 2, 3, 4, 5], max_tokens=400, temperature=0.0, ignore_eos=True)
        stream = client.generate(**request)
        first = next(stream)  # the request is running on the TP=4 worker
        assert first.token_ids
        second = f"127.0.0.1:{tp4_cluster.worker_ports[-1]}"
        assert all(w["num_requests"] == 0 for w in client.model_info()["workers"] if w["address"] == second)
        os.kill(ranks[1], signal.SIGKILL)
        deltas = [first, *stream]  # moved to the other worker by recompute: it completes
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 400
        # exactly the tokens of a run without the fault (now on the second worker alone)
        [again] = client.complete(**request)
        assert [t for d in deltas for t in d.token_ids] == again.token_ids
    # the leader went down with a non-zero status, and took the other ranks with it
    assert worker.popen.wait(30) != 0
    assert _wait_gone(ranks, 15) == []
    log = worker.log_path.read_text(errors="replace")
    assert "taking the worker down" in log or "failed on the leader" in log
