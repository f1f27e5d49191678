"""The model's weights read again from another checkpoint while serving (UpdateWeights, the gateway's
/update_weights_from_disk, LLM.update_weights), against transformers on each checkpoint: qwen3-tiny written with
seed 0 (A) and seed 1 (B), fp32 on CPU.
- In process (LLM): B's tokens after the update, A's again after going back, and a folder the worker cannot use
  (missing, another model, a tensor short) refused with the weights before still served.
- Through the services (`cluster`: a scheduler run with --allow-weight-updates over one registered worker slowed by
  --debug-step-delay, so that a request stays in flight): a request in flight finishes on A while the update waits
  for it; later ones run on B, through the gateway too; refusals name model_path and leave A; a worker that joins
  after the update reads B before it serves. Each completion names the weights that computed it (weight_version,
  the update's or its folder), as do the model's info and the gateway's answers.
Every wait is bounded."""
from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from client import Client
from client.launcher import LocalCluster
from offline.llm import LLM
from scheduler_svc.sampling import SamplingParams
from tests import hf_reference, sim_cluster
from tests.test_gateway import Gateway
from worker_svc.checkpoints.writer import make_model

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[(7 * i + 3 * k) % 5000 + 1 for i in range(n)] for k, n in enumerate([40, 9])]
MAX_NEW = 6
NUM_BLOCKS = 64
LONG = 48  # tokens of the request kept in flight: at STEP_DELAY_S a step, ~2.4 s
STEP_DELAY_S = 0.05
WAIT_S = 60.0
wait_for = sim_cluster.wait_for


def _greedy(hf, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def b_dir(tmp_path_factory) -> Path:
    return make_model("qwen3-tiny", tmp_path_factory.mktemp("b") / "model", seed=1)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, b_dir) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens of PROMPTS on each checkpoint, and of the first prompt for LONG tokens."""
    out = {}
    for name, folder in (("a", tiny_model_dir), ("b", b_dir)):
        hf = hf_reference.from_pretrained(folder, dtype=torch.float32)
        out[name] = [_greedy(hf, p) for p in PROMPTS]
        out[f"{name}_long"] = _greedy(hf, PROMPTS[0], LONG)
    return out


@pytest.fixture(scope="module")
def unusable(tiny_model_dir, b_dir, tmp_path_factory) -> dict[str, Path]:
    """Folders a worker cannot take B's place from: none there, another model's config, one tensor short (refused
    before any is read), a tensor of another shape (found once most were copied in: the weights before are read
    back)."""
    root = tmp_path_factory.mktemp("unusable")
    other, short, misshapen = root / "other", root / "short", root / "misshapen"
    shutil.copytree(b_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    for folder, change in ((short, "drop"), (misshapen, "transpose")):
        shutil.copytree(b_dir, folder)
        tensors = load_file(folder / "model.safetensors")
        last = max(n for n, t in tensors.items() if t.dim() == 2 and t.shape[0] != t.shape[1])
        if change == "drop":
            del tensors[last]
        else:
            tensors[last] = tensors[last].t().contiguous()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return {"missing": root / "missing", "other model": other, "a tensor short": short, "a tensor misshapen": misshapen}


def _generate(llm: LLM, n: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_llm_reads_another_checkpoints_weights_and_back(tiny_model_dir, b_dir, reference, unusable):
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=32, block_size=16, max_num_seqs=4) as llm:
        assert _generate(llm) == reference["a"]
        llm.update_weights(b_dir)
        assert _generate(llm) == reference["b"]  # the first prompt's cached blocks (A's KV) are not hit
        for why, folder in unusable.items():
            with pytest.raises(ValueError, match=f"weights from {folder}"):
                llm.update_weights(folder)
            assert _generate(llm) == reference["b"], why
        llm.update_weights(tiny_model_dir)
        assert _generate(llm) == reference["a"]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = LocalCluster(tiny_model_dir, register=True, log_dir=tmp_path_factory.mktemp("logs"), worker_args=[
        "--dtype", "float32", "--num-blocks", str(NUM_BLOCKS), "--block-size", "16", "--max-num-seqs", "8",
        "--debug-step-delay", str(STEP_DELAY_S)], scheduler_args=["--allow-weight-updates"]).start(240)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def gateway(cluster, tmp_path_factory):
    g = Gateway(cluster.address, tmp_path_factory.mktemp("gateway") / "gateway.log").wait_healthy()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.address, timeout=WAIT_S) as c:
        yield c


def _complete(c: Client, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    return c.complete(token_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True)[0].token_ids


def _versions(c: Client) -> list[str]:
    """The weight_version of each prompt's greedy completion, and of each worker in the model's info."""
    done = [c.complete(token_ids=p, max_tokens=2, temperature=0.0)[0].weight_version for p in PROMPTS]
    return done + [w["weight_version"] for w in c.model_info()["workers"]]


def test_a_request_in_flight_finishes_on_its_weights_and_later_ones_run_on_the_new(client, tiny_model_dir, b_dir,
                                                                                 reference):
    """...and carries the version of A (its folder, as no update named it), the later ones B's ("step-1")."""
    assert [_complete(client, p) for p in PROMPTS] == reference["a"]
    assert _versions(client) == [str(tiny_model_dir)] * 3
    stream = client.generate(token_ids=PROMPTS[0], max_tokens=LONG, temperature=0.0, ignore_eos=True)
    first = next(stream)  # in flight: admitted under A
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        update = pool.submit(client.update_weights, str(b_dir), weight_version="step-1")
        deltas = list(stream)
        assert first.token_ids + [t for d in deltas for t in d.token_ids] == reference["a_long"]
        assert deltas[-1].weight_version == str(tiny_model_dir)
        assert update.result(WAIT_S) == 1
    assert [_complete(client, p) for p in PROMPTS] == reference["b"]
    assert [w["weights_path"] for w in client.model_info()["workers"]] == [str(b_dir)]
    assert _versions(client) == ["step-1"] * 3
    assert client.update_weights(str(tiny_model_dir)) == 1
    assert [_complete(client, p) for p in PROMPTS] == reference["a"]
    assert _versions(client) == [str(tiny_model_dir)] * 3


