"""End to end through real processes on loopback: client -> scheduler -> workers over gRPC, CPU,
project-written checkpoints.

Two clusters, each started once for the module (on first use):
- `cluster`: a scheduler over TWO workers serving qwen3-tiny (random weights), pipelining on;
- `slow`: a scheduler over ONE worker slowed by `--debug-step-delay` (every step sleeps), serving a
  qwen3-tiny variant whose every next token is EOS. The slow-down keeps a long request in flight
  for tens of seconds, so cancelling and deadlines are tested without racing a fast model; the EOS
  model makes end-of-sequence behaviour observable.
Assertions are on states and counters (finish reasons, token counts, per-worker block and request
counters from GetModelInfo), never on timings; every wait is bounded.
"""
from __future__ import annotations


import asyncio
import functools
import json
from pathlib import Path
import random
import subprocess
import sys

import grpc
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from client import AsyncClient, Client
from client.client import CompletionCollector
from client.launcher import LocalCluster
from scheduler_svc.sampling import generation_defaults
from scheduler_svc.tokenizer import load_tokenizer
from tests import sim_cluster
from worker_svc.checkpoints.writer import make_model

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 16
NUM_BLOCKS = 64
# Small pools so the module stays cheap; the scheduler must size its batches to what workers report.
WORKER_ARGS = ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "24",
               "--max-num-batched-tokens", "1024"]
STEP_DELAY_S = 0.05
LONG = 500  # tokens: at STEP_DELAY_S a step, at least 25 s of generation
FREED_S = 10.0  # bound on freeing a cancelled request's blocks: a step, with a wide margin
EOS = 151645  # <|im_end|>, the first of the checkpoint's EOS ids
WAIT_S = 30.0


def _start(model_dir: Path, log_dir: Path, num_workers: int, worker_args: list[str]) -> LocalCluster:
    return LocalCluster(model_dir, num_workers=num_workers, worker_args=worker_args,
                        scheduler_args=sim_cluster.TREE_ARGS,
                        log_dir=log_dir).start(timeout=240)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = _start(tiny_model_dir, tmp_path_factory.mktemp("cluster-logs"), 2, WORKER_ARGS)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory) -> Path:
    """qwen3-tiny-untied with one embedding for every token, so every position computes the same final
    hidden state h whatever the prompt; the LM-head row of EOS is set along h, so EOS is always the
    overwhelming next token."""
    d = make_model("qwen3-tiny-untied", tmp_path_factory.mktemp("eos-model") / "model", seed=3)
    path = d / "model.safetensors"
    weights = load_file(path)
    emb = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = emb[:1].expand_as(emb).contiguous()
    save_file(weights, str(path), metadata={"format": "pt"})
    hf = transformers.Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.inference_mode():
        h = hf.model(torch.tensor([[1, 2, 3]])).last_hidden_state[0, -1]
    weights["lm_head.weight"][EOS] = 50.0 * h / h.norm()
    save_file(weights, str(path), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def slow(eos_model_dir, tmp_path_factory):
    c = _start(eos_model_dir, tmp_path_factory.mktemp("slow-logs"), 1,
               WORKER_ARGS + ["--debug-step-delay", str(STEP_DELAY_S)])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.address, timeout=WAIT_S * 4) as c:
        # the cluster serves once one worker is up; the tests here want both (the second may still be
        # loading on a busy machine)
        sim_cluster.wait_for("both workers connected",
                             lambda: sum(w["alive"] for w in c.model_info()["workers"]) == 2, timeout=WAIT_S * 4)
        yield c


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return transformers.Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


# the bound of this module's functional waits
wait_for = functools.partial(sim_cluster.wait_for, timeout=WAIT_S, interval=0.02)


def workers(c: Client) -> list[dict]:
    return c.model_info()["workers"]


def all_idle(c: Client) -> bool:
    """Every worker's blocks free (cached-but-free blocks count as free) and nothing running or queued."""
    return all(w["free_blocks"] == w["num_blocks"] and w["num_running"] == 0 and w["num_waiting"] == 0
               for w in workers(c))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S * 4))


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 150000) for _ in range(n)]


