"""Embeddings (the Embed call, Client.embed, the gateway's /v1/embeddings; scores and reranking made of them) from a
checkpoint in Qwen3-Embedding's published layout: transformers' Qwen3Model saved (tensor names without `model.`, no LM
head, as the 4B and 8B ship), its config.json naming Qwen3ForCausalLM, a tokenizer that closes each input with its
EOS, and sentence-transformers' modules (last-token pooling, then Normalize). One scheduler over one CPU worker whose
steps take 48 tokens, so longer inputs are embedded over several chunks; every vector is compared with transformers'
hidden states on the same weights.
Mean and CLS pooling of a generative checkpoint: tests/test_engine_model.py."""
from __future__ import annotations

import base64
import json
import shutil
from array import array
from pathlib import Path

import grpc
import httpx
import pytest
import torch
import transformers
from tokenizers import Tokenizer, processors

from client import Client
from client.launcher import LocalCluster
from client.scores import ScorePlan, pair_scores, score_plan
from common.model_files import Pooling, pooling
from protos import worker_pb2 as pb
from tests.test_gateway import Gateway
from worker_svc.checkpoints.writer import write_sentence_transformers

pytestmark = pytest.mark.timeout(300)

EOS = "<|endoftext|>"
BLOCK_SIZE, NUM_BLOCKS = 16, 48
WORKER_ARGS = ["--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--max-num-batched-tokens", "48"]
TEXTS = ["What is the capital of China?", "Explain gravity " * 30, "x"]
WAIT_S = 60.0


@pytest.fixture(scope="module")
def embedding_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen3-embedding") / "model"
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = False
    torch.manual_seed(7)
    transformers.Qwen3Model(config).to(torch.float32).save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    raw["architectures"] = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config.json says, over Qwen3Model's weights
    (out / "config.json").write_text(json.dumps(raw))
    for name in ("tokenizer_config.json", "generation_config.json"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, out / name)
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B:1 {EOS}:1", special_tokens=[(EOS, tokenizer.token_to_id(EOS))])
    tokenizer.save(str(out / "tokenizer.json"))
    write_sentence_transformers(out, "lasttoken", normalize=True)
    return out


@pytest.fixture(scope="module")
def reference(embedding_model_dir):
    """transformers' last hidden states of token ids (Qwen3-Embedding's README pools the last one)."""
    model = transformers.Qwen3Model.from_pretrained(embedding_model_dir, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(embedding_model_dir / "tokenizer.json"))

    def states(item: str | list[int]) -> torch.Tensor:
        ids = tokenizer.encode(item).ids if isinstance(item, str) else item
        with torch.inference_mode():
            return model(torch.tensor([ids])).last_hidden_state[0]
    return states


@pytest.fixture(scope="module")
def cluster(embedding_model_dir, tmp_path_factory):
    c = LocalCluster(embedding_model_dir, worker_args=WORKER_ARGS, log_dir=tmp_path_factory.mktemp("embed-logs"))
    c.start(timeout=240)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def gateway(cluster, tmp_path_factory):
    g = Gateway(cluster.address, tmp_path_factory.mktemp("embed-gw") / "gateway.log")
    try:
        yield g.wait_healthy()
    finally:
        g.stop()


def _normalized(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def _close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want.float(), rtol=1e-4, atol=1e-5)


def test_the_checkpoints_pooling_is_read_from_its_sentence_transformers_modules(tmp_path):
    assert pooling(tmp_path) == Pooling("last", True)  # none: decoder embedding models' way
    for mode, kind in (("lasttoken", "last"), ("mean_tokens", "mean"), ("cls_token", "cls")):
        d = tmp_path / mode
        d.mkdir()
        write_sentence_transformers(d, mode, normalize=mode != "mean_tokens")
        assert pooling(d) == Pooling(kind, mode != "mean_tokens")
    d = tmp_path / "max"
    d.mkdir()
    write_sentence_transformers(d, "max_tokens", normalize=True)
    with pytest.raises(ValueError, match="max_tokens"):
        pooling(d)