def test_an_update_that_aborts_ends_the_requests_in_flight_at_once(gateway, client, tiny_model_dir, b_dir,
                                                                    reference):
    """abort_requests (SGLang's abort_all_requests): a request in flight ends at once with finish reason abort and a
    prefix of A's tokens, the update does not wait for the rest of it, and later requests run on B; the gateway's
    field does the same."""
    for via_gateway in (False, True):
        stream = client.generate(token_ids=PROMPTS[0], max_tokens=LONG, temperature=0.0, ignore_eos=True)
        deltas = [next(stream)]
        if via_gateway:
            r = httpx.post(f"{gateway.url}/update_weights_from_disk", timeout=WAIT_S,
                           json={"model_path": str(b_dir), "abort_all_requests": True})
            assert r.status_code == 200, r.text
        else:
            assert client.update_weights(str(b_dir), abort_requests=True) == 1
        deltas += list(stream)
        tokens = [t for d in deltas for t in d.token_ids]
        assert deltas[-1].finish_reason == "abort" and 0 < len(tokens) < LONG, (via_gateway, len(tokens))
        assert tokens == reference["a_long"][:len(tokens)]
        assert [_complete(client, p) for p in PROMPTS] == reference["b"]
        assert client.update_weights(str(tiny_model_dir)) == 1
        wait_for("every block back", lambda: client.model_info()["workers"][0]["free_blocks"] == NUM_BLOCKS,
                 timeout=WAIT_S)


def test_a_folder_no_worker_can_use_is_refused_naming_model_path(client, unusable, reference):
    for why, folder in unusable.items():
        with pytest.raises(grpc.RpcError) as e:
            client.update_weights(str(folder))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("model_path"), why
        assert [_complete(client, p) for p in PROMPTS] == reference["a"], why
    with pytest.raises(grpc.RpcError) as e:
        client.update_weights("")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_path" in e.value.details()