# --- model info --------------------------------------------------------------------------------------------


def test_model_info_reports_every_worker(client, cluster):
    info = client.model_info()
    assert info["num_workers"] == 2 and info["block_size"] == BLOCK_SIZE and info["max_model_len"] == 512
    assert info["dtype"] == "float32" and info["eos_token_ids"] == [151645, 151643]
    assert sorted(w["address"] for w in info["workers"]) == sorted(f"127.0.0.1:{p}" for p in cluster.worker_ports)
    for w in info["workers"]:
        assert w["alive"] and w["num_blocks"] == NUM_BLOCKS
    with pytest.raises(grpc.RpcError) as e:  # a scheduler without --allow-runtime-lora-updating
        client.load_lora_adapter("more", "/anywhere")
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--allow-runtime-lora-updating" in e.value.details()


# --- correctness ---------------------------------------------------------------------------------------------


def test_logit_bias_is_transformers_sequence_bias(client, cluster, hf):
    """Greedy with logit_bias equals transformers' generate with the same single-token sequence_bias, while an
    unbiased request in the same batches gets exactly its own tokens."""
    rng = random.Random(3)
    prompts = [random_ids(rng, n) for n in (5, 23)]
    free, own = hf_greedy(hf, prompts[1], 12), hf_greedy(hf, prompts[0], 12)
    bias = {own[0]: -30.0, own[3]: -5.0, 1234: 4.0, 151000: 7.5}
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                          pad_token_id=0, sequence_bias={(t,): b for t, b in bias.items()})
    want = out[0, len(prompts[0]):].tolist()
    assert want != own  # the bias changes the output

    async def main():
        async with AsyncClient(cluster.address, timeout=WAIT_S * 4) as ac:
            return await asyncio.gather(
                ac.complete(token_ids=prompts[0], max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias=bias),
                ac.complete(token_ids=prompts[1], max_tokens=12, temperature=0.0, ignore_eos=True))

    (biased,), (unbiased,) = run(main())
    assert biased.token_ids == want and unbiased.token_ids == free


def test_concurrent_greedy_equals_transformers(client, cluster, hf, tok):
    """8 prompts (text and token ids, up to 3 blocks long) sent at once, spread over both workers,
    pipelining on: token for token what transformers' generate gives on the same checkpoint."""
    rng = random.Random(8)
    texts = ["The capital of France is", "def fibonacci(n):", "日本語のテキスト", "Once upon a time, in a"]
    prompts: list[dict] = [{"prompt": t} for t in texts]
    prompts += [{"token_ids": random_ids(rng, n)} for n in (1, 17, 40, 9)]
    max_new = 24

    async def main():
        async with AsyncClient(cluster.address, timeout=WAIT_S * 4) as ac:
            return await asyncio.gather(*[ac.complete(**p, max_tokens=max_new, temperature=0.0, ignore_eos=True)
                                          for p in prompts])

    results = run(main())
    for p, (completion,) in zip(prompts, results):
        ids = p["token_ids"] if "token_ids" in p else tok.encode(p["prompt"])
        assert completion.token_ids == hf_greedy(hf, ids, max_new), p
        assert completion.finish_reason == "length"
        assert completion.usage.prompt_tokens == len(ids) and completion.usage.completion_tokens == max_new
        assert completion.text == tok.decode(completion.token_ids)
    wait_for("all blocks free", lambda: all_idle(client))


def _mixed_params(i: int) -> dict:
    rng = random.Random(1000 + i)
    params: dict = {"max_tokens": rng.randint(1, 24), "temperature": rng.choice([0.0, 0.6, 1.0, 1.5])}
    if rng.random() < 0.5:
        params["prompt"] = f"Stream {i}: " + " ".join(rng.choice(["red", "fox", "jumps", "über", "水"])
                                                      for _ in range(rng.randint(1, 30)))
    else:
        params["token_ids"] = random_ids(rng, rng.randint(1, 60))
    for name, choices in (("top_p", [0.9, 0.5]), ("top_k", [1, 5, 50]), ("seed", [i, 7]),
                          ("stop", [["e"], ["a", "o"], ["the", "水"]]), ("logprobs", [0, 3])):
        if rng.random() < 0.4:
            params[name] = rng.choice(choices)
    params["ignore_eos"] = rng.random() < 0.5
    if i % 5 == 0:
        params["n"] = 2
    return params


