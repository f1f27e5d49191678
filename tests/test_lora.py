"""LoRA adapters (--lora-modules, GenerateRequest.lora, the gateway's `model`): adapters in PEFT's layout over
qwen3-tiny, one on every projection (rank 4), one on q, v and down (rank 8). Greedy tokens equal transformers'
with each adapter merged into the weights (W + scale B A), base and adapted sequences side by side in the same steps;
in-process with chunked prefills, then through the services on a worker of two tensor-parallel ranks (B split by
output rows, A by input columns) and the gateway. A prefix is cached per adapter: never shared across them."""
from __future__ import annotations

import concurrent.futures
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from client import Client
from client.launcher import LocalCluster
from common.util import free_port
from offline.executor import InProcessExecutor
from offline.llm import LLM
from scheduler_svc.config import config_from_options
from scheduler_svc.engine import LLMEngine
from scheduler_svc.sampling import SamplingParams
from tests.hf_reference import merge_lora
from tests.test_engine_model import _run
from tests.sim_cluster import sample, scrape
from tests.test_gateway import Gateway
from worker_svc.checkpoints.writer import make_lora_adapter
from worker_svc.runtime.model_runner import RunnerConfig

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 6, 7] * 13, [11, 12], [(13 * i) % 1000 + 1 for i in range(20)]]  # no 0: generate() pads it
MAX_NEW = 12
NAMES = ("", "all", "qv")


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {"all": make_lora_adapter(tiny_model_dir, root / "all", rank=4, seed=1),
            "qv": make_lora_adapter(tiny_model_dir, root / "qv", rank=8, seed=2,
                                    targets=("q_proj", "v_proj", "down_proj"))}


@pytest.fixture(scope="module")
def merged(tiny_model_dir, adapters) -> dict[str, transformers.Qwen3ForCausalLM]:
    """transformers' model per adapter merged into the weights ("": none)."""
    out = {}
    for name in NAMES:
        hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        if name:
            hf.load_state_dict(merge_lora(hf.state_dict(), adapters[name]))
        out[name] = hf
    return out


@pytest.fixture(scope="module")
def reference(merged) -> dict[str, list[list[int]]]:
    """Greedy continuations of PROMPTS by transformers, per adapter merged into the weights ("": none)."""
    out = {}
    for name, hf in merged.items():
        with torch.inference_mode():
            out[name] = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW,
                                     min_new_tokens=MAX_NEW, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    assert out["all"] != out[""] and out["qv"] != out[""]  # the adapters change what the model says
    return out


def _params(lora: str) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, seed=0, ignore_eos=True, lora=lora)


def _run_every_prompt_under_each_adapter(model_dir: Path, adapters: dict[str, Path], reference: dict,
                                         scheduler: dict, **runner) -> LLMEngine:
    """An engine over the adapters (`scheduler`: its options, `runner`: the RunnerConfig's beyond them) that runs
    every prompt under each adapter and the base model in one batch; their tokens checked against `reference`."""
    config, _ = config_from_options({"max_num_seqs": 8, **scheduler})
    executor = InProcessExecutor.for_model(model_dir, RunnerConfig(
        device="cpu", dtype="float32", limits=config.limits,
        lora_modules={name: str(path) for name, path in adapters.items()}, **runner))
    engine = LLMEngine(model_dir, executor, config)
    for name in NAMES:
        for i, prompt in enumerate(PROMPTS):
            engine.add(prompt, _params(name), f"{name}:{i}")
    done = _run(engine)
    for name in NAMES:
        assert [done[f"{name}:{i}"][0] for i in range(len(PROMPTS))] == reference[name], name
    return engine


def test_adapted_and_base_sequences_in_one_batch_equal_merged_weights(tiny_model_dir, adapters, reference):
    engine = _run_every_prompt_under_each_adapter(tiny_model_dir, adapters, reference, {"max_num_batched_tokens": 32},
                                                  num_blocks=64, block_size=16)
    # a new prompt's two full blocks (of 40 tokens) are cached for the adapter that computed them, for no other
    prompt = [(17 * i) % 997 for i in range(40)]
    for name, cached in (("all", 0), ("qv", 0), ("all", 32), ("", 0), ("qv", 32), ("", 32)):
        engine.add(prompt, _params(name), "again")
        assert _run(engine)["again"][3].cached_prompt_tokens == cached, name
    with pytest.raises(ValueError, match="not served"):
        engine.add(PROMPTS[0], _params("nope"), "nope")


