"""Sequence classifiers and cross-encoder rerankers (the Classify call, Client.classify, the gateway's /classify;
Client.score, /v1/score and /v1/rerank on a cross-encoder) from checkpoints transformers writes itself: a
Qwen3ForSequenceClassification of one label (a cross-encoder reranker's layout, as Qwen3-Reranker's sequence
classification conversions ship) with a tokenizer that joins a pair with separators, served by one
scheduler over one CPU worker whose steps take 48 tokens (long inputs run over several chunks); a
LlamaForSequenceClassification of three labels, untied, run in-process; and a Qwen3ForCausalLM served as
Qwen3-Reranker is (vLLM's overrides: its "yes" and "no" logits). Every logit is compared with transformers' on the same
weights, every pair with transformers' tokenizer's encoding of it."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import grpc
import httpx
import pytest
import torch
import transformers
from tokenizers import Tokenizer, processors

from client import Client
from client.launcher import LocalCluster
from common.model_files import QWEN3_RERANKER_OVERRIDES, Classifier, classifier
from tests.sim_cluster import free_port, sample, scrape
from tests.test_gateway import Gateway

pytestmark = pytest.mark.timeout(300)

SEP = "<|endoftext|>"
BLOCK_SIZE, NUM_BLOCKS = 16, 48
WORKER_ARGS = ["--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--max-num-batched-tokens", "48"]
QUERY = "What is the capital of China?"
DOCS = ["Beijing is the capital of China.", "Explain gravity " * 12, "x"]
WAIT_S = 60.0


def _write_classifier(tiny_model_dir: Path, out: Path, cls: type, labels: list[str], seed: int,
                      **shape: object) -> Path:
    """transformers' `cls` at the tiny model's shape (`shape` over it), random weights, and its tokenizer."""
    tiny = json.loads((tiny_model_dir / "config.json").read_text())
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
    config = cls.config_class(**{**{k: tiny[k] for k in fields}, **shape}, id2label=dict(enumerate(labels)),
                              label2id={name: i for i, name in enumerate(labels)})
    torch.manual_seed(seed)
    cls(config).to(torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def reranker_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """One label; its tokenizer closes a text with SEP and joins a pair as A SEP B SEP."""
    out = _write_classifier(tiny_model_dir, tmp_path_factory.mktemp("reranker") / "model",
                            transformers.Qwen3ForSequenceClassification, ["LABEL_0"], seed=11)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {SEP}", pair=f"$A {SEP} $B:1 {SEP}:1", special_tokens=[(SEP, tokenizer.token_to_id(SEP))])
    tokenizer.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def reference(reranker_dir):
    """transformers' logits of a text, token ids or a (text, text_pair) tuple, as its own tokenizer encodes it."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(reranker_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(reranker_dir)

    def logits(item) -> tuple[torch.Tensor, int]:
        if isinstance(item, list):
            ids = item
        else:
            ids = tokenizer(*item)["input_ids"] if isinstance(item, tuple) else tokenizer(item)["input_ids"]
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0], len(ids)
    return logits


@pytest.fixture(scope="module")
def cluster(reranker_dir, tmp_path_factory):
    metrics_port = free_port()
    c = LocalCluster(reranker_dir, worker_args=WORKER_ARGS, log_dir=tmp_path_factory.mktemp("classify-logs"),
                     scheduler_args=["--metrics-port", str(metrics_port)])
    c.start(timeout=240)
    c.metrics_port = metrics_port
    yield c
    c.stop()