def test_64_concurrent_mixed_streams_complete_and_free_every_block(client, cluster, tok):
    streams = [_mixed_params(i) for i in range(64)]

    async def main():
        async with AsyncClient(cluster.address, timeout=WAIT_S * 4) as ac:
            return await asyncio.gather(*[ac.complete(**p) for p in streams])

    results = run(main())
    for p, completions in zip(streams, results):
        assert [c.index for c in completions] == list(range(p.get("n", 1))), p
        for c in completions:
            n_tokens = len(c.token_ids)
            assert c.usage.completion_tokens == n_tokens, p
            assert c.usage.prompt_tokens == len(p.get("token_ids") or tok.encode(p["prompt"]))
            assert c.finish_reason in ("stop", "length"), p
            if c.finish_reason == "length":
                assert n_tokens == p["max_tokens"]
                assert c.stop_reason is None
            else:
                assert 1 <= n_tokens <= p["max_tokens"]
                # a stop string, or a stop token (EOS, unless ignored)
                assert c.stop_reason in p.get("stop", []) or (
                    not p["ignore_eos"] and c.token_ids[-1] == int(c.stop_reason) in (151645, 151643)), (p, c)
            for s in p.get("stop", []):
                assert s not in c.text, (p, c)
            if "stop" not in p and c.finish_reason == "length":
                assert c.text == tok.decode(c.token_ids)
            if "logprobs" in p:
                assert len(c.logprobs) == n_tokens
                assert all(lp <= 0 and len(top) == p["logprobs"] for lp, top in c.logprobs)
            else:
                assert c.logprobs is None
    # At least some stop strings fired, so the stop path ran under load too.
    assert any(c.finish_reason == "stop" for cs in results for c in cs)
    wait_for("every block of every worker free", lambda: all_idle(client))


# --- cancellation and deadlines (slowed worker) -------------------------------------------------------------
# A request of LONG tokens needs at least LONG x STEP_DELAY_S = 25 s of steps; its blocks must come back
# well before it could have finished (FREED_S), and the scheduler must log it as cancelled, not done.


def _in_flight(c: Client) -> dict:
    (w,) = workers(c)
    assert w["num_running"] == 1 and w["free_blocks"] < w["num_blocks"], w
    return w


def _request_log(cluster: LocalCluster, request_id: str) -> str:
    """The scheduler's one log line for the request, once written."""
    marker = f"request {request_id}: "
    log = cluster.log_dir / "scheduler.log"
    return wait_for(f"log line of {request_id}",
                    lambda: next((ln for ln in log.read_text().splitlines() if marker in ln), None))


def test_cancelled_stream_frees_its_blocks_and_serving_goes_on(slow):
    with Client(slow.address, timeout=WAIT_S * 4) as c:
        before = workers(c)[0]["num_requests"]
        stream = c.generate(token_ids=[1, 2, 3, 4, 5], max_tokens=LONG, temperature=0.0, ignore_eos=True,
                            request_id="cancel-sync")
        first = next(stream)
        assert first.finish_reason is None and set(first.token_ids) == {EOS}
        _in_flight(c)
        stream.close()  # cancels the call
        wait_for("blocks of the cancelled request free", lambda: all_idle(c), timeout=FREED_S)
        assert "cancelled" in _request_log(slow, "cancel-sync")
        (done,) = c.complete(token_ids=[1, 2, 3], max_tokens=3, ignore_eos=True, temperature=0.0)
        assert done.finish_reason == "length" and done.token_ids == [EOS] * 3
        assert workers(c)[0]["num_requests"] == before + 2