def test_adapted_sequences_swapped_to_the_host_and_back_equal_merged_weights(tiny_model_dir, adapters, reference):
    """Under block pressure (16 blocks of 4 tokens) with a host tier behind them: base and adapted sequences are
    preempted, their blocks swapped out and in, and cached prefixes hit on the host, each under its own adapter."""
    engine = _run_every_prompt_under_each_adapter(
        tiny_model_dir, adapters, reference, {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 6},
        num_blocks=16, block_size=4, kv_offload_bytes=32 << 20)
    scheduler, blocks = engine.scheduler, engine.scheduler.block_manager
    assert scheduler.num_preemptions > 0 and blocks.num_swapped_out > 0 and blocks.num_swapped_in > 0
    assert blocks.num_free_blocks == 16
    blocks.check([])


def test_more_adapters_than_slots_equal_merged_weights(tiny_model_dir, adapters, reference):
    """Two adapters and one slot (max_loras 1): the batch of every prompt under each adapter and the base model runs
    one adapter's sequences at a time beside the base model's, each adapter copied into the slot from host memory
    when its turn comes, and every token equals the merged weights'; a prefix cached under an adapter is hit again
    after it left the slot and came back."""
    engine = _run_every_prompt_under_each_adapter(tiny_model_dir, adapters, reference, {"max_num_batched_tokens": 32},
                                                  num_blocks=64, block_size=16, max_loras=1)
    adapters_of = engine.scheduler.adapters
    assert adapters_of.num_placements == 1 and adapters_of.slots == ["qv"]  # "all" held the slot from the start
    assert sorted(engine.worker_info.lora_adapters) == ["all", "qv"] and engine.worker_info.max_cpu_loras == 2
    prompt = [(17 * i) % 997 for i in range(40)]
    for name, cached in (("all", 0), ("qv", 0), ("all", 32), ("qv", 32)):
        engine.add(prompt, _params(name), "again")
        assert _run(engine)["again"][3].cached_prompt_tokens == cached, name
    assert adapters_of.num_placements == 5
    engine.scheduler.block_manager.check([])


def test_adapters_of_a_model_with_output_scales_equal_merged_weights(tmp_path_factory):
    """Granite scales its residual branches (folded into o_proj's and down_proj's rows at load): an adapter's B takes
    the same scale whether it was loaded at start or while serving, and after it moved between slots."""
    from tests.test_architectures import _write

    _, folder, hf = _write("granite", tmp_path_factory)
    adapter = make_lora_adapter(folder, tmp_path_factory.mktemp("granite-lora") / "a", rank=4, seed=3)
    hf.load_state_dict(merge_lora(hf.state_dict(), adapter))
    prompts = [[(31 * i + j) % 4000 + 1 for j in range(5 + 7 * i)] for i in range(3)]
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(folder, device="cpu", dtype="float32", max_num_seqs=8, num_blocks=64, block_size=16,
              lora_modules={"start": str(adapter)}, max_loras=1, max_cpu_loras=2)
    llm.load_lora("later", adapter)
    for name in ("start", "later", "start"):
        assert [o.token_ids for o in llm.generate(prompts, _params(name), use_tqdm=False)] == want, name
    assert llm.engine.scheduler.adapters.num_placements == 2


