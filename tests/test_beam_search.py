"""Beam search (GenerateRequest.use_beam_search, vLLM's use_beam_search): the algorithm on a toy model, then through
client -> scheduler -> worker on qwen3-tiny against the same search run over transformers' own logprobs, and the
gateway's use_beam_search; what beam search cannot honour is refused by name."""
from __future__ import annotations

import asyncio
import math
import time

import grpc
import httpx
import pytest
import torch
import transformers

from client import Client
from client.launcher import LocalCluster
from scheduler_svc.beam_search import beam_search
from tests.test_gateway import Gateway

pytestmark = pytest.mark.timeout(300)

EOS = 0
PROMPTS = [[5, 6, 7] * 5, [11, 12, 13, 14], [(17 * i) % 900 + 3 for i in range(23)]]


def _toy(table: dict[tuple[int, ...], list[tuple[int, float]]]):
    """next_tokens of a toy model: the next tokens' logprobs after each generated prefix (the prompt is [1])."""
    async def next_tokens(prompts: list[list[int]], k: int) -> list[list[tuple[int, float]]]:
        return [sorted(table[tuple(p[1:])], key=lambda t: -t[1])[:k] for p in prompts]
    return next_tokens


def test_the_best_beams_by_logprob_over_length_an_eos_completes_one():
    lp = math.log
    table = {(): [(2, lp(0.5)), (3, lp(0.4)), (4, lp(0.1))],
             (2,): [(EOS, lp(0.6)), (5, lp(0.2)), (6, lp(0.2))],
             (3,): [(7, lp(0.9)), (8, lp(0.1))],
             (4,): [(9, lp(1.0))],
             (2, 5): [(1, lp(1.0))], (2, 6): [(1, lp(1.0))], (3, 7): [(1, lp(1.0))], (3, 8): [(1, lp(1.0))]}
    beams = asyncio.run(beam_search(_toy(table), [1], 2, 2, {EOS}))
    # (3, 7): 0.36 over 3 tokens; (2,) then EOS: 0.30 over 2 (the EOS uncounted); (2, 5) 0.1, (2, 6) 0.1
    assert [(b.tokens, b.finish_reason) for b in beams] == [([3, 7], "length"), ([2], "stop")]
    assert beams[0].logprob == pytest.approx(lp(0.36)) and beams[1].stop_token == EOS
    # ignoring EOS, (2, EOS) runs on as any other beam
    ignoring = asyncio.run(beam_search(_toy(table), [1], 2, 2, {EOS}, ignore_eos=True))
    assert [(b.tokens, b.finish_reason) for b in ignoring] == [([3, 7], "length"), ([2, EOS], "length")]
    # one beam: (3,) is pruned after the first step (0.4 < 0.5), then (2,) ending at once beats (2, 5)
    assert [b.tokens for b in asyncio.run(beam_search(_toy(table), [1], 1, 2, {EOS}))] == [[2]]
    # a score is the logprob over the length (prompt included) to the power length_penalty: the empty answer (EOS at
    # once, 0.1 over 1 token) loses to (2, 5) (0.45 over 3) at 1 and 0, wins at -3 (0.45 times 27 is lower)
    short = {(): [(2, lp(0.9)), (EOS, lp(0.1))], (2,): [(5, lp(0.5)), (6, lp(0.5))]}
    for penalty, best in ((1.0, [2, 5]), (0.0, [2, 5]), (-3.0, [])):
        assert asyncio.run(beam_search(_toy(short), [1], 1, 2, {EOS}, length_penalty=penalty))[0].tokens == best


def _reference(hf, prompt: list[int], width: int, max_tokens: int, eos: set[int]) -> list[list[int]]:
    """The same search over transformers' logprobs (fp32), written out here on its own: the beams' tokens."""
    return [tokens for tokens, _ in _reference_beams(hf, prompt, width, max_tokens, eos)]


def _reference_beams(hf, prompt: list[int], width: int, max_tokens: int,
                     eos: set[int]) -> list[tuple[list[int], float]]:
    """_reference's beams with their summed logprobs."""
    def score(tokens: list[int], logprob: float) -> float:
        return logprob / (len(prompt) + len(tokens))

    beams, done = [([], 0.0)], []
    with torch.inference_mode():
        for _ in range(max_tokens):
            grown = []
            for tokens, logprob in beams:
                logprobs = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0, -1].float(), -1)
                top = torch.topk(logprobs, 2 * width)
                for value, token in zip(top.values.tolist(), top.indices.tolist()):
                    (done if token in eos else grown).append((tokens + [token] * (token not in eos), logprob + value))
            beams = sorted(grown, key=lambda b: score(*b), reverse=True)[:width]
    return sorted(done + beams, key=lambda b: score(*b), reverse=True)[:width]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    # steps slowed to 10 ms: a search of 60 steps outlives a deadline of 0.3 s
    c = LocalCluster(tiny_model_dir, worker_args=["--num-blocks", "256", "--max-num-seqs", "16",
                                                  "--debug-step-delay", "0.01"],
                     log_dir=tmp_path_factory.mktemp("beam-logs")).start(timeout=180)
    yield c
    c.stop()