def test_reset_prefix_cache_keeps_the_blocks_a_running_request_holds(slow):
    prompt = list(range(1, 3 * BLOCK_SIZE + 2))
    with Client(slow.address, timeout=WAIT_S * 4) as c:
        stream = c.generate(token_ids=prompt, max_tokens=LONG - len(prompt), temperature=0.0, ignore_eos=True)
        next(stream)
        c.reset_prefix_cache()
        (hit,) = c.complete(token_ids=prompt, max_tokens=1, ignore_eos=True)
        assert hit.usage.cached_prompt_tokens == 3 * BLOCK_SIZE  # still held by the running request
        stream.close()
        wait_for("blocks of the cancelled request free", lambda: all_idle(c), timeout=FREED_S)
        assert c.reset_prefix_cache() >= 3
        (cold,) = c.complete(token_ids=prompt, max_tokens=1, ignore_eos=True)
        assert cold.usage.cached_prompt_tokens == 0


def test_cancelled_async_task_frees_its_blocks(slow):
    async def main():
        async with AsyncClient(slow.address, timeout=WAIT_S * 4) as ac:
            started = asyncio.Event()

            async def consume():
                async for _ in ac.generate(token_ids=[9, 8, 7], max_tokens=LONG, ignore_eos=True,
                                           request_id="cancel-async"):
                    started.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(started.wait(), WAIT_S)
            with Client(slow.address) as c:
                _in_flight(c)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(main())
    with Client(slow.address) as c:
        wait_for("blocks of the cancelled task free", lambda: all_idle(c), timeout=FREED_S)
    assert "cancelled" in _request_log(slow, "cancel-async")


def test_passed_deadline_is_deadline_exceeded_and_frees_blocks(slow):
    with Client(slow.address) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete(token_ids=[4, 5, 6], max_tokens=LONG, ignore_eos=True, timeout=1.0, request_id="deadline")
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for("blocks of the expired request free", lambda: all_idle(c), timeout=FREED_S)
    assert "cancelled" in _request_log(slow, "deadline")


def test_an_embed_call_past_its_deadline_frees_every_inputs_blocks(slow):
    """24 inputs of 200 tokens take the slowed worker at least 5 steps (its pool holds 1,024 tokens); with a 0.15 s
    deadline the call ends DEADLINE_EXCEEDED and the blocks of every input, embedded, running or queued, come
    back. Then two of them with time enough: one vector each."""
    inputs = [[(7 * i + j) % 1000 for j in range(200)] for i in range(24)]
    with Client(slow.address) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.embed(inputs, timeout=0.15)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for("blocks of the expired embeddings free", lambda: all_idle(c), timeout=FREED_S)
        done = c.embed(inputs[:2], timeout=WAIT_S)
    assert [len(v) for v in done.vectors] == [64, 64] and done.prompt_tokens == [200, 200]


# --- EOS, ignore_eos, min_tokens (the EOS model on the slowed worker) -------------------------------------


def test_eos_stops_unless_ignored(slow):
    with Client(slow.address, timeout=WAIT_S * 4) as c:
        (eos,) = c.complete(token_ids=[1, 2, 3], max_tokens=8, temperature=0.0)
        assert (eos.token_ids, eos.text, eos.finish_reason, eos.stop_reason) == ([EOS], "", "stop", str(EOS))
        assert eos.usage.completion_tokens == 1
        (sampled,) = c.complete("Hi", max_tokens=8, temperature=1.0, seed=1)
        assert sampled.token_ids == [EOS] and sampled.finish_reason == "stop"
        (ignored,) = c.complete(token_ids=[1, 2, 3], max_tokens=5, temperature=0.0, ignore_eos=True)
        assert (ignored.token_ids, ignored.text, ignored.finish_reason) == ([EOS] * 5, "", "length")
        (at_least,) = c.complete(token_ids=[1, 2, 3], max_tokens=8, min_tokens=3, temperature=0.0)
        assert (at_least.token_ids, at_least.finish_reason) == ([EOS] * 3, "stop")
        (special,) = c.complete(token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True, skip_special_tokens=False)
        assert special.text == "<|im_end|>" * 2


