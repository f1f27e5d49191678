"""Embeddings, a reranker and LoRA adapters on the GPU (CUDA graphs on, float32 weights so that near-ties are rare):
pooled rows against transformers' hidden states, an embedding-only checkpoint's warm-up (no LM head, no decode graphs),
a causal LM scored as Qwen3-Reranker is, and adapted sequences beside base ones against a checkpoint with the adapter
merged into its weights.
Run: pytest tests/gpu (skipped without a CUDA GPU)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from common.limits import Limits  # noqa: E402
from common.model_files import QWEN3_RERANKER_OVERRIDES  # noqa: E402
from protos import worker_pb2 as pb  # noqa: E402

DEVICE = "cuda"


def _model(tmp_path: Path) -> Path:
    from worker_svc.checkpoints.writer import make_model

    return make_model("qwen3-small", tmp_path / "m", seed=0, dtype="float32")


def test_embeddings_on_the_gpu_equal_transformers_hidden_states(tmp_path):
    """LLM.embed of a generative checkpoint in steps of 256 tokens (prompts up to 600), last token, normalised; then an
    embedding-only checkpoint (Qwen3Model's tensors, no LM head) warms up and embeds the same."""
    from offline.llm import LLM

    model_dir = _model(tmp_path)
    prompts = [[(7 * i + j) % 5000 + 1 for j in range(3 + 97 * i)] for i in range(7)]
    hf = transformers.Qwen3Model.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    with torch.inference_mode():
        want = [torch.nn.functional.normalize(hf(torch.tensor([p], device=DEVICE)).last_hidden_state[0, -1], dim=0)
                for p in prompts]
    with LLM(model_dir, device=DEVICE, num_blocks=256, block_size=16, max_num_seqs=32,
             max_num_batched_tokens=256) as llm:
        got = llm.embed(prompts, use_tqdm=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), w.cpu(), rtol=1e-3, atol=1e-4)
    only = tmp_path / "embedding"
    hf.save_pretrained(only)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, only / name)
    raw = json.loads((only / "config.json").read_text())
    (only / "config.json").write_text(json.dumps({**raw, "architectures": ["Qwen3ForCausalLM"],
                                                  "tie_word_embeddings": False}))
    with LLM(only, device=DEVICE, num_blocks=256, block_size=16, max_num_seqs=32, max_num_batched_tokens=256) as llm:
        runner = llm.engine.core.executor.runner
        assert runner.embedding_only and not runner.decode.graphs
        again = llm.embed(prompts, use_tqdm=False)
    for g, w in zip(again, want):
        torch.testing.assert_close(torch.tensor(g), w.cpu(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", ["bert", "xlm_roberta"])
def test_encoders_on_the_gpu_equal_transformers(name, tmp_path):
    """BERT's and XLM-R's embeddings (attention both ways, on the auto backend's prefill kernels) in float32 against
    transformers', inputs of 3 to ~120 tokens batched whole into steps of 128."""
    from offline.llm import LLM
    from tests.test_encoders import TEXTS, expected, write_encoder

    folder = tmp_path / name
    hf = write_encoder(name, folder)
    # no token is XLM-R's padding id 1, to which transformers gives the padding position whatever its place
    items = [*TEXTS, *([(11 * i + j) % 5000 + 2 for j in range(3 + 29 * i)] for i in range(5))]
    want = expected(hf, folder, items)
    with LLM(folder, device=DEVICE, dtype="float32", num_blocks=256, block_size=16, max_num_seqs=32,
             max_num_batched_tokens=128) as llm:
        assert llm.engine.core.executor.runner.embedding_only
        got = llm.embed(items, use_tqdm=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), w, rtol=1e-3, atol=1e-4)


def test_an_encoder_cross_encoder_on_the_gpu_scores_as_transformers(tmp_path):
    """bge-reranker's shape (XLMRobertaForSequenceClassification, one label) in float32: its head over the first
    token of each joined pair, sigmoid, against transformers'."""
    from tokenizers import Tokenizer

    from offline.llm import LLM
    from tests.test_encoders import write_encoder

    folder = tmp_path / "xlm_roberta"
    hf = write_encoder("xlm_roberta", folder, reranker=True)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    pairs = [("what is gravity?", "Gravity pulls masses together. " * 3), ("capital of China", "Beijing")]
    with torch.inference_mode():
        want = [torch.sigmoid(hf(torch.tensor([tokenizer.encode(q, d).ids])).logits[0, 0]).item() for q, d in pairs]
    with LLM(folder, device=DEVICE, dtype="float32", num_blocks=64, block_size=16, max_num_batched_tokens=128) as llm:
        got = [p[0] for p in llm.classify(pairs, use_tqdm=False)]
    assert got == pytest.approx(want, abs=1e-4)


def _merged(model_dir: Path, adapter: Path, out: Path) -> Path:
    """The checkpoint with the adapter merged into its weights: W + alpha / r * B A."""
    from tests.hf_reference import merge_lora

    shutil.copytree(model_dir, out)
    weights = merge_lora(load_file(out / "model.safetensors"), adapter)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_reranker_on_the_gpu_scores_as_transformers(tmp_path):
    """Qwen3-Reranker's layout served with vLLM's overrides (a head of the LM head's "yes" minus "no" rows): LLM.score's
    probabilities equal transformers' P(yes) against P(no) at each pair's last position, over several 256-token
    steps; the worker warms up with the head and captures no decode graphs."""
    from offline.llm import LLM

    model_dir = _model(tmp_path)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    query, docs = "Which city is the capital of China?", ["Beijing. " * 40, "Paris is in France.", "x " * 300]
    with torch.inference_mode():
        want = [float(hf(torch.tensor([tokenizer(query, d)["input_ids"]], device=DEVICE)).logits[0, -1, [no, yes]]
                      .softmax(-1)[1]) for d in docs]
    with LLM(model_dir, device=DEVICE, num_blocks=256, block_size=16, max_num_seqs=32, max_num_batched_tokens=256,
             hf_overrides=QWEN3_RERANKER_OVERRIDES) as llm:
        assert not llm.engine.core.executor.runner.decode.graphs
        got = llm.score(query, docs, use_tqdm=False)
    assert got == pytest.approx(want, abs=1e-4)


def test_lora_on_the_gpu_equals_its_adapter_merged(tmp_path):
    """Sequences of an adapter beside base ones, their decode steps replaying the graphs captured with the adapters'
    kernels (a step without an adapter's row: those without), against a runner of the merged checkpoint and a runner
    without adapters; the adapter loaded at start, or placed into a slot of graphs captured before it came."""
    from tests.paged_driver import PagedDriver
    from worker_svc.checkpoints.writer import make_lora_adapter
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    model_dir = _model(tmp_path)
    adapter = make_lora_adapter(model_dir, tmp_path / "a", rank=8, seed=1)
    merged = _merged(model_dir, adapter, tmp_path / "merged")
    config = dict(device=DEVICE, num_blocks=512, block_size=16, limits=Limits(max_num_seqs=32, max_model_len=1024))
    prompts = [[(11 * i + j) % 5000 + 1 for j in range(4 + 23 * i)] for i in range(12)]
    greedy = dict(temperature=0.0, top_p=1.0, repetition_penalty=1.0, logprobs=-1)
    runs = {  # runner, and the adapter of each prompt ("": none; None: not run)
        "lora": (ModelRunner(model_dir, RunnerConfig(**config, lora_modules={"a": str(adapter)})),
                 ["a" if i % 2 else "" for i in range(len(prompts))]),
        "merged": (ModelRunner(merged, RunnerConfig(**config)), ["" if i % 2 else None for i in range(len(prompts))]),
        "base": (ModelRunner(model_dir, RunnerConfig(**config)), [""] * len(prompts)),
        "loaded": (ModelRunner(model_dir, RunnerConfig(**config, max_loras=2, max_lora_rank=16)),
                   ["a" if i % 2 else "" for i in range(len(prompts))])}
    assert runs["lora"][0].decode.adapted_graphs.keys() == runs["lora"][0].decode.graphs.keys()
    assert not runs["base"][0].decode.adapted_graphs
    outs = {}
    for name, (runner, loras) in runs.items():
        driver = PagedDriver(runner)
        if name == "loaded":
            assert driver.update_adapters(load={"b": adapter, "a": adapter}) == {}
            assert driver.update_adapters(place={0: "b", 1: "a"}) == {}
            assert driver.update_adapters(unload=("b",)) == {}  # a slot of its own, cleared again
        seqs = {i: driver.add(p, 16, pb.SamplingParams(**greedy, lora=lora))
                for i, (p, lora) in enumerate(zip(prompts, loras)) if lora is not None}
        driver.run_all()
        outs[name] = {i: s.generated for i, s in seqs.items()}
    odd, even = range(1, len(prompts), 2), range(0, len(prompts), 2)
    assert sum(outs["lora"][i] == outs["merged"][i] for i in odd) >= 5, outs
    assert sum(outs["lora"][i] == outs["base"][i] for i in even) >= 5, outs
    assert sum(outs["lora"][i] != outs["base"][i] for i in odd) >= 5  # the adapter changes what the model says
    assert sum(outs["loaded"][i] == outs["merged"][i] for i in odd) >= 5, outs
    assert sum(outs["loaded"][i] == outs["base"][i] for i in even) >= 5, outs


def test_weights_read_again_on_the_gpu_serve_as_a_runner_started_from_them(tmp_path):
    """StepPlan.load_weights on a runner whose decode graphs were captured over the weights before: its decode steps
    replay those graphs over the new weights (copied in place) as a runner started from the new checkpoint runs them,
    and going back gives the first tokens again, bit for bit."""
    from tests.paged_driver import PagedDriver
    from worker_svc.checkpoints.writer import make_model
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    first, second = _model(tmp_path), make_model("qwen3-small", tmp_path / "b", seed=1, dtype="float32")
    config = RunnerConfig(device=DEVICE, num_blocks=512, block_size=16, limits=Limits(max_num_seqs=32,
                                                                                      max_model_len=1024))
    prompts = [[(11 * i + j) % 5000 + 1 for j in range(4 + 23 * i)] for i in range(12)]
    greedy = pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, logprobs=-1)

    def run(driver: PagedDriver) -> list[list[int]]:
        seqs = [driver.add(p, 16, greedy) for p in prompts]
        driver.run_all()
        return [s.generated for s in seqs]

    reloaded = PagedDriver(ModelRunner(first, config))
    assert reloaded.runner.decode.graphs
    before = run(reloaded)
    assert reloaded.reload_weights(second) == ""
    after = run(reloaded)
    fresh = run(PagedDriver(ModelRunner(second, config)))
    assert sum(a == f for a, f in zip(after, fresh)) >= 10, (after, fresh)
    assert sum(a != b for a, b in zip(after, before)) >= 10  # other weights, other tokens
    assert reloaded.reload_weights(first) == ""
    assert run(reloaded) == before
