"""Encoder-only embedding models (model/bert.py): BERT, RoBERTa and XLM-RoBERTa checkpoints written by transformers
itself (odd shapes, each of its activations, RoBERTa's position offset), with the real Qwen tokenizer given a BERT-like
post-processor (a first token and a closing one, as [CLS] ... [SEP]) and sentence-transformers' pooling (CLS, mean);
and the make-model presets' encoders (bge-base-en-v1.5's and bge-m3's layouts) against transformers.
Every vector is compared with transformers' hidden states on the same weights: offline, through the services on two
tensor-parallel ranks, with inputs batched into steps whole (their attention sees both ways)."""
from __future__ import annotations

import grpc
import httpx
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from client import Client
from client.launcher import LocalCluster
from offline.llm import LLM
from protos import worker_pb2 as pb
from tests.hf_reference import merge_lora
from worker_svc.checkpoints.tokenizer_files import add_encoder_special_tokens, write_qwen_tokenizer
from worker_svc.checkpoints.writer import make_lora_adapter, make_model, write_sentence_transformers
from worker_svc.model.bert import BertModel
from worker_svc.runtime.batch import PlanError

pytestmark = pytest.mark.timeout(300)

COMMON = dict(vocab_size=151936, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, intermediate_size=160)
CONFIGS = {  # (transformers' config, its model class, the pooling of its sentence-transformers files)
    "bert": (transformers.BertConfig(max_position_embeddings=128, **COMMON), transformers.BertModel, "cls_token"),
    "roberta": (transformers.RobertaConfig(max_position_embeddings=130, hidden_act="gelu_new", **COMMON),
                transformers.RobertaModel, "mean_tokens"),
    "xlm_roberta": (transformers.XLMRobertaConfig(max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
                                                  **COMMON), transformers.XLMRobertaModel, "cls_token"),
}
TEXTS = ["What is the capital of China?", "Explain gravity " * 12, "x", "Hello, world. " * 20]  # 9, 28, 3, 83 tokens


RERANKERS = {"bert": transformers.BertForSequenceClassification,  # (a cross-encoder's class per encoder)
             "xlm_roberta": transformers.XLMRobertaForSequenceClassification}  # bge-reranker's


def write_encoder(name: str, folder, reranker: bool = False) -> transformers.PreTrainedModel:
    """CONFIGS[name] saved by transformers into folder (random weights, LayerNorms away from their init), with the
    tokenizer and pooling files; returns transformers' model. reranker: as a cross-encoder of one label
    (ForSequenceClassification, num_labels 1: bge-reranker's)."""
    config, model_class, mode = CONFIGS[name]
    if reranker:
        fields = {k: v for k, v in config.to_dict().items() if k not in ("id2label", "label2id")}
        config, model_class = config.__class__(**fields, num_labels=1), RERANKERS[name]
    torch.manual_seed(0)
    hf = model_class(config).eval()
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            if "LayerNorm" in param_name:
                param.uniform_(-0.5, 0.5).add_(1.0 if param_name.endswith("weight") else 0.0)
    hf.save_pretrained(folder)
    write_qwen_tokenizer(folder)
    add_encoder_special_tokens(folder)
    write_sentence_transformers(folder, mode, normalize=True)
    return hf