# --- routing over two workers -----------------------------------------------------------------------------


def _requests_per_worker(c: Client) -> dict[str, int]:
    return {w["address"]: w["num_requests"] for w in workers(c)}


def test_load_spreads_over_both_workers(client, cluster):
    before = _requests_per_worker(client)
    rng = random.Random(16)

    async def main():
        async with AsyncClient(cluster.address, timeout=WAIT_S * 4) as ac:
            return await asyncio.gather(*[ac.complete(token_ids=random_ids(rng, 12), max_tokens=8,
                                                      ignore_eos=True) for _ in range(16)])

    results = run(main())
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for (c,) in results)
    after = _requests_per_worker(client)
    routed = {a: after[a] - before[a] for a in after}
    assert sum(routed.values()) == 16
    # Requests routed but not yet admitted count as load: a burst does not pile onto one worker.
    assert min(routed.values()) >= 4, routed


def test_shared_prefix_goes_to_the_worker_that_caches_it(client, cluster, hf):
    """Two long prompts sent together land on different workers; then requests extending either one go
    to the worker holding its blocks (not simply the first worker) and report the hit in usage."""
    rng = random.Random(77)
    prefixes = [random_ids(rng, 5 * BLOCK_SIZE + 3) for _ in range(2)]

    async def both():
        async with AsyncClient(cluster.address, timeout=WAIT_S * 4) as ac:
            # long enough to overlap however loaded the box: the second is routed while the first holds its worker
            return await asyncio.gather(*[ac.complete(token_ids=p, max_tokens=48, ignore_eos=True)
                                          for p in prefixes])

    before = _requests_per_worker(client)
    firsts = run(both())
    assert all(c.usage.cached_prompt_tokens == 0 for (c,) in firsts)
    after = _requests_per_worker(client)
    assert all(after[a] == before[a] + 1 for a in after), "the two prompts went to one worker"
    homes: list[set[str]] = [set(), set()]
    for k in range(6):
        which = k % 2
        prompt = prefixes[which] + random_ids(rng, 2 + k)
        before = _requests_per_worker(client)
        (c,) = client.complete(token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        after = _requests_per_worker(client)
        homes[which] |= {a for a in after if after[a] > before[a]}
        assert c.usage.cached_prompt_tokens == 5 * BLOCK_SIZE, k
        if k < 2:  # the cached blocks hold the right KV
            assert c.token_ids == hf_greedy(hf, prompt, 6)
    assert len(homes[0]) == len(homes[1]) == 1 and homes[0] != homes[1], homes


def test_weights_are_read_again_only_where_the_scheduler_allows_it(client, tiny_model_dir):
    """UpdateWeights without --allow-weight-updates: PERMISSION_DENIED, whatever the folder (test_weight_updates.py
    has the scheduler that allows it)."""
    with pytest.raises(grpc.RpcError) as e:
        client.update_weights(str(tiny_model_dir))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--allow-weight-updates" in e.value.details()
    assert all(w["weights_path"] == str(tiny_model_dir) for w in client.model_info()["workers"])


def test_reset_prefix_cache_drops_every_cached_prefix(client, hf):
    """ResetPrefixCache (vLLM's /reset_prefix_cache): a prompt whose blocks its worker caches is computed whole after
    it, to the same tokens, and the cache fills again from there."""
    prompt = random_ids(random.Random(78), 3 * BLOCK_SIZE + 1)
    client.complete(token_ids=prompt, max_tokens=2, ignore_eos=True)
    (hit,) = client.complete(token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert hit.usage.cached_prompt_tokens == 3 * BLOCK_SIZE
    assert client.reset_prefix_cache() >= 3
    (cold,) = client.complete(token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert cold.usage.cached_prompt_tokens == 0
    assert cold.token_ids == hit.token_ids == hf_greedy(hf, prompt, 4)
    (hit,) = client.complete(token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert hit.usage.cached_prompt_tokens == 3 * BLOCK_SIZE


# --- stopping and sampling parameters ------------------------------------------------------------------------


def test_generation_defaults_are_the_sampling_fields_generation_config_sets(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_k": 20, "max_new_tokens": 100, "eos_token_id": 2}))
    assert generation_defaults(tmp_path) == {"temperature": 0.7, "top_k": 20, "max_tokens": 100}
    assert generation_defaults(tmp_path, "vllm") == {}
    assert generation_defaults(tmp_path / "none") == {}  # a checkpoint without the file
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json: .*temperature"):
        generation_defaults(tmp_path)
    with pytest.raises(ValueError, match="--generation-config hf: no generation_config.json there"):
        generation_defaults(tmp_path, "hf")


def test_generation_defaults_from_a_folder_and_overrides(tmp_path):
    """vLLM's --generation-config FOLDER and --override-generation-config (over the file, or alone with vllm)."""
    model, other = tmp_path / "model", tmp_path / "other"
    for folder, config in ((model, {"temperature": 0.6, "top_p": 0.95}), (other, {"temperature": 0.3, "top_k": 5})):
        folder.mkdir()
        (folder / "generation_config.json").write_text(json.dumps(config))
    assert generation_defaults(model, str(other)) == {"temperature": 0.3, "top_k": 5}
    assert generation_defaults(model, "auto", {"temperature": 0.9, "max_new_tokens": 64}) == {
        "temperature": 0.9, "top_p": 0.95, "max_tokens": 64}
    assert generation_defaults(model, "vllm", {"top_k": 7}) == {"top_k": 7}
    with pytest.raises(ValueError, match="--override-generation-config: do_sample are not among"):
        generation_defaults(model, "auto", {"do_sample": True})
    with pytest.raises(ValueError, match="with --override-generation-config: .*top_p"):
        generation_defaults(model, "auto", {"top_p": 2})
    with pytest.raises(ValueError, match=f"--generation-config {tmp_path}: no generation_config.json"):
        generation_defaults(model, str(tmp_path))


def test_unset_sampling_fields_take_the_models_generation_config(client):
    """vLLM's --generation-config auto (the default): a request that leaves temperature, top_p and top_k unset samples
    with generation_config.json's (0.6, 0.95 and 20 in these checkpoints, Qwen3's), one that sets them with its own."""
    kw = dict(token_ids=random_ids(random.Random(79), 12), max_tokens=24, ignore_eos=True, seed=5)
    (unset,) = client.complete(**kw)
    (models,) = client.complete(**kw, temperature=0.6, top_p=0.95, top_k=20)
    (ours,) = client.complete(**kw, temperature=1.0, top_p=1.0, top_k=0)
    assert unset.token_ids == models.token_ids != ours.token_ids


def test_stop_strings_and_max_tokens(client, tok):
    prompt = "A list of things:"
    (full,) = client.complete(prompt, max_tokens=20, temperature=0.0, ignore_eos=True)
    assert full.finish_reason == "length" and len(full.token_ids) == 20 and full.stop_reason is None
    # A stop string from the middle of the greedy text: the text ends right before it.
    text = full.text
    start = len(tok.decode(full.token_ids[:8]))
    stop = text[start:start + 3]
    assert len(stop) == 3 and stop not in text[:start]
    (stopped,) = client.complete(prompt, max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop, "\x00never"])
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[:text.index(stop)]
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)]
    assert len(stopped.token_ids) < 20 and stopped.usage.completion_tokens == len(stopped.token_ids)
    # A stop token: generated, counted, not in the text.
    tid = full.token_ids[5]
    (by_token,) = client.complete(prompt, max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[tid])
    cut = full.token_ids.index(tid) + 1
    assert (by_token.token_ids, by_token.finish_reason, by_token.stop_reason) == (full.token_ids[:cut], "stop",
                                                                                   str(tid))
    # max_tokens
    (short,) = client.complete(prompt, max_tokens=3, temperature=0.0, ignore_eos=True)
    assert short.token_ids == full.token_ids[:3] and short.finish_reason == "length"


def test_seeds(client, cluster):
    kw = {"max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    (a,) = client.complete("Tell me a story", seed=42, **kw)
    (b,) = client.complete("Tell me a story", seed=42, **kw)
    (c,) = client.complete("Tell me a story", seed=43, **kw)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert c.token_ids != a.token_ids

    async def under_load():  # the same seed gives the same tokens whatever else is in the batch
        async with AsyncClient(cluster.address, timeout=WAIT_S * 4) as ac:
            others = [ac.complete(f"noise {i}", max_tokens=16, temperature=1.0) for i in range(6)]
            return (await asyncio.gather(ac.complete("Tell me a story", seed=42, **kw), *others))[0]

    (d,) = run(under_load())
    assert d.token_ids == a.token_ids


def test_n_completions(client):
    rng = random.Random(5)
    prompt = random_ids(rng, 2 * BLOCK_SIZE + 5)
    kw = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True, "seed": 5}
    completions = client.complete(token_ids=prompt, n=3, **kw)
    assert [c.index for c in completions] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) == 3, "seeded completions must differ"
    (single,) = client.complete(token_ids=prompt, **kw)
    assert single.token_ids == completions[0].token_ids
    again = client.complete(token_ids=prompt, n=3, **kw)
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]  # reproducible
    # The later completions hit the blocks the first computed.
    assert all(c.usage.cached_prompt_tokens == 2 * BLOCK_SIZE for c in completions[1:])