def test_embeddings_equal_transformers_last_hidden_state(cluster, reference):
    """Texts (each closed by the tokenizer's EOS, one over several chunks) and token ids in one call; each vector
    the normalised last state; then the first 16 values, normalised, and the raw state."""
    ids = [[5, 6, 7] * 20, [42]]
    with Client(cluster.address, timeout=WAIT_S) as c:
        got = c.embed([*TEXTS, *ids])
        assert got.pooling == "last" and len(got.vectors) == len(TEXTS) + len(ids)
        for item, vector, count in zip([*TEXTS, *ids], got.vectors, got.prompt_tokens):
            states = reference(item)
            assert count == len(states)
            _close(vector, _normalized(states[-1]))
        # the EOS the tokenizer appends: Tokenize encodes a text as Generate and Embed do, unless asked otherwise
        ids_of_text, strs = c.tokenize(TEXTS[0], return_token_strs=True)
        assert reference(TEXTS[0]).shape[0] == len(ids_of_text) == len(strs)
        assert c.tokenize(TEXTS[0], add_special_tokens=False) == ids_of_text[:-1]
        assert strs[-1] == "<|endoftext|>" and c.tokenize(messages=[{"role": "user", "content": TEXTS[0]}],
                                                          add_special_tokens=True)[-1] == ids_of_text[-1]
        short = c.embed(TEXTS[0], dimensions=16).vectors[0]
        _close(short, _normalized(reference(TEXTS[0])[-1][:16]))
        raw = c.embed(ids[0], normalize=False).vectors[0]
        _close(raw, reference(ids[0])[-1])
        cut = c.embed([TEXTS[1], ids[0]], truncate_prompt_tokens=7)  # each input's last 7 tokens (the EOS among them)
        assert cut.prompt_tokens == [7, 7]
        _close(cut.vectors[1], _normalized(reference(ids[0][-7:])[-1]))
        info = c.model_info()
    worker = info["workers"][0]
    assert worker["free_blocks"] == worker["num_blocks"] == NUM_BLOCKS  # nothing left held
    assert worker["hidden_size"] == len(got.vectors[0]) and worker["embedding_only"] is True  # no LM head


def test_bad_embed_requests_name_their_field_and_generations_are_refused(cluster):
    with Client(cluster.address, timeout=WAIT_S) as c:
        for kwargs, field in (({"inputs": []}, "inputs"), ({"inputs": [""]}, "inputs[0].text"),
                              ({"inputs": ["a", [1 << 30]]}, "inputs[1].token_ids"),
                              ({"inputs": "a", "dimensions": 65}, "dimensions"),
                              ({"inputs": [[1] * 5000]}, "inputs[0].token_ids"),
                              ({"inputs": "a", "lora": "nope"}, "lora"),
                              ({"inputs": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens")):
            with pytest.raises(grpc.RpcError) as e:
                c.embed(**kwargs)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field), \
                (kwargs, e.value.details())
        with pytest.raises(grpc.RpcError) as e:
            c.complete("hello", max_tokens=4)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no LM head" in e.value.details()


def test_the_gateway_serves_openai_embeddings(cluster, gateway, reference):
    oai = gateway.openai()
    result = oai.embeddings.create(model="model", input=TEXTS)
    assert [d.index for d in result.data] == [0, 1, 2]
    for item, d in zip(TEXTS, result.data):
        _close(d.embedding, _normalized(reference(item)[-1]))
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(len(reference(t)) for t in TEXTS)
    # the openai client asks for base64 when no format is given, and decodes it; here by hand
    body = httpx.post(f"{gateway.url}/v1/embeddings", json={"input": [[5, 6, 7]], "encoding_format": "base64",
                                                            "dimensions": 8}, timeout=WAIT_S).json()
    vector = array("f")
    vector.frombytes(base64.b64decode(body["data"][0]["embedding"]))
    _close(list(vector), _normalized(reference([5, 6, 7])[-1][:8]))
    cut = httpx.post(f"{gateway.url}/v1/embeddings", json={"input": [[5, 6, 7] * 9], "truncate_prompt_tokens": 4},
                     timeout=WAIT_S).json()
    assert cut["usage"]["prompt_tokens"] == 4
    _close(cut["data"][0]["embedding"], _normalized(reference([7, 5, 6, 7])[-1]))
    bad = httpx.post(f"{gateway.url}/v1/embeddings", json={"input": "a", "dimensions": 65}, timeout=WAIT_S)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
    for priority, status in ((-5, 200), (101, 400)):  # vLLM's field, in [-100, 100]
        answer = httpx.post(f"{gateway.url}/v1/embeddings", json={"input": "a", "priority": priority}, timeout=WAIT_S)
        assert answer.status_code == status and (status == 200 or answer.json()["error"]["param"] == "priority")
    refused = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=WAIT_S)
    assert refused.status_code == 400 and "no LM head" in refused.json()["error"]["message"]


def test_score_pairs_one_to_one_one_to_many_and_many_to_many():
    assert score_plan("q", "d") == ScorePlan(["q", "d"], [(0, 1)])
    assert score_plan("q", ["a", [5, 6]]) == ScorePlan(["q", "a", [5, 6]], [(0, 1), (0, 2)])
    assert score_plan(["q"], ["a", "b"]).pairs == [(0, 1), (0, 2)]  # a list of one is one text
    assert score_plan(["q", [7]], ["a", "b"]) == ScorePlan(["q", [7], "a", "b"], [(0, 2), (1, 3)])
    assert [score_plan(["q", [7]], ["a", "b"]).side_of(i) for i in range(4)] == [0, 0, 1, 1]
    for first, second, side in ((["q", "r"], ["a"], "text_2"), ([], ["a"], "text_1"), ("q", [], "text_2")):
        with pytest.raises(ValueError, match=f"^{side}"):
            score_plan(first, second)
    assert pair_scores(score_plan("q", ["a", "b"]), [[3, 4], [6, 8], [-4, 3]]) == pytest.approx([1.0, 0.0])


def _cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(a[-1].float(), b[-1].float(), dim=0))