def expected(hf, folder, items: list[str | list[int]]) -> list[torch.Tensor]:
    """transformers' embeddings of the items (texts through the tokenizer, or token ids as they are), pooled as the
    checkpoint says and normalised."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cls = CONFIGS[folder.name][2] == "cls_token"
    out = []
    for item in items:
        ids = tokenizer.encode(item).ids if isinstance(item, str) else item
        with torch.inference_mode():
            states = hf(torch.tensor([ids])).last_hidden_state[0]
        pooled = states[0] if cls else states.mean(0)
        out.append(pooled / pooled.norm())
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def encoder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("encoders") / request.param
    return folder, write_encoder(request.param, folder)


def test_embeddings_equal_transformers_with_every_input_whole_in_its_step(encoder):
    folder, hf = encoder
    items = [*TEXTS, [5, 6, 7] * 20]
    llm = LLM(folder, device="cpu", dtype="float32", max_num_batched_tokens=128, max_num_seqs=8)
    assert llm.engine.worker_info.encoder and not llm.engine.scheduler.config.enable_prefix_caching
    # 9 + 28 + 3 + 83 + 60 tokens: more than one step takes, so some wait for the next (the worker refuses a plan
    # that splits one)
    for vector, want in zip(llm.embed(items, use_tqdm=False), expected(hf, folder, items)):
        torch.testing.assert_close(torch.tensor(vector), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no LM head"):
        llm.generate([[5, 6]], use_tqdm=False)


def test_an_input_longer_than_a_step_is_refused_by_name(tmp_path):
    """max_model_len is what one step holds; an input of exactly that many tokens embeds (it samples no token)."""
    hf = write_encoder("bert", tmp_path / "bert")
    llm = LLM(tmp_path / "bert", device="cpu", dtype="float32", max_num_batched_tokens=64)
    assert llm.engine.scheduler.max_model_len == 64  # the position table's 128, cut to what one step holds
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([[5] * 65], use_tqdm=False)
    full = [(11 * j) % 5000 + 1 for j in range(64)]
    (vector,) = llm.embed([full], use_tqdm=False)
    torch.testing.assert_close(torch.tensor(vector), expected(hf, tmp_path / "bert", [full])[0], atol=1e-5, rtol=1e-5)
    runner = llm.engine.core.executor.runner  # and the worker refuses a plan that would split one
    split = pb.StepPlan(step=runner.batch.next_step, epoch=runner.epoch, new_seqs=[pb.NewSequence(
        seq_id=99, token_ids=[5] * 20, prompt_len=20, sampling=pb.SamplingParams(pooling="cls"),
        block_ids=[runner.num_blocks - 2, runner.num_blocks - 1], num_scheduled_tokens=16)])
    with pytest.raises(PlanError, match="runs whole in the step that starts it"):
        runner.execute(split)


def test_relative_positions_are_refused_at_start():
    raw = CONFIGS["bert"][0].to_dict() | {"architectures": ["BertModel"], "position_embedding_type": "relative_key"}
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key' is not served"):
        BertModel.config(raw)


def test_embeddings_through_the_services_on_two_ranks(tmp_path):
    """XLM-RoBERTa over two tensor-parallel ranks (heads, MLP and vocabulary split): Embed's vectors equal
    transformers', inputs sent at once share steps whole; a generation is refused by name."""
    folder = tmp_path / "xlm_roberta"
    hf = write_encoder("xlm_roberta", folder)
    cluster = LocalCluster(folder, log_dir=tmp_path / "logs", worker_args=[
        "--tensor-parallel-size", "2", "--dtype", "float32", "--num-blocks", "64", "--max-num-batched-tokens",
        "128"]).start(timeout=180)
    try:
        with Client(cluster.address, timeout=60) as c:
            assert c.model_info()["max_model_len"] == 128
            got = c.embed(TEXTS[:3]).vectors
            for vector, want in zip(got, expected(hf, folder, TEXTS[:3])):
                torch.testing.assert_close(torch.tensor(vector), want, atol=1e-5, rtol=1e-5)
            with pytest.raises(grpc.RpcError) as e:
                c.complete("hi", max_tokens=2)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no LM head" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                c.embed(TEXTS[3] * 2)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in e.value.details()
    finally:
        cluster.stop()