def test_stream_interval_joins_tokens_into_fewer_messages(client):
    """1: a message per token; 4: messages of 4 tokens and the rest at the end; 0: one message per
    completion (tokens that arrived together may share a message). The tokens, text, logprobs and finish are the same
    whatever the interval."""
    kw = {"max_tokens": 10, "temperature": 1.0, "ignore_eos": True, "seed": 9, "logprobs": 1, "n": 2}

    def run_with(interval):
        deltas = list(client.generate("Count with me", stream_interval=interval, **kw))
        sizes = {i: [len(d.token_ids) for d in deltas if d.index == i] for i in (0, 1)}
        collector = CompletionCollector()
        for d in deltas:
            collector.add(d)
        return sizes, collector.completions()

    # A front-end that finds several tokens of a stream waiting at once (a busy machine) sends them together, so
    # message sizes are lower bounds: at least one token, at least 4 but for the last, all at once.
    sizes, streamed = run_with(None)
    assert all(sum(s) == 10 and min(s) >= 1 for s in sizes.values()), sizes
    sizes, by_four = run_with(4)
    assert all(sum(s) == 10 and len(s) <= 3 and min(s[:-1], default=4) >= 4 for s in sizes.values()), sizes
    sizes, whole = run_with(0)
    assert sizes == {0: [10], 1: [10]}
    for completions in (by_four, whole, client.complete("Count with me", **kw)):
        for a, b in zip(completions, streamed):
            assert (a.token_ids, a.text, a.finish_reason, a.usage) == (b.token_ids, b.text, b.finish_reason, b.usage)
            # the same tokens; logprobs up to float noise (a rerun hits the prompt's cached blocks)
            assert [lp[0] for lp in a.logprobs] == pytest.approx([lp[0] for lp in b.logprobs], abs=1e-4)