def test_the_gateways_update_weights_from_disk(gateway, client, tiny_model_dir, b_dir, reference, tmp_path):
    """SGLang's endpoint: success with the folder and the workers that read it; 400 naming model_path, as the
    gateway's other errors, where none can. The version it names is /get_weight_version's and every whole answer's
    metadata.weight_version (SGLang's)."""
    url = f"{gateway.url}/update_weights_from_disk"

    def versions() -> list[str]:
        asked = {"model": "model", "max_tokens": 2, "temperature": 0.0}
        answers = [httpx.post(f"{gateway.url}/v1/completions", json=asked | {"prompt": [PROMPTS[0]]}, timeout=WAIT_S),
                   httpx.post(f"{gateway.url}/v1/chat/completions", timeout=WAIT_S,
                              json=asked | {"messages": [{"role": "user", "content": "hi"}]}),
                   httpx.get(f"{gateway.url}/get_weight_version", timeout=WAIT_S)]
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        return [r.json()["metadata"]["weight_version"] for r in answers[:2]] + [answers[2].json()["weight_version"]]

    assert versions() == [str(tiny_model_dir)] * 3
    r = httpx.post(url, json={"model_path": str(b_dir), "weight_version": "step-7"}, timeout=WAIT_S)
    assert r.status_code == 200 and r.json() | {"message": ""} == {
        "success": True, "message": "", "model_path": str(b_dir), "num_workers": 1}
    assert [_complete(client, p) for p in PROMPTS] == reference["b"]
    assert versions() == ["step-7"] * 3
    r = httpx.post(url, json={"model_path": str(tmp_path / "none")}, timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
    r = httpx.post(url, json={"model_path": str(b_dir), "load_format": "gguf"}, timeout=WAIT_S)
    assert r.status_code == 400
    assert versions() == ["step-7"] * 3
    assert httpx.post(url, json={"model_path": str(tiny_model_dir)}, timeout=WAIT_S).status_code == 200
    assert versions() == [str(tiny_model_dir)] * 3


def test_a_worker_that_joins_after_an_update_reads_the_new_weights_first(cluster, client, b_dir, reference):
    """A worker started from A registers after the tree moved to B: its engine has it read B before it serves, so
    that with the first worker gone, B's tokens still come back. Last: it changes the cluster."""
    assert client.update_weights(str(b_dir), weight_version="b") == 1
    first = next(p for p in cluster.processes if p.name.startswith("worker"))
    joined = cluster.start_worker()
    wait_for("both workers", lambda: client.model_info()["num_workers"] == 2, timeout=WAIT_S * 2)
    first.popen.kill()
    first.popen.wait(30)
    wait_for("the first worker gone", lambda: client.model_info()["num_workers"] == 1, timeout=WAIT_S)
    assert [_complete(client, p) for p in PROMPTS] == reference["b"]
    assert [w["weights_path"] for w in client.model_info()["workers"]] == [str(b_dir)]
    assert _versions(client) == ["b"] * 3
    assert joined.log_path.read_text().count("weights read again from") == 1  # at its connect, not again after


def test_a_worker_that_can_read_neither_the_new_weights_nor_its_own_exits(cluster, client, b_dir, unusable, reference,
                                                                          tmp_path):
    """A checkpoint with a tensor misshapen, read part way, while the folder of the weights served is gone: the worker
    can serve neither, so it exits (its orchestrator starts it again from its model) rather than serve a mix; the
    call answers UNAVAILABLE. Last: it leaves the cluster without a worker."""
    served = shutil.copytree(b_dir, tmp_path / "served")
    assert client.update_weights(str(served)) == 1
    shutil.rmtree(served)
    with pytest.raises(grpc.RpcError) as e:  # refused on its names, before a tensor is read: no reading back needed
        client.update_weights(str(unusable["a tensor short"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [_complete(client, p) for p in PROMPTS] == reference["b"]
    [worker] = [p for p in cluster.processes if p.name.startswith("worker") and p.popen.poll() is None]
    with pytest.raises(grpc.RpcError) as e:
        client.update_weights(str(unusable["a tensor misshapen"]))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert worker.popen.wait(WAIT_S) == 1
    assert "the model holds neither" in worker.log_path.read_text()

def test_the_step_watchdog_gives_a_plan_that_reads_weights_the_workers_start_up_time():
    """Reading a large checkpoint takes longer than any step: the watchdog waits for such a plan as long as for a
    worker to come up (--worker-connect-timeout), and for other plans as before (--step-timeout)."""
    from types import SimpleNamespace

    from protos import worker_pb2
    from scheduler_svc.grpc_executor import GrpcExecutor, WatchConfig

    def alive_after(weights: str, seconds: float) -> bool:
        executor = GrpcExecutor("127.0.0.1:1", connect_timeout=600.0, watch=WatchConfig(step_timeout=30.0))
        executor._results = SimpleNamespace(cancel=lambda: None, done=lambda: False)  # a stream, never answering
        executor.submit(worker_pb2.StepPlan(step=1, load_weights=weights))
        alive = executor.check_progress(executor._submitted[0][0] + seconds) is None
        executor.channel.close()
        return alive

    assert [alive_after("", s) for s in (20.0, 100.0)] == [True, False]
    assert [alive_after("/ckpt", s) for s in (20.0, 100.0, 700.0)] == [True, True, False]


def test_an_update_one_worker_refuses_leaves_every_worker_on_the_weights_it_had(tmp_path):
    """Two (simulated) workers that see different folders: a checkpoint the first can read and the second cannot (its
    config is another model's to the second) is refused for the tree, and the first reads its weights before back, so
    that both serve what they served."""
    from protos import WORKER_PROTOCOL_VERSION, worker_pb2, worker_pb2_grpc

    first = sim_cluster.config_only_model(tmp_path / "first")
    second = shutil.copytree(first, tmp_path / "second")
    config = json.loads((second / "config.json").read_text())
    (second / "config.json").write_text(json.dumps({**config, "trainer_step": 0}))
    like_first = shutil.copytree(first, tmp_path / "like-first")

    def worker_weights() -> list[str]:
        paths = []
        for port in cluster.worker_ports:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                paths.append(worker_pb2_grpc.WorkerStub(channel).Describe(
                    worker_pb2.DescribeRequest(protocol_version=WORKER_PROTOCOL_VERSION), timeout=30).weights_path)
        return paths

    cluster = LocalCluster(first, worker_command="simulate", register=True, log_dir=tmp_path / "logs",
                           scheduler_args=["--allow-weight-updates"]).start(120)
    try:
        cluster.start_worker(extra=["--model", str(second)])
        with Client(cluster.address, timeout=WAIT_S) as c:
            wait_for("both workers", lambda: c.model_info()["num_workers"] == 2, timeout=WAIT_S)
            with pytest.raises(grpc.RpcError) as e:
                c.update_weights(str(like_first), weight_version="new")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "another model" in e.value.details()
            assert worker_weights() == [str(first), str(second)]
            workers = c.model_info()["workers"]
            assert sorted(w["weights_path"] for w in workers) == sorted([str(first), str(second)])
            assert sorted(w["weight_version"] for w in workers) == sorted([str(first), str(second)])
    finally:
        cluster.stop()