@pytest.mark.parametrize("name", list(RERANKERS))
def test_cross_encoders_score_as_transformers(name, tmp_path):
    """bge-reranker's shape (XLMRobertaForSequenceClassification, one label) and BERT's: each (query, document)
    pair joined by the tokenizer, the first token's state through the checkpoint's own head (BERT's pooler, RoBERTa's
    dense + tanh + out_proj), sigmoid; offline and through the services' Classify and score."""
    folder = tmp_path / name
    hf = write_encoder(name, folder, reranker=True)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    pairs = [("what is gravity?", "Gravity pulls masses together. " * 3), ("capital of China", "Beijing"),
             ("x", "y z")]
    with torch.inference_mode():
        want = [torch.sigmoid(hf(torch.tensor([tokenizer.encode(q, d).ids])).logits[0, 0]).item() for q, d in pairs]
    llm = LLM(folder, device="cpu", dtype="float32", max_num_batched_tokens=128)
    assert [p[0] for p in llm.classify(pairs, use_tqdm=False)] == pytest.approx(want, abs=1e-5)
    llm.close()
    cluster = LocalCluster(folder, log_dir=tmp_path / "logs", worker_args=[
        "--dtype", "float32", "--num-blocks", "64", "--max-num-batched-tokens", "128"]).start(timeout=180)
    try:
        with Client(cluster.address, timeout=60) as c:
            assert c.score(pairs[0][0], [pairs[0][1]]).scores == pytest.approx(want[:1], abs=1e-5)
        if name == "xlm_roberta":  # bge-reranker through the gateway's /v1/rerank, best first
            from tests.test_gateway import Gateway  # its imports are the gateway's (tests/gpu imports this module)

            gateway = Gateway(cluster.address, tmp_path / "gateway.log").wait_healthy()
            try:
                body = httpx.post(f"{gateway.url}/v1/rerank", json={"query": "q", "documents": [d for _, d in pairs]},
                                  timeout=60).json()
            finally:
                gateway.stop()
            with torch.inference_mode():
                scores = [torch.sigmoid(hf(torch.tensor([tokenizer.encode("q", d).ids])).logits[0, 0]).item()
                          for _, d in pairs]
            order = sorted(range(len(pairs)), key=lambda i: -scores[i])
            assert [r["index"] for r in body["results"]] == order
            assert [r["relevance_score"] for r in body["results"]] == pytest.approx(sorted(scores)[::-1], abs=1e-5)
    finally:
        cluster.stop()


@pytest.mark.parametrize("preset,model_class", [("bert-tiny", transformers.BertModel),
                                                ("xlm-roberta-tiny", transformers.XLMRobertaModel)])
def test_the_encoder_presets_load_into_transformers_and_embed_as_it_does(preset, model_class, tmp_path):
    """make-model's encoders (the tiny shapes of bge-base-en-v1.5's and bge-m3's presets): every tensor one
    transformers' model expects, the tokenizer closing each text, CLS pooling, normalised."""
    folder = make_model(preset, tmp_path / preset)
    hf, info = model_class.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    llm = LLM(folder, device="cpu", dtype="float32")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text, vector in zip(TEXTS[:2], llm.embed(TEXTS[:2], use_tqdm=False)):
        with torch.inference_mode():
            state = hf.eval()(torch.tensor([tokenizer.encode(text).ids])).last_hidden_state[0, 0]
        torch.testing.assert_close(torch.tensor(vector), state / state.norm(), atol=1e-5, rtol=1e-5)


def test_an_encoder_embeds_under_a_lora_adapter_as_its_merged_weights(tmp_path):
    """A PEFT adapter of BERT's query, key and value (as PEFT names them: encoder.layer.N.attention.self.query) beside
    the base model in one batch: each vector equals transformers' with the adapter merged, or without it."""
    folder = tmp_path / "bert"
    hf = write_encoder("bert", folder)
    adapter = make_lora_adapter(folder, tmp_path / "adapter", rank=4, targets=("query", "key", "value"))
    base = expected(hf, folder, TEXTS[:2])
    hf.load_state_dict(merge_lora(hf.state_dict(), adapter))
    llm = LLM(folder, device="cpu", dtype="float32", lora_modules={"a": str(adapter)})
    for lora, want in (("a", expected(hf, folder, TEXTS[:2])), ("", base)):
        for vector, w in zip(llm.embed(TEXTS[:2], use_tqdm=False, lora=lora), want):
            torch.testing.assert_close(torch.tensor(vector), w, atol=1e-5, rtol=1e-5)