def test_token_id_and_chat_prompts_and_their_truncation(client, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    rendered = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    assert client.tokenize(messages=messages) == rendered
    no_think = client.tokenize(messages=messages, enable_thinking=False)
    assert no_think != rendered and "<think>" in tok.decode(no_think, skip_special_tokens=False)
    kw = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    # the template's keyword arguments as JSON: the same switch, and one this template does not read
    assert client.tokenize(messages=messages, chat_template_kwargs={"enable_thinking": False}) == no_think
    assert client.tokenize(messages=messages, chat_template_kwargs={"reasoning_effort": "low"}) == rendered
    # an assistant's answer started by the client, continued
    started = [*messages, {"role": "assistant", "content": "It is"}]
    want = tok.encode(tok.apply_chat_template(started, add_generation_prompt=False, continue_final_message=True),
                      add_special_tokens=False)
    assert client.tokenize(messages=started, continue_final_message=True) == want
    with pytest.raises(grpc.RpcError) as e:  # a request's own template, where the scheduler does not trust them
        client.complete(messages=messages, chat_template="{{ messages[0].content }}", **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("prompt.chat.chat_template") and "--trust-request" in e.value.details()
    (cont,) = client.complete(messages=started, continue_final_message=True, **kw)
    (cont_ids,) = client.complete(token_ids=want, **kw)
    assert cont.token_ids == cont_ids.token_ids
    (chat,) = client.complete(messages=messages, **kw)
    (ids,) = client.complete(token_ids=rendered, **kw)
    assert chat.token_ids == ids.token_ids and chat.usage.prompt_tokens == len(rendered)
    (chat_nt,) = client.complete(messages=messages, enable_thinking=False, **kw)
    assert chat_nt.usage.prompt_tokens == len(no_think)
    # truncate_prompt_tokens: the chat prompt's last 9 tokens, as if they had been sent
    (cut,) = client.complete(messages=messages, truncate_prompt_tokens=9, **kw)
    (cut_ids,) = client.complete(token_ids=rendered[-9:], **kw)
    assert cut.token_ids == cut_ids.token_ids and cut.usage.prompt_tokens == 9


# --- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": "hi", "temperature": -1.0}, "temperature"),
    ({"prompt": "hi", "top_p": 0.0}, "top_p"),
    ({"prompt": ""}, "prompt.text"),
    ({"token_ids": [151936]}, "prompt.token_ids"),
    ({"prompt": "hi", "max_tokens": 600}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"messages": [{"role": "robot", "content": "beep"}]}, "role"),
    ({"prompt": "hi", "stop_token_ids": [10**6]}, "stop_token_ids"),
])
def test_bad_input_is_invalid_argument_naming_the_field(client, kwargs, field):
    with pytest.raises(grpc.RpcError) as e:
        client.complete(**kwargs)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_prompt_logprobs_equal_transformers_log_softmax(client, cluster, hf):
    """prompt_logprobs through client -> scheduler -> worker: every prompt token after the first, with its top 3,
    equal to transformers' log-softmax within 1e-4, for a long prompt and for one whose prefix another request
    just cached (computed again: the cache is not used for it). Chunks: test_model's worker test."""
    rng = random.Random(21)
    shared = random_ids(rng, 48)
    first = client.complete(token_ids=shared + random_ids(rng, 5), max_tokens=2, temperature=0.0)
    assert first[0].prompt_logprobs is None  # not asked
    for prompt in (random_ids(rng, 300), shared + random_ids(rng, 9)):
        (c,) = client.complete(token_ids=prompt, max_tokens=2, temperature=0.0, prompt_logprobs=3)
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert len(c.prompt_logprobs) == len(prompt) - 1
        for p, (value, top) in enumerate(c.prompt_logprobs):
            assert abs(value - ref[p, prompt[p + 1]].item()) < 1e-4
            best = ref[p].topk(3)
            assert [t for t, _ in top] == best.indices.tolist()
            assert max(abs(lp - want) for (_, lp), want in zip(top, best.values.tolist())) < 1e-4
        assert c.usage.cached_prompt_tokens == 0
    wait_for("all blocks free", lambda: all_idle(client))


def test_a_process_start_up_leaves_its_heap_out_of_the_collectors_walks():
    """common.util.freeze_heap, which the worker, the engines, the front-ends and the gateway call once started:
    what was alive then is frozen, so a full collection walks only what came after."""
    code = ("import gc; from common.util import freeze_heap; keep = [[i] for i in range(100_000)]; freeze_heap(); "
            "late = [[i] for i in range(10)]; print(gc.get_freeze_count() >= 100_000, len(gc.get_objects()) < 10_000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["True", "True"]
