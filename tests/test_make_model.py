"""Project-written Qwen3 checkpoints: Hugging Face layout, loading, determinism, useful logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open

from tests import hf_reference
from worker_svc.checkpoints.presets import PRESETS, get_preset
from worker_svc.checkpoints.tokenizer_files import TOKENIZER_SIZE
from worker_svc.checkpoints.writer import (
    ENCODERS,
    default_model_dir,
    ensure_model,
    init_tensor,
    make_model,
    parse_size,
    plan_shards,
    tensor_shapes,
)

REPO = Path(__file__).resolve().parents[1]


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


FAMILIES = ["llama-tiny", "qwen2-tiny", "mistral-tiny", "qwen3-moe-tiny", "gemma3-tiny", "gemma2-tiny", "phi3-tiny",
            "mixtral-tiny", "qwen2-moe-tiny", "granite-tiny", "phi4-mini-tiny", "smollm3-tiny",
            "granite-moe-tiny", "glm4-tiny", "glm4-moe-tiny", "dots1-tiny",
            "ernie4_5-tiny", "ernie4_5-moe-tiny", "seed-oss-tiny", "solar-open-tiny", "gpt-oss-tiny",
            "deepseek-v2-tiny", "deepseek-v3-tiny", "olmo2-tiny", "olmo3-tiny", "olmoe-tiny",
            "minimax-m2-tiny", "glm4-moe-lite-tiny", "cohere2-tiny", "cohere-tiny", "starcoder2-tiny",
            "nemotron-tiny"]


@pytest.mark.parametrize("preset", FAMILIES)
def test_other_families_load_into_transformers_with_every_tensor(preset, tmp_path):
    """Each name and shape the writer emits is one transformers' model of that architecture expects, and the
    worker reads the preset's config as transformers does: the same logits (fp32) from the same weights (a
    preset's Gemma 3 once read `hidden_act: silu` where transformers' Gemma reads `hidden_activation`)."""
    from tests.paged_driver import prefill_logits
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    model_dir = make_model(preset, tmp_path / preset, max_shard_size="1MB")
    model, info = hf_reference.from_pretrained(model_dir, output_loading_info=True, attn_implementation="eager")
    assert type(model).__name__ == PRESETS[preset]["architectures"][0]
    assert not any(info.values()), info
    prompts = _prompts(2, 40).tolist()
    runner = ModelRunner(model_dir, RunnerConfig(num_blocks=16, block_size=16))
    with torch.inference_mode():
        for p, ours in zip(prompts, prefill_logits(runner, prompts)):
            # logits of up to ~45 (Gemma 3's 8 layers): float32's noise reaches ~4e-4; a misread layer, units
            torch.testing.assert_close(ours, model(torch.tensor([p])).logits[0], atol=1e-3, rtol=0)


def _load(model_dir: Path) -> transformers.Qwen3ForCausalLM:
    model, info = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _prompts(n: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TOKENIZER_SIZE, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    return make_model("qwen3-tiny", tmp_path_factory.mktemp("sharded") / "m", seed=0, max_shard_size="200KB")


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir) -> transformers.Qwen3ForCausalLM:
    return _load(tiny_model_dir)


def test_real_presets_have_published_sizes():
    # Total and non-embedding parameters from the Qwen3 model cards (0.6B/0.44B ... 8.2B/6.95B).
    expected = {
        "qwen3-0.6b": (0.60, 0.44),
        "qwen3-1.7b": (1.72, 1.41),
        "qwen3-4b": (4.02, 3.63),
        "qwen3-8b": (8.19, 6.95),
        "qwen3-30b-a3b": (30.53, 29.91),  # the card: 30.5B, 29.9B non-embedding
        "qwen1.5-moe-a2.7b": (14.32, 13.69),  # Qwen1.5-MoE-A2.7B's card: 14.3B (Qwen's vocabulary too)
    }
    # The other families keep Qwen's vocabulary (the tokenizer at hand): their non-embedding parameters, from
    # the published sizes less the published vocabulary's embeddings (Llama 3 128,256 rows, Mistral 32,000,
    # Qwen2.5 151,936, Phi-3 32,064, Phi-4-mini 200,064 tied: 3.84 B, Granite 49,155: granite-3.1-8b's 8.17 B,
    # SmolLM3 128,256 tied: 3.08 B; granite-3.0-1b-a400m 1.33 B; GLM-4 151,552 untied: 9.40 B)
    non_embedding_only = {"gemma-3-1b": 0.70, "llama-3.1-8b": 6.98, "llama-3.2-1b": 0.97, "qwen2.5-7b": 6.53,
                          "qwen2.5-0.5b": 0.36, "mistral-7b": 6.98, "phi-4": 13.63, "mixtral-8x7b": 46.44,
                          "phi-3-mini": 3.62, "phi-3.5-mini": 3.62, "phi-4-mini": 3.22, "granite-3.1-8b": 7.97,
                          "smollm3-3b": 2.81, "granite-3.0-1b-a400m": 1.28,
                          "glm-4-9b": 8.16,
                          # gpt-oss's cards: 20.9 B and 116.8 B with its 201,088-row untied vocabulary (1.16 B)
                          "gpt-oss-20b": 19.76, "gpt-oss-120b": 115.67,
                          # DeepSeek-V2-Lite's 15.7 B with 102,400 rows untied, V3's 671 B with 129,280 (its MTP
                          # layer, which the card counts apart, not written)
                          "deepseek-v2-lite": 15.29, "deepseek-v3": 669.17,
                          # OLMo-2-1124-7B's 7.30 B and Olmo-3-7B's with ~100k rows untied; OLMoE-1B-7B's 6.92 B, 50,304
                          "olmo-2-7b": 6.48, "olmo-3-7b": 6.48, "olmoe-1b-7b": 6.71,
                          # MiniMax-M2's 229 B with 200,064 rows untied (its MTP modules not written)
                          "minimax-m2": 227.46,
                          # GLM-4.7-Flash's 30 B (29.9 B with its 154,880 rows untied; its MTP layer not written)
                          "glm-4.7-flash": 29.31}
    for name in (*expected, *non_embedding_only):
        config = get_preset(name)
        params = sum(torch.Size(shape).numel() for _, shape in tensor_shapes(config))
        embeddings = config["vocab_size"] * config["hidden_size"] * (1 if config["tie_word_embeddings"] else 2)
        if name in expected:
            assert round(params / 1e9, 2) == expected[name][0]
        assert round((params - embeddings) / 1e9, 2) == (expected.get(name) or (0, non_embedding_only[name]))[1]


CONFIG_CLASSES = {"BertModel": transformers.BertConfig, "XLMRobertaModel": transformers.XLMRobertaConfig,
                  "Qwen3ForCausalLM": transformers.Qwen3Config, "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
                  "Qwen2ForCausalLM": transformers.Qwen2Config, "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
                  "LlamaForCausalLM": transformers.LlamaConfig, "MistralForCausalLM": transformers.MistralConfig,
                  "Gemma3ForCausalLM": transformers.Gemma3TextConfig, "Gemma2ForCausalLM": transformers.Gemma2Config,
                  "Phi3ForCausalLM": transformers.Phi3Config, "GraniteForCausalLM": transformers.GraniteConfig,
                  "MixtralForCausalLM": transformers.MixtralConfig, "SmolLM3ForCausalLM": transformers.SmolLM3Config,
                  "GraniteMoeForCausalLM": transformers.GraniteMoeConfig, "Glm4ForCausalLM": transformers.Glm4Config,
                  "Glm4MoeForCausalLM": transformers.Glm4MoeConfig, "Dots1ForCausalLM": transformers.Dots1Config,
                  "Ernie4_5ForCausalLM": transformers.Ernie4_5Config,
                  "Ernie4_5_MoeForCausalLM": transformers.Ernie4_5_MoeConfig,
                  "SeedOssForCausalLM": transformers.SeedOssConfig,
                  "SolarOpenForCausalLM": transformers.SolarOpenConfig,
                  "GptOssForCausalLM": transformers.GptOssConfig,
                  "DeepseekV2ForCausalLM": transformers.DeepseekV2Config,
                  "DeepseekV3ForCausalLM": transformers.DeepseekV3Config,
                  "Olmo2ForCausalLM": transformers.Olmo2Config, "Olmo3ForCausalLM": transformers.Olmo3Config,
                  "OlmoeForCausalLM": transformers.OlmoeConfig, "MiniMaxM2ForCausalLM": transformers.MiniMaxM2Config,
                  "Glm4MoeLiteForCausalLM": transformers.Glm4MoeLiteConfig,
                  "CohereForCausalLM": transformers.CohereConfig, "Cohere2ForCausalLM": transformers.Cohere2Config,
                  "Starcoder2ForCausalLM": transformers.Starcoder2Config,
                  "NemotronForCausalLM": transformers.NemotronConfig}


def test_presets_load_as_their_architectures_configs(tmp_path):
    for name, config in PRESETS.items():
        (tmp_path / "config.json").write_text(json.dumps(config))
        loaded = transformers.AutoConfig.from_pretrained(tmp_path)
        assert isinstance(loaded, CONFIG_CLASSES[config["architectures"][0]]), name
        if config["model_type"] not in ENCODERS:  # an encoder has no rope
            rope = loaded.rope_parameters.get("full_attention", loaded.rope_parameters)  # Gemma 3: one per layer type
            assert rope["rope_theta"] == config["rope_theta"]
        assert loaded.vocab_size == 151936
        assert str(loaded.dtype) == f"torch.{config['dtype']}"
    tp = PRESETS["qwen3-tiny-tp"]
    for n in (2, 4):
        assert tp["num_attention_heads"] % n == tp["num_key_value_heads"] % n == tp["intermediate_size"] % n == 0


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("200KB") == 200_000
    assert parse_size("1GiB") == 2**30
    assert parse_size("5mib") == 5 * 2**20
    assert parse_size(123) == 123
    with pytest.raises(ValueError):
        parse_size("2 parsecs")


@pytest.mark.parametrize("limit", ["200KB", "2MB", "10MB"])
def test_shard_plan_matches_huggingface_hub(limit):
    state = {name: torch.empty(shape, device="meta") for name, shape in tensor_shapes(get_preset("qwen3-tiny-untied"))}
    sizes = [(name, t.numel() * 4) for name, t in state.items()]
    hub = split_torch_state_dict_into_shards(state, max_shard_size=limit)
    assert plan_shards(sizes, parse_size(limit)) == list(hub.filename_to_tensors.values())


def test_single_file_layout(tiny_model_dir):
    files = {p.name for p in tiny_model_dir.iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert expected <= files
    assert "model.safetensors.index.json" not in files
    with safe_open(tiny_model_dir / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == {name for name, _ in tensor_shapes(get_preset("qwen3-tiny"))}
        assert "lm_head.weight" not in f.keys()
        assert f.get_tensor("model.layers.1.self_attn.q_norm.weight").dtype == torch.float32
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["tie_word_embeddings"] is True
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]


def test_sharded_layout(sharded_dir, tiny_model_dir):
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in sharded_dir.glob("*.safetensors"))
    assert len(shards) >= 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    for shard in shards:
        with safe_open(sharded_dir / shard, "pt") as f:
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == shard}
    tensors = _tensors(sharded_dir)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # Sharding does not change any weight.
    single = _tensors(tiny_model_dir)
    assert tensors.keys() == single.keys()
    assert all(torch.equal(tensors[k], single[k]) for k in single)


def test_transformers_loads_single_and_sharded_identically(tiny_model, sharded_dir):
    sharded = _load(sharded_dir)
    ids = _prompts(2, 12)
    with torch.no_grad():
        assert torch.equal(tiny_model(ids).logits, sharded(ids).logits)
    assert tiny_model.lm_head.weight.data_ptr() == tiny_model.model.embed_tokens.weight.data_ptr()


def test_untied_preset_has_its_own_lm_head(tmp_path):
    model_dir = make_model("qwen3-tiny-untied", tmp_path / "m", seed=0)
    tensors = _tensors(model_dir)
    assert "lm_head.weight" in tensors
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    model = _load(model_dir)
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])


def test_same_seed_same_bytes_other_seed_differs(tmp_path, tiny_model_dir):
    again = make_model("qwen3-tiny", tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    other = _tensors(make_model("qwen3-tiny", tmp_path / "other", seed=1))
    base = _tensors(tiny_model_dir)
    assert not any(torch.equal(other[k], base[k]) for k in base)


def test_cli_make_model(tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "worker_svc.cli", "make-model", "--preset", "qwen3-tiny", "--out", str(out)]
    cmd += ["--seed", "3", "--max-shard-size", "10MB", "--dtype", "bfloat16"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=300)
    assert (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = _tensors(out)
    for name, shape in tensor_shapes(get_preset("qwen3-tiny")):
        assert torch.equal(tensors[name], init_tensor(name, shape, 3, torch.bfloat16)), name
    listing = subprocess.run(
        [sys.executable, "-m", "worker_svc.cli", "list-presets"], check=True, cwd=REPO, capture_output=True, text=True
    )
    assert all(name in listing.stdout for name in PRESETS)


def test_ensure_model_writes_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    path = ensure_model("qwen3-tiny", seed=5)
    assert path == default_model_dir("qwen3-tiny", 5) == tmp_path / "models" / "qwen3-tiny-seed5"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("qwen3-tiny", seed=5) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["qwen3-tiny-seed5"]


def test_logits_have_clear_margins(tiny_model):
    with torch.no_grad():
        logits = tiny_model(_prompts(8, 24)).logits
    assert torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).flatten()
    # Measured with seed 0: median ~1.3, 5th percentile ~0.09 (std-0.02 init: ~0.03 and ~1e-3).
    assert margin.median() > 0.5
    assert margin.quantile(0.05) > 0.02
    assert logits[..., TOKENIZER_SIZE:].eq(0).all()


def test_greedy_generation_is_varied(tiny_model):
    prompts = _prompts(8, 6, seed=1)
    with torch.no_grad():
        out = tiny_model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=32, do_sample=False, pad_token_id=151643
        )
    generated = out[:, prompts.shape[1] :]
    assert generated.shape[1] == 32
    assert generated.max() < TOKENIZER_SIZE
    for row in generated.tolist():
        assert len(set(row)) >= 16, row
    assert len({tuple(row) for row in generated.tolist()}) == len(generated)


def test_num_layers_keeps_the_first_layers_of_the_presets_shape(tmp_path):
    """make-model --num-layers: a model too large for the disk, cut to its first layers (bench on the GPU)."""
    out = tmp_path / "cut"
    cmd = [sys.executable, "-m", "worker_svc.cli", "make-model", "--preset", "gemma3-tiny", "--out", str(out),
           "--num-layers", "3"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=300)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["hidden_size"] == PRESETS["gemma3-tiny"]["hidden_size"]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert len(model.model.layers) == 3 and not any(info.values())


@pytest.mark.parametrize("preset", ["qwen3-tiny", "mistral-tiny", "deepseek-v2-tiny"])
def test_kv_bytes_per_token_is_what_the_runner_caches(preset, tmp_path):
    """common.model_files.kv_bytes_per_token (the simulated worker's and the benchmarks' figure) from config.json alone
    equals a token's share of the runner's KV cache: GQA's KV heads, a latent-attention model's latent."""
    from common.model_files import kv_bytes_per_token
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    model_dir = make_model(preset, tmp_path / preset)
    runner = ModelRunner(model_dir, RunnerConfig(num_blocks=4, block_size=16))
    cache = runner.kv_cache  # [2, layers, blocks, block_size, kv heads, head_dim]
    per_token = cache[:, :, 0, 0].numel() * cache.element_size()
    assert kv_bytes_per_token(json.loads((model_dir / "config.json").read_text()), cache.element_size()) == per_token


def test_fp8_blocks_round_trip_with_partial_blocks():
    """The writer's FP8 block quantiser and the loader's dequantiser over a matrix whose last blocks are partial:
    each block's scale is its largest magnitude over e4m3's 448, and every value comes back within e4m3's step
    (2^-3 of its binade) times that scale; the blocks are where the scales say."""
    from worker_svc.checkpoints.writer import quantize_fp8_blocks
    from worker_svc.model.quantized import dequantize_fp8_blocks

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    w[:128, :128] *= 100  # one block far larger than the others
    q, scale = quantize_fp8_blocks(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    assert scale[0, 0] == w[:128, :128].abs().max() / 448 and scale[2, 1] == w[256:, 128:].abs().max() / 448
    back = dequantize_fp8_blocks(q, scale, (128, 128))
    assert back.shape == w.shape
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[
        :, :200] * 2 ** -9).all()
    with pytest.raises(ValueError, match="does not match its scales"):
        dequantize_fp8_blocks(q, scale, (64, 128))


def test_an_unsupported_quantization_is_refused_by_name(tmp_path):
    from worker_svc.model.config import ModelConfig

    config = get_preset("qwen3-tiny") | {"quantization_config": {"quant_method": "hqq", "nbits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported quantization_config.*hqq.*\(supported: fp8"):
        ModelConfig.from_dir(tmp_path)


def test_an_fp8_weight_without_its_scale_is_refused(tmp_path):
    """A block-scaled checkpoint missing one weight_scale_inv: the load fails naming the weight, never casting the
    e4m3 values unscaled."""
    from safetensors.torch import load_file, save_file

    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    model_dir = make_model("deepseek-v3-tiny", tmp_path / "m")
    files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        tensors = load_file(path)
        name = next((n for n in tensors if n.endswith(".o_proj.weight_scale_inv")), None)
        if name:
            del tensors[name]
            save_file(tensors, path, metadata={"format": "pt"})
            break
    if (model_dir / "model.safetensors.index.json").exists():
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        del index["weight_map"][name]
        (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match=f"FP8 weight '{name.removesuffix('_scale_inv')}'.*without its weight_scale_inv"):
        ModelRunner(model_dir, RunnerConfig(num_blocks=4, block_size=16))