def test_adapters_it_cannot_serve_are_refused_by_name(tiny_model_dir, adapters, tmp_path):
    from worker_svc.runtime.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, RunnerConfig(num_blocks=4, block_size=16, max_loras=1, max_lora_rank=4))

    def load_adapters(adapters: dict[str, Path]) -> None:
        (name, folder), = adapters.items()
        try:
            runner.lora.register(name, folder)
        finally:  # a refused adapter is not held, and no slot was touched
            assert not runner.lora.registered
            assert all(not m.lora.a.any() and not m.lora.b.any() for m in runner.lora.modules.values())

    with pytest.raises(ValueError, match="'big': rank 8 is above this worker's --max-lora-rank 4"):
        load_adapters({"big": adapters["qv"]})
    with pytest.raises(ValueError, match="is not a PEFT adapter folder"):
        load_adapters({"gone": tmp_path / "gone"})
    bias = tmp_path / "bias"
    make_lora_adapter(tiny_model_dir, bias, rank=2)
    config = json.loads((bias / "adapter_config.json").read_text())
    (bias / "adapter_config.json").write_text(json.dumps({**config, "bias": "lora_only"}))
    with pytest.raises(ValueError, match="'bias'.*bias 'lora_only'"):
        load_adapters({"bias": bias})
    embed = tmp_path / "embed"
    make_lora_adapter(tiny_model_dir, embed, rank=2, targets=("q_proj",))
    tensors = load_file(embed / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.lora_A.weight"] = torch.zeros(2, 64)
    tensors["base_model.model.model.embed_tokens.lora_B.weight"] = torch.zeros(64, 2)
    save_file(tensors, str(embed / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="model.embed_tokens is not a projection"):
        load_adapters({"embed": embed})
    other = tmp_path / "other"  # an adapter of a model with another hidden size
    make_lora_adapter(tiny_model_dir, other, rank=2, targets=("o_proj",))
    tensors = load_file(other / "adapter_model.safetensors")
    tensors = {k: torch.zeros(v.shape[0] * 2, v.shape[1]) if k.endswith("lora_B.weight") else v
               for k, v in tensors.items()}
    save_file(tensors, str(other / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"'other': layers.0.self_attn.o_proj's A \(2, \d+\) and B "
                                         r"\(\d+, 2\) do not fit"):
        load_adapters({"other": other})


def test_adapters_loaded_and_unloaded_while_serving_equal_merged_weights(tiny_model_dir, adapters, reference):
    """One slot (max_loras 1) and room for one adapter in host memory: an adapter loaded into it serves as one
    loaded at start; a second finds no room while a request runs under the first (RESOURCE_EXHAUSTED), and an
    unload asked for while a sequence runs under the adapter waits for it to end (its tokens stay the adapter's)
    while new requests under it are refused at once; what the prefix cache held under an adapter is gone with it."""
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=8, num_blocks=64, block_size=16,
              max_loras=1, max_lora_rank=8)

    def generate(name: str) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(PROMPTS, _params(name), use_tqdm=False)]

    with pytest.raises(ValueError, match="'all' is not served"):
        generate("all")
    llm.load_lora("all", adapters["all"])
    assert generate("all") == reference["all"]
    with pytest.raises(ValueError, match="'all' is loaded already"):
        llm.load_lora("all", adapters["all"])
    engine, adapters_of = llm.engine, llm.engine.scheduler.adapters
    engine.add(PROMPTS[0], _params("all"), "running")
    engine.step()
    adapters_of.load("qv", adapters["qv"])  # only "all" could make room, and a request runs under it
    adapters_of.unload("all")
    with pytest.raises(ValueError, match="'all' is not served"):
        engine.add(PROMPTS[1], _params("all"), "late")
    done = _run(engine)
    assert done["running"][0] == reference["all"][0]
    assert [(o.name, o.code) for o in adapters_of.take_outcomes()] == [("qv", "RESOURCE_EXHAUSTED"), ("all", "")]
    # other weights under the name: the prefixes "all" cached before are not hit
    llm.load_lora("all", adapters["qv"])
    again = llm.generate(PROMPTS, _params("all"), use_tqdm=False)
    assert [o.token_ids for o in again] == reference["qv"]
    assert [o.usage.cached_prompt_tokens for o in again] == [0, 0, 0]
    engine.scheduler.block_manager.check([])
    llm.unload_lora("all")
    llm.load_lora("qv", adapters["qv"])
    assert generate("qv") == reference["qv"] and generate("") == reference[""]
    with pytest.raises(ValueError, match="'all' is not loaded"):
        llm.unload_lora("all")
    llm.unload_lora("qv")
    with pytest.raises(ValueError, match="'x'.*is not a PEFT adapter folder"):
        llm.load_lora("x", adapters["qv"] / "missing")
    assert adapters_of.served == [] and not adapters_of.pending
    llm.load_lora("qv", adapters["qv"])  # the failed load left the slot free
    assert generate("qv") == reference["qv"]


def test_vllms_enable_lora_gives_a_slot_for_adapters_loaded_while_serving(tiny_model_dir, adapters, reference):
    """enable_lora (the worker's --enable-lora) with no lora_modules: one slot, as vLLM's max_loras default."""
    with LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=8, num_blocks=64, block_size=16,
             max_lora_rank=8, enable_lora=True) as llm:
        llm.load_lora("qv", adapters["qv"])
        assert [o.token_ids for o in llm.generate(PROMPTS, _params("qv"), use_tqdm=False)] == reference["qv"]
        assert llm.engine.executor.runner.lora.slots == 1
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=16, block_size=16) as plain, \
            pytest.raises(ValueError, match="no LoRA slots"):
        plain.load_lora("qv", adapters["qv"])