def test_beams_through_the_services_equal_the_search_over_transformers_logprobs(cluster, tiny_model_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with Client(cluster.address, timeout=120) as c:
        eos = set(c.model_info()["eos_token_ids"])
        for prompt in PROMPTS:
            for width in (1, 3):
                got = c.complete(token_ids=prompt, max_tokens=5, n=width, use_beam_search=True)
                want = _reference_beams(hf, prompt, width, 5, eos)
                assert [g.token_ids for g in got] == [tokens for tokens, _ in want], (prompt, width)
                assert [g.cumulative_logprob for g in got] == pytest.approx([lp for _, lp in want], abs=1e-4)
                assert all(g.finish_reason == "length" and g.usage.completion_tokens == 5 for g in got)
        greedy, = c.complete(token_ids=PROMPTS[0], max_tokens=5, temperature=0.0)
        assert greedy.token_ids == _reference(hf, PROMPTS[0], 1, 5, eos)[0]  # one beam is greedy decoding
        with pytest.raises(grpc.RpcError) as e:  # cut mid-search: the step in flight is aborted, its blocks freed
            c.complete(token_ids=PROMPTS[2], max_tokens=60, n=4, use_beam_search=True, timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 30
        while any(w["free_blocks"] != w["num_blocks"] for w in c.model_info()["workers"]):
            assert time.monotonic() < deadline, "a beam's blocks stayed held"
            time.sleep(0.05)


@pytest.mark.parametrize("kwargs,field", [
    *(({"use_beam_search": True, **kw}, field) for kw, field in (
        ({"temperature": 0.8}, "sampling.temperature"), ({"top_k": 5}, "sampling.top_k"),
        ({"stop": ["x"]}, "stopping.stop"), ({"logprobs": 1}, "logprobs"), ({"structured": {"regex": "a+"}}, "structured"),
        ({"n": 11}, "n must be at most 10"))),
    ({"length_penalty": 0.5}, "length_penalty applies to beam search only"),
])
def test_what_beam_search_cannot_honour_is_invalid_argument_naming_it(cluster, kwargs, field):
    with Client(cluster.address, timeout=60) as c, pytest.raises(grpc.RpcError) as e:
        c.complete(token_ids=PROMPTS[1], max_tokens=2, **kwargs)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field), e.value.details()


def test_the_gateways_use_beam_search(cluster, tmp_path):
    gateway = Gateway(cluster.address, tmp_path / "gateway.log").wait_healthy()
    try:
        with Client(cluster.address, timeout=60) as c:
            want = [g.token_ids for g in c.complete(token_ids=PROMPTS[2], max_tokens=4, n=2, use_beam_search=True,
                                                    length_penalty=0.5)]
        r = httpx.post(f"{gateway.url}/v1/completions", timeout=60, json={
            "prompt": PROMPTS[2], "max_tokens": 4, "n": 2, "use_beam_search": True, "length_penalty": 0.5,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert [ch["token_ids"] for ch in r.json()["choices"]] == want
        bad = httpx.post(f"{gateway.url}/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 2, "use_beam_search": True, "temperature": 0.7})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature", bad.text
    finally:
        gateway.stop()


def test_the_offline_llms_beam_search(tiny_model_dir):
    """LLM.beam_search (vLLM's): the same beams as the search over transformers' logprobs, for each prompt, the prompts
    searched in lockstep."""
    from offline.llm import LLM

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=64, block_size=16) as llm:
        eos = set(llm.engine.tokenizer.eos_token_ids)
        batches = []
        generate = llm.generate
        llm.generate = lambda prompts, *a, **k: batches.append(len(prompts)) or generate(prompts, *a, **k)
        out = llm.beam_search(PROMPTS[:2], beam_width=2, max_tokens=4)
        assert batches[0] == 2 and len(batches) == 4  # the prompts in lockstep: one batch a step for both
        assert [[b.token_ids for b in beams] for beams in out] == [_reference(hf, p, 2, 4, eos) for p in PROMPTS[:2]]
        assert out[0][0].cumulative_logprob >= out[0][1].cumulative_logprob and out[0][0].finish_reason == "length"
        with pytest.raises(ValueError, match="beam_width must be in"):
            llm.beam_search(PROMPTS[0], beam_width=11, max_tokens=2)
        with pytest.raises(ValueError, match="not served"):  # a step that fails ends every search of the batch
            llm.beam_search(PROMPTS[:2], beam_width=2, max_tokens=2, lora="no-such-adapter")