def test_scores_and_rerank_are_the_cosine_of_the_embeddings(cluster, gateway, reference):
    """Client.score and the gateway's /v1/score (one text against many, the i-th against the i-th) and /v1/rerank
    (best first, top_n; the /v2/rerank alias of Cohere's client): each score the cosine of transformers' states;
    sides that do not pair, and a text past the model's length, are 400s naming their side."""
    docs = ["Beijing is the capital of China.", "Explain gravity " * 10, "x"]
    want = [_cosine(reference(TEXTS[0]), reference(d)) for d in docs]
    with Client(cluster.address, timeout=WAIT_S) as c:
        got = c.score(TEXTS[0], docs)
        assert got.prompt_tokens == len(reference(TEXTS[0])) + sum(len(reference(d)) for d in docs)
        assert got.scores == pytest.approx(want, abs=1e-4)
        with pytest.raises(ValueError, match="text_2"):
            c.score(TEXTS[:2], docs)
    body = httpx.post(f"{gateway.url}/v1/score", json={"text_1": TEXTS[0], "text_2": docs}, timeout=WAIT_S).json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-4)
    body = httpx.post(f"{gateway.url}/v1/score", json={"text_1": TEXTS, "text_2": docs}, timeout=WAIT_S).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(
        [_cosine(reference(t), reference(d)) for t, d in zip(TEXTS, docs)], abs=1e-4)
    order = sorted(range(3), key=lambda i: -want[i])
    for path in ("/v1/rerank", "/v2/rerank"):
        body = httpx.post(f"{gateway.url}{path}", json={"query": TEXTS[0], "documents": [docs[0], {"text": docs[1]},
                                                                                       docs[2]], "top_n": 2,
                                                        "priority": -1},
                          timeout=WAIT_S).json()
        assert [r["index"] for r in body["results"]] == order[:2], body
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([want[i] for i in order[:2]],
                                                                                abs=1e-4)
        assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in order[:2]]
    for route, bad, param in (("/v1/score", {"text_1": TEXTS[:2], "text_2": docs}, "text_2"),
                              ("/v1/score", {"text_1": "a", "text_2": ["b", [1] * 5000]}, "text_2"),
                              ("/v1/rerank", {"query": "hello " * 5000, "documents": ["b"]}, "query"),
                              ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
                              ("/v1/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 0},
                               "truncate_prompt_tokens")):
        answer = httpx.post(f"{gateway.url}{route}", json=bad, timeout=WAIT_S)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (route, answer.text)


def test_a_worker_without_an_lm_head_refuses_a_generation_in_its_plan(embedding_model_dir):
    from worker_svc.runtime.batch import PlanError
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(embedding_model_dir, RunnerConfig(num_blocks=4, block_size=BLOCK_SIZE))
    assert runner.describe().embedding_only and runner.describe().hidden_size == 64

    def plan(pooling: str) -> pb.StepPlan:
        new = pb.NewSequence(seq_id=1, token_ids=[1, 2, 3], prompt_len=3, block_ids=[0], num_scheduled_tokens=3,
                             sampling=pb.SamplingParams(logprobs=-1, pooling=pooling))
        return pb.StepPlan(step=1, epoch=runner.epoch, new_seqs=[new])
    with pytest.raises(PlanError, match="no LM head"):
        runner.execute(plan(""))
    runner.reset()
    result = runner.execute(plan("last")).result()
    assert list(result.seq_ids) == [1] and list(result.token_ids) == [0] and len(result.pooled) == 64