@pytest.fixture(scope="module")
def gateway(cluster, tmp_path_factory):
    g = Gateway(cluster.address, tmp_path_factory.mktemp("classify-gw") / "gateway.log")
    try:
        yield g.wait_healthy()
    finally:
        g.stop()


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_the_labels_and_activation_are_read_from_the_config():
    for raw, want in (({"architectures": ["Qwen3ForCausalLM"]}, None),
                      ({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"}},
                       Classifier(("LABEL_0",), "sigmoid")),
                      ({"architectures": ["LlamaForSequenceClassification"], "id2label": {"1": "yes", "0": "no"}},
                       Classifier(("no", "yes"), "softmax")),
                      ({"architectures": ["LlamaForSequenceClassification"], "num_labels": 3,
                        "problem_type": "multi_label_classification"},
                       Classifier(("LABEL_0", "LABEL_1", "LABEL_2"), "sigmoid")),
                      ({**QWEN3_RERANKER_OVERRIDES, "architectures": ["Qwen3ForCausalLM"]}, None),
                      (QWEN3_RERANKER_OVERRIDES, Classifier(("yes",), "sigmoid", ("no", "yes"), two_way=True)),
                      ({**QWEN3_RERANKER_OVERRIDES, "is_original_qwen3_reranker": False},
                       Classifier(("no", "yes"), "softmax", ("no", "yes")))):
        assert classifier(raw) == want, raw
    with pytest.raises(ValueError, match="two classifier_from_token"):
        classifier({**QWEN3_RERANKER_OVERRIDES, "classifier_from_token": ["yes"]})


def test_classifications_equal_transformers_logits(cluster, reference):
    """Texts, token ids (over several chunks) and a text pair in one call; then each input's last 5 tokens."""
    items = [QUERY, [5, 6, 7] * 20, (QUERY, DOCS[1])]
    before = scrape(cluster.metrics_port)
    with Client(cluster.address, timeout=WAIT_S) as c:
        assert c.model_info()["labels"] == ["LABEL_0"]
        got = c.classify(items)
        assert got.labels == ["LABEL_0"]
        for item, probs, logits, count in zip(items, got.probs, got.logits, got.prompt_tokens):
            want, length = reference(item)
            assert count == length
            torch.testing.assert_close(torch.tensor(logits), want, rtol=1e-4, atol=1e-5)
            assert probs == pytest.approx([_sigmoid(logits[0])], abs=1e-6)
        cut = c.classify([[5, 6, 7] * 20], truncate_prompt_tokens=5)
        assert cut.prompt_tokens == [5]
        torch.testing.assert_close(torch.tensor(cut.logits[0]), reference([6, 7, 5, 6, 7])[0], rtol=1e-4, atol=1e-5)
        info = c.model_info()
    worker = info["workers"][0]
    assert worker["free_blocks"] == worker["num_blocks"] == NUM_BLOCKS  # nothing left held
    # each input a finished request in the metrics, as vLLM counts pooling requests, with its prompt tokens
    after = scrape(cluster.metrics_port)

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)
    assert grew("splitserve:request_success_total", finished_reason="stop") == len(items) + 1
    assert grew("splitserve:prompt_tokens_total") == sum(got.prompt_tokens) + 5
    assert grew("splitserve:e2e_request_latency_seconds_count") == 2


def test_bad_classify_requests_name_their_field_and_other_calls_are_refused(cluster):
    with Client(cluster.address, timeout=WAIT_S) as c:
        for inputs, field in (([], "inputs"), ([""], "inputs[0].text"), ([("a", "")], "inputs[0].pair.text_pair"),
                              (["a", [1 << 30]], "inputs[1].token_ids"),
                              ([("a", "b " * 5000)], "inputs[0].pair")):
            with pytest.raises(grpc.RpcError) as e:
                c.classify(inputs)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field), \
                (inputs, e.value.details())
        with pytest.raises(grpc.RpcError) as e:
            c.embed("hello")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "serves Classify" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.complete("hello", max_tokens=4)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no LM head" in e.value.details()
        with pytest.raises(ValueError, match="^text_2 must hold texts"):
            c.score(QUERY, [[5, 6]])