def test_more_adapters_than_host_memory_holds_are_read_again_when_asked_for(tiny_model_dir, adapters, reference,
                                                                           tmp_path):
    """Room for one adapter in host memory (max_cpu_loras 1), as vLLM's LRU cache of adapters: loading a second drops
    the first, which a request under it then has read again from its folder, with the prefixes it cached still hit
    (the same weights); one whose folder is gone by then ends its requests, and is no longer served."""
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=8, num_blocks=64, block_size=16,
              max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    adapters_of = llm.engine.scheduler.adapters

    def generate(name: str) -> tuple[list[list[int]], list[int]]:
        outs = llm.generate(PROMPTS, _params(name), use_tqdm=False)
        return [o.token_ids for o in outs], [o.usage.cached_prompt_tokens for o in outs]

    llm.load_lora("all", adapters["all"])
    assert generate("all") == (reference["all"], [0, 0, 0])
    llm.load_lora("qv", adapters["qv"])
    assert adapters_of.served == ["all", "qv"] and adapters_of.held == {"qv"}
    assert generate("qv")[0] == reference["qv"]
    tokens, cached = generate("all")
    assert tokens == reference["all"] and cached[0] == 32 and adapters_of.num_reloads == 1
    gone = tmp_path / "gone"
    gone.mkdir()
    for f in adapters["all"].iterdir():
        (gone / f.name).write_bytes(f.read_bytes())
    llm.load_lora("gone", gone)
    assert generate("qv")[0] == reference["qv"] and adapters_of.held == {"qv"}
    for f in gone.iterdir():
        f.unlink()
    outs = llm.generate(PROMPTS, _params("gone"), use_tqdm=False)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [([], "abort")] * 3
    assert "gone" not in adapters_of.served and not adapters_of.pending
    with pytest.raises(ValueError, match="'gone' is not served"):
        llm.generate(PROMPTS, _params("gone"), use_tqdm=False)
    assert generate("all")[0] == reference["all"]
    llm.engine.scheduler.block_manager.check([])


def test_lora_modules_take_vllms_forms():
    from worker_svc.cli import lora_modules

    assert lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}']) == {
        "sql": "/a/sql", "chat": "/a/chat"}
    for bad in (["sql"], ["=/a"], ["sql=/a", "sql=/b"], ['{"name": "x"}'], ["{not json"]):
        with pytest.raises(SystemExit, match="distinct NAME=PATH pairs"):
            lora_modules(bad)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, adapters, tmp_path_factory):
    resolver = tmp_path_factory.mktemp("resolver")  # what the scheduler's LoRA resolver finds: qv under another name
    (resolver / "qv-resolved").symlink_to(adapters["qv"], target_is_directory=True)
    c = LocalCluster(tiny_model_dir, log_dir=tmp_path_factory.mktemp("lora-logs"), worker_args=[
        "--tensor-parallel-size", "2", "--dtype", "float32", "--num-blocks", "64", "--max-num-seqs", "8",
        "--max-loras", "1", "--max-cpu-loras", "3",
        "--lora-modules", *(f"{name}={path}" for name, path in adapters.items())],
        scheduler_args=["--allow-runtime-lora-updating", "--metrics-port", str(free_port()), "--lora-resolver-dir",
                        str(resolver)]).start(timeout=180)
    yield c
    c.stop()


def test_adapters_through_the_services_on_two_ranks_and_the_gateway(cluster, adapters, reference, merged, tmp_path):
    """Generations and embeddings under each adapter (by name over gRPC, by model name through the gateway), and under
    one loaded while serving: three adapters held in host memory take turns in one slot on each rank."""
    with Client(cluster.address, timeout=60) as c:
        assert c.model_info()["lora_adapters"] == ["all", "qv"]
        for name in NAMES:
            got = [c.complete(token_ids=p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, lora=name)[0]
                   for p in PROMPTS]
            assert [g.token_ids for g in got] == reference[name], name
            with torch.inference_mode():
                states = [merged[name].model(torch.tensor([p])).last_hidden_state[0, -1] for p in PROMPTS]
            for vector, state in zip(c.embed(PROMPTS, lora=name).vectors, states):
                torch.testing.assert_close(torch.tensor(vector), state / state.norm(), rtol=1e-4, atol=1e-5)
        qv_embedding = c.embed(PROMPTS[1], lora="qv").vectors[0]
        with pytest.raises(grpc.RpcError) as e:
            c.complete("hi", max_tokens=2, lora="nope")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("lora 'nope'")
        # loaded while serving: on both ranks (B split by output rows, A by input columns, as loaded at start)
        assert c.load_lora_adapter("qv again", str(adapters["qv"])) == ["all", "qv", "qv again"]
        assert [c.complete(token_ids=p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                           lora="qv again")[0].token_ids for p in PROMPTS] == reference["qv"]
        assert c.unload_lora_adapter("qv again") == ["all", "qv"]
        metrics_port = int(cluster.scheduler_args[cluster.scheduler_args.index("--metrics-port") + 1])
        assert sample(scrape(metrics_port), "splitserve:lora_slot_loads_total") == 2  # "qv", then "qv again"
    gateway = Gateway(cluster.address, tmp_path / "gateway.log").wait_healthy()
    try:
        models = httpx.get(f"{gateway.url}/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("model", None), ("all", "model"), ("qv", "model")]
        answer = httpx.post(f"{gateway.url}/v1/completions", timeout=60, json={
            "model": "qv", "prompt": PROMPTS[2], "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}).json()
        assert answer["model"] == "qv"
        embedded = httpx.post(f"{gateway.url}/v1/embeddings", timeout=60, json={"model": "qv", "input": PROMPTS[1]})
        assert embedded.json()["data"][0]["embedding"] == pytest.approx(qv_embedding, abs=1e-6)
        unknown = httpx.post(f"{gateway.url}/v1/completions", timeout=60, json={"model": "nope", "prompt": "a"})
        assert unknown.status_code == 404
    finally:
        gateway.stop()
    with Client(cluster.address, timeout=60) as c:  # the gateway's answer is qv's, not the base model's
        assert answer["choices"][0]["text"] == c.complete(token_ids=PROMPTS[2], max_tokens=MAX_NEW, temperature=0.0,
                                                          ignore_eos=True, lora="qv")[0].text


def test_an_adapter_a_request_names_is_loaded_from_the_resolver_folder(cluster, reference, tmp_path):
    """vLLM's filesystem LoRA resolver (--lora-resolver-dir): requests naming an adapter that no worker serves, whose
    folder the directory holds, have it loaded first (once, for requests that ask at once), then run under it as under
    one loaded at start, over gRPC and as the gateway's model; a name with no folder there, or one that would leave
    the directory, is refused by name (the gateway's 404)."""
    with Client(cluster.address, timeout=60) as c, concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert c.model_info()["lora_resolver"] and "qv-resolved" not in c.model_info()["lora_adapters"]
        got = list(pool.map(lambda p: c.complete(token_ids=p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                                                 lora="qv-resolved")[0], PROMPTS))
        assert [g.token_ids for g in got] == reference["qv"] and "qv-resolved" in c.model_info()["lora_adapters"]
        for name in ("nope", "../qv", "..", "qv-resolved/../../qv"):
            with pytest.raises(grpc.RpcError) as e:
                c.complete("hi", max_tokens=2, lora=name)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("lora ")
        assert c.unload_lora_adapter("qv-resolved") == ["all", "qv"]
    gateway = Gateway(cluster.address, tmp_path / "gateway.log").wait_healthy()
    try:
        def complete(model: str) -> httpx.Response:
            return httpx.post(f"{gateway.url}/v1/completions", timeout=60, json={
                "model": model, "prompt": PROMPTS[2], "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})

        answer = complete("qv-resolved").json()
        assert answer["model"] == "qv-resolved" and answer["choices"][0]["text"] == got[2].text
        unknown = complete("nope")
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model", unknown.text
        assert httpx.get(f"{gateway.url}/v1/models/nope", timeout=30).status_code == 404
    finally:
        gateway.stop()


def _wait_for(check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.1)


def test_an_adapter_loaded_through_one_front_end_serves_at_once_through_every_other(tiny_model_dir, adapters,
                                                                                      reference, tmp_path):
    """The second of two front-ends reads each table of worker groups 1.5 s late (--debug-table-delay, a test knob
    standing in for a busy process). An adapter loaded through one connection serves at once on 8 fresh ones (the
    kernel spreads connections over both front-ends): where its name is not in a front-end's table yet, it asks the
    supervisor for the table before it would refuse the name. Four loads, each on a fresh connection: on both
    front-ends, all but surely. Then the same through a gateway of two HTTP workers, each caching the model list."""
    cluster = LocalCluster(tiny_model_dir, num_workers=1, log_dir=tmp_path / "logs",
                           worker_args=["--dtype", "float32", "--num-blocks", "64", "--max-loras", "4",
                                        "--max-lora-rank", "8"],
                           scheduler_args=["--frontends", "2", "--allow-runtime-lora-updating",
                                           "--debug-table-delay", "1.5"]).start(180)
    try:
        for k in range(4):
            name = f"all-{k}"
            with Client(cluster.address, timeout=60) as c:
                assert name in c.load_lora_adapter(name, str(adapters["all"]))
            clients = [Client(cluster.address, timeout=60) for _ in range(8)]
            with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
                got = list(pool.map(lambda c: c.complete(token_ids=PROMPTS[0], max_tokens=MAX_NEW, temperature=0.0,
                                                         ignore_eos=True, lora=name)[0].token_ids, clients))
            for c in clients:
                c.close()
            assert got == [reference["all"][0]] * len(clients), name

        # the gateway's HTTP workers each cache the model list: one that has not seen a load asks again before a 404
        gateway = Gateway(cluster.address, tmp_path / "gateway.log", "--workers", "2").wait_healthy()
        try:
            for _ in range(8):  # every HTTP worker's cache filled
                assert httpx.get(f"{gateway.url}/v1/models", timeout=30).status_code == 200
            loaded = httpx.post(f"{gateway.url}/v1/load_lora_adapter", json={
                "lora_name": "via-http", "lora_path": str(adapters["all"])}, timeout=60)
            assert loaded.status_code == 200, loaded.text
            for _ in range(8):  # a connection each: both HTTP workers
                answer = httpx.post(f"{gateway.url}/v1/completions", json={
                    "model": "via-http", "prompt": PROMPTS[0], "max_tokens": MAX_NEW, "temperature": 0,
                    "ignore_eos": True}, timeout=60)
                assert answer.status_code == 200 and answer.json()["model"] == "via-http", answer.text
            unloaded = httpx.post(f"{gateway.url}/v1/unload_lora_adapter", json={"lora_name": "via-http"}, timeout=60)
            assert unloaded.status_code == 200, unloaded.text
            for _ in range(8):
                models = httpx.get(f"{gateway.url}/v1/models", timeout=30).json()["data"]
                assert "via-http" not in [m["id"] for m in models]
        finally:
            gateway.stop()
    finally:
        cluster.stop()


def test_adapters_loaded_while_serving_through_the_services_and_the_gateway(tiny_model_dir, adapters, reference,
                                                                             tmp_path):
    """Two registered workers of one slot each (a step slowed to 20 ms, so a request is in flight when asked): an
    adapter loaded at run time serves on both; a load a worker cannot make is refused for the tree; an unload waits
    for the request running under it; a worker of one slot that joins later drops what the tree unloaded (its own
    --lora-modules) to load what the tree loaded; the gateway's vLLM endpoints and the CLI do the same."""
    worker_args = ["--dtype", "float32", "--num-blocks", "64", "--max-num-seqs", "8", "--max-loras", "1",
                   "--max-lora-rank", "8", "--debug-step-delay", "0.02"]
    metrics_port = free_port()
    cluster = LocalCluster(tiny_model_dir, num_workers=2, register=True, log_dir=tmp_path / "logs",
                           worker_args=worker_args, scheduler_args=["--allow-runtime-lora-updating", "--metrics-port",
                                                                    str(metrics_port)]).start(180)
    try:
        with Client(cluster.address, timeout=60) as c:
            _wait_for(lambda: c.model_info()["num_workers"] == 2)

            def complete(name: str) -> list[list[int]]:
                return [c.complete(token_ids=p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                                   lora=name)[0].token_ids for p in PROMPTS]

            assert c.load_lora_adapter("all", str(adapters["all"])) == ["all"]
            assert complete("all") == reference["all"] and complete("") == reference[""]
            for name, path, code, text in (
                    ("all", adapters["all"], grpc.StatusCode.ALREADY_EXISTS, "'all' is loaded already"),
                    ("model", adapters["qv"], grpc.StatusCode.INVALID_ARGUMENT, "lora_name must be"),
                    ("", adapters["qv"], grpc.StatusCode.INVALID_ARGUMENT, "lora_name must be"),
                    ("x", "", grpc.StatusCode.INVALID_ARGUMENT, "lora_path must name")):
                with pytest.raises(grpc.RpcError) as e:
                    c.load_lora_adapter(name, str(path))
                assert e.value.code() == code and text in e.value.details(), (name, e.value.details())
            with pytest.raises(grpc.RpcError) as e:
                c.unload_lora_adapter("qv")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

            # a request that runs for 4 s at least (200 steps of 20 ms): the checks below happen while it runs
            stream = c.generate(token_ids=PROMPTS[0], max_tokens=200, temperature=0.0, ignore_eos=True, lora="all")
            tokens = list(next(stream).token_ids)
            samples = scrape(metrics_port)
            assert sample(samples, "splitserve:lora_requests", lora="all", state="running") == 1
            assert sample(samples, "splitserve:lora_adapters_loaded") == 2  # one on each worker
            unloaded: list[list[str]] = []
            unloading = threading.Thread(target=lambda: unloaded.append(c.unload_lora_adapter("all")))
            unloading.start()
            # both take no new request under it at once; the idle worker drops it, the other once the request ends
            _wait_for(lambda: sample(scrape(metrics_port), "splitserve:lora_adapters_loaded") == 0)
            assert c.model_info()["lora_adapters"] == ["all"]  # still held by one worker
            with pytest.raises(grpc.RpcError) as e:
                c.complete("hi", max_tokens=2, lora="all")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            # another name is not held up by the unload: the busy worker's one adapter in host memory runs the
            # request, so the load is refused at once, and unloaded again from the idle worker that took it
            with pytest.raises(grpc.RpcError) as e:
                c.load_lora_adapter("qv", str(adapters["qv"]), timeout=20)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert sample(scrape(metrics_port), "splitserve:lora_adapters_loaded") == 0
            while len(tokens) < MAX_NEW:
                tokens += next(stream).token_ids
            assert tokens[:MAX_NEW] == reference["all"][0] and not unloaded  # the unload waits for the request
            stream.close()  # cancelled: the unload goes on
            unloading.join(60)
            assert unloaded == [[]]
            with pytest.raises(grpc.RpcError) as e:
                c.complete("hi", max_tokens=2, lora="all")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            with pytest.raises(grpc.RpcError) as e:  # a folder the workers cannot read: refused by both
                c.load_lora_adapter("qv", str(tmp_path / "nowhere"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a PEFT adapter folder" in \
                e.value.details()
            assert c.load_lora_adapter("qv", str(adapters["qv"])) == ["qv"]
            assert complete("qv") == reference["qv"]

            first = list(cluster.processes[1:])  # the two workers
            cluster.start_worker(extra=["--lora-modules", f"all={adapters['all']}"])  # in its one slot
            _wait_for(lambda: c.model_info()["num_workers"] == 3)
            for worker in first:
                worker.popen.send_signal(signal.SIGTERM)
                worker.popen.wait(30)
            _wait_for(lambda: c.model_info()["num_workers"] == 1)
            assert c.model_info()["lora_adapters"] == ["qv"]  # the newcomer loaded qv and dropped its own "all"
            assert complete("qv") == reference["qv"]

        gateway = Gateway(cluster.address, tmp_path / "gateway.log").wait_healthy()
        try:
            def post(path: str, **body) -> httpx.Response:
                return httpx.post(f"{gateway.url}{path}", json=body, timeout=60)

            # the worker holds one adapter in host memory: qv makes room for "all", and is read again for a request
            answer = post("/v1/load_lora_adapter", lora_name="all", lora_path=str(adapters["all"]))
            assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'all' added successfully.")
            models = httpx.get(f"{gateway.url}/v1/models", timeout=30).json()["data"]
            assert [m["id"] for m in models] == ["model", "qv", "all"]
            for model in ("all", "qv"):
                completion = post("/v1/completions", model=model, prompt=PROMPTS[2], max_tokens=MAX_NEW,
                                  temperature=0, ignore_eos=True).json()
                assert completion["model"] == model, completion
            assert post("/v1/load_lora_adapter", lora_name="all", lora_path=str(adapters["all"])).status_code == 409
            assert post("/v1/unload_lora_adapter", lora_name="qv").text == \
                "Success: LoRA adapter 'qv' removed successfully."
            assert post("/v1/unload_lora_adapter", lora_name="qv").status_code == 404
            unknown = post("/v1/completions", model="qv", prompt="a")
            assert unknown.status_code == 404, unknown.text
        finally:
            gateway.stop()

        def splitserve(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "client.cli", *args, "--address", cluster.address],
                                  capture_output=True, text=True, timeout=120)

        assert json.loads(splitserve("unload-lora", "all").stdout) == []
        assert json.loads(splitserve("load-lora", "qv", str(adapters["qv"])).stdout) == ["qv"]
        refused = splitserve("unload-lora", "nope")
        assert refused.returncode != 0 and "NOT_FOUND" in refused.stderr and "'nope' is not loaded" in refused.stderr

        # an adapter whose folder is gone by the time a request needs it read again: that request ends UNAVAILABLE,
        # saying why, and the adapter is no longer served
        copy = tmp_path / "copy"
        shutil.copytree(adapters["all"], copy)
        with Client(cluster.address, timeout=60) as c:
            assert c.load_lora_adapter("copy", str(copy)) == ["qv", "copy"]  # qv makes room
            assert complete("qv") == reference["qv"]  # read again: "copy" makes room
            shutil.rmtree(copy)
            with pytest.raises(grpc.RpcError) as e:
                c.complete("hi", max_tokens=2, lora="copy")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and \
                "LoRA adapter 'copy' could not be read again" in e.value.details(), e.value.details()
            _wait_for(lambda: c.model_info()["lora_adapters"] == ["qv"])
            assert sample(scrape(metrics_port), "splitserve:lora_reloads_total") >= 2  # qv twice
    finally:
        cluster.stop()


def test_requests_under_an_adapter_one_worker_cannot_read_again_continue_on_another(tiny_model_dir, adapters,
                                                                                   reference, tmp_path):
    """Two workers serve "x" from folders of their own and hold one adapter in host memory: loading "qv" drops "x"
    from both. The first worker's folder is then gone: requests under "x" routed to it find it cannot read "x" again,
    leave it and finish on the other (x's tokens), and only the other serves "x" from then on."""
    folders = {w: tmp_path / w for w in "ab"}
    for folder in folders.values():
        shutil.copytree(adapters["all"], folder)
    cluster = LocalCluster(tiny_model_dir, num_workers=1, register=True, log_dir=tmp_path / "logs", worker_args=[
        "--dtype", "float32", "--num-blocks", "64", "--max-num-seqs", "8", "--max-loras", "1", "--max-lora-rank", "8",
        "--lora-modules", f"x={folders['a']}"], scheduler_args=["--allow-runtime-lora-updating", "--metrics-port",
                                                                str(metrics_port := free_port())]).start(180)
    try:
        cluster.start_worker(extra=["--lora-modules", f"x={folders['b']}"])
        with Client(cluster.address, timeout=60) as c:
            _wait_for(lambda: c.model_info()["num_workers"] == 2)
            assert c.load_lora_adapter("qv", str(adapters["qv"])) == ["x", "qv"]
            shutil.rmtree(folders["a"])
            with concurrent.futures.ThreadPoolExecutor(4) as pool:  # routed by load: both workers get some
                got = list(pool.map(lambda p: c.complete(token_ids=p, max_tokens=MAX_NEW, temperature=0.0,
                                                         ignore_eos=True, lora="x")[0].token_ids, PROMPTS * 2))
            info = c.model_info()
        assert got == reference["all"] * 2 and sorted(info["lora_adapters"]) == ["qv", "x"]
        assert sorted(w["lora_adapters"] for w in info["workers"]) == [["qv"], ["x", "qv"]]
        served = sorted(v for (name, _), v in scrape(metrics_port).items() if name == "splitserve:lora_adapters_loaded")
        assert served == [1, 2]  # qv; x and qv
        assert "LoRA adapter x could not be read again" in (cluster.log_dir / "scheduler.log").read_text()
    finally:
        cluster.stop()


def test_an_adapter_dropped_for_room_is_still_served_by_a_restarted_scheduler(tiny_model_dir, adapters, reference,
                                                                              tmp_path):
    """The worker names the adapters it dropped for room at the handshake (DescribeResponse.dropped_loras): "x", read
    at the worker's start and dropped from its host memory when "qv" was loaded while serving, is still served once
    the scheduler has been killed and started again, and read again from its folder for the requests under it."""
    cluster = LocalCluster(tiny_model_dir, log_dir=tmp_path / "logs", worker_args=[
        "--dtype", "float32", "--num-blocks", "64", "--max-num-seqs", "8", "--max-loras", "1", "--max-lora-rank", "8",
        "--lora-modules", f"x={adapters['all']}"], scheduler_args=["--allow-runtime-lora-updating"]).start(180)
    try:
        with Client(cluster.address, timeout=60) as c:
            assert c.load_lora_adapter("qv", str(adapters["qv"])) == ["x", "qv"]
        scheduler = next(p for p in cluster.processes if p.name == "scheduler")
        scheduler.popen.kill()
        scheduler.popen.wait(30)
        cluster.processes.remove(scheduler)
        cluster.start_scheduler()
        cluster.wait_ready(120)
        with Client(cluster.address, timeout=60) as c:
            assert sorted(c.model_info()["lora_adapters"]) == ["qv", "x"]
            got = [c.complete(token_ids=p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, lora="x")[0].token_ids
                   for p in PROMPTS]
        assert got == reference["all"]
    finally:
        cluster.stop()


def test_an_adapters_host_tensors_are_views_of_one_allocation():
    """LoraSlots.register's images: every part zeroed, 16-byte aligned for the copies into slots, none overlapping."""
    from worker_svc.model.lora import _host_tensors

    specs = [((3, 5), torch.bfloat16), ((7, 2), torch.float32), ((1, 1), torch.float16), ((4, 4), torch.bfloat16)]
    parts = _host_tensors(specs, pin=False)
    assert [(tuple(p.shape), p.dtype) for p in parts] == [(s, d) for s, d in specs]
    base = parts[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base and p.data_ptr() % 16 == 0 for p in parts)
    assert all(not p.any() for p in parts)
    for k, p in enumerate(parts):
        p.fill_(k + 1)
    assert all((p == k + 1).all() for k, p in enumerate(parts))  # no part wrote into another