def test_a_cross_encoder_scores_and_reranks_each_pair_as_one_input(cluster, gateway, reference):
    """Client.score, /v1/score, /v1/rerank (best first, top_n) and /classify: each score the sigmoid of
    transformers' logit of the pair as its tokenizer joins it."""
    want = [_sigmoid(float(reference((QUERY, d))[0][0])) for d in DOCS]
    with Client(cluster.address, timeout=WAIT_S) as c:
        got = c.score(QUERY, DOCS)
        assert got.scores == pytest.approx(want, abs=1e-4)
        assert got.prompt_tokens == sum(reference((QUERY, d))[1] for d in DOCS)
    body = httpx.post(f"{gateway.url}/v1/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=WAIT_S).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-4)
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    body = httpx.post(f"{gateway.url}/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2},
                      timeout=WAIT_S).json()
    assert [r["index"] for r in body["results"]] == order[:2]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([want[i] for i in order[:2]], abs=1e-4)
    body = httpx.post(f"{gateway.url}/classify", json={"input": [QUERY, DOCS[0]]}, timeout=WAIT_S).json()
    assert [(d["index"], d["label"], d["num_classes"]) for d in body["data"]] == [(0, "LABEL_0", 1), (1, "LABEL_0", 1)]
    assert [d["probs"][0] for d in body["data"]] == pytest.approx(
        [_sigmoid(float(reference(t)[0][0])) for t in (QUERY, DOCS[0])], abs=1e-4)
    assert body["usage"]["prompt_tokens"] == reference(QUERY)[1] + reference(DOCS[0])[1]
    for route, bad, param in (("/v1/score", {"text_1": QUERY, "text_2": [[5, 6]]}, "text_2"),
                              ("/v1/rerank", {"query": QUERY, "documents": ["b " * 5000]}, "documents"),
                              ("/classify", {"input": [""]}, "input"),
                              ("/v1/embeddings", {"input": "a"}, None)):
        answer = httpx.post(f"{gateway.url}{route}", json=bad, timeout=WAIT_S)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (route, answer.text)


def test_a_classifier_of_several_labels_runs_in_process(tiny_model_dir, tmp_path):
    """LlamaForSequenceClassification of three labels, untied, with GQA: offline LLM.classify's probabilities are the
    softmax of transformers' logits; embed and score are refused by name."""
    from offline import LLM

    model_dir = _write_classifier(tiny_model_dir, tmp_path / "llama-cls", transformers.LlamaForSequenceClassification,
                                  ["neg", "neu", "pos"], seed=5, tie_word_embeddings=False, num_key_value_heads=1)
    reference = transformers.LlamaForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    items = [QUERY, [9, 8, 7, 6], (QUERY, DOCS[0])]
    with LLM(model_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_batched_tokens=48) as llm:
        got = llm.classify(items, use_tqdm=False)
        for item, probs in zip(items, got):
            ids = item if isinstance(item, list) else tokenizer(*item if isinstance(item, tuple) else (item,))[
                "input_ids"]
            with torch.inference_mode():
                want = reference(torch.tensor([ids])).logits[0].softmax(-1)
            assert probs == pytest.approx(want.tolist(), abs=1e-5)
        with pytest.raises(ValueError, match="3 labels"):
            llm.score(QUERY, DOCS)
        with pytest.raises(ValueError, match="use classify"):
            llm.embed(QUERY)


def test_qwen3_reranker_as_published_scores_by_its_yes_and_no_logits(tiny_model_dir):
    """A causal LM served with vLLM's overrides (the worker's --hf-overrides): each pair's score is the probability
    of "yes" against "no" at the pair's last position in transformers' causal LM, its LM head's rows as the head."""
    from offline import LLM

    reference = transformers.Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    with LLM(tiny_model_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_batched_tokens=48,
             hf_overrides=QWEN3_RERANKER_OVERRIDES) as llm:
        assert llm.engine.worker_info.labels == ["yes"]
        got = llm.score(QUERY, DOCS, use_tqdm=False)
    for doc, score in zip(DOCS, got):
        with torch.inference_mode():
            last = reference(torch.tensor([tokenizer(QUERY, doc)["input_ids"]])).logits[0, -1]
        assert score == pytest.approx(float(last[[no, yes]].softmax(-1)[1]), abs=1e-5)


def test_the_worker_refuses_overrides_it_cannot_serve(tiny_model_dir, capsys):
    from worker_svc.cli import main

    for overrides in ("[1]", "{"):  # argparse's usage error, naming the flag
        with pytest.raises(SystemExit):
            main(["serve", "--model", str(tiny_model_dir), "--plaintext", "--hf-overrides", overrides])
        assert "argument --hf-overrides: must be a JSON object" in capsys.readouterr().err
    unservable = json.dumps({**QWEN3_RERANKER_OVERRIDES, "classifier_from_token": ["no", "yes", "x"]})
    with pytest.raises(SystemExit, match="two classifier_from_token"):
        main(["serve", "--model", str(tiny_model_dir), "--plaintext", "--hf-overrides", unservable])
