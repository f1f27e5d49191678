"""Write random-weight checkpoints (every architecture of the registry but the multimodal ones) in the exact Hugging
Face layout.

Weights are drawn per tensor from a `torch.Generator` seeded by (seed, tensor name), so a tensor's
values do not depend on sharding or on which other tensors exist, and are streamed shard by shard:
even qwen3-8b never needs the whole model in memory.

Scaling, chosen so greedy decoding has clear top-1 margins and does not collapse into repeating
the input token (see `tests/test_make_model.py`):
- embeddings (and an untied lm_head) ~ N(0, 1/hidden): unit-norm rows, so the token's own
  embedding is a small part of the residual stream (with tied weights a large one makes every
  token predict itself);
- every linear ~ N(0, 1/fan_in), so each block adds O(1) per coordinate to the residual;
- biases ~ N(0, 0.01);
- RMSNorm weights ~ U(0.5, 1.5): near 1 but not all equal, so loading the wrong norm shows up;
- q_norm/k_norm further scaled by QK_NORM_SCALE: sharper attention makes each position depend
  more on its own query, and greedy decoding stops settling into one repeated token;
- the final norm further scaled by LOGIT_SCALE, which sets the logits' standard deviation
  (transformers' std 0.02 init leaves it near 0.2, with top logits tied to ~1e-3);
- embedding (and lm_head) rows past the tokenizer's last id are zero, as no text maps to them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.util import cdiv
from worker_svc.checkpoints.presets import DEFAULT_PRESET, GENERATION_CONFIG, get_preset
from worker_svc.checkpoints.tokenizer_files import TOKENIZER_SIZE, add_encoder_special_tokens, write_qwen_tokenizer

LOGIT_SCALE = 8.0
QK_NORM_SCALE = 2.0
_CHUNK_ELEMENTS = 1 << 24  # draw big tensors in pieces of this many values (bounded fp32 scratch)
_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_size(size: str | int) -> int:
    """Bytes in a size like 2GB (10**9) or 500MiB (2**20), as Hugging Face reads max_shard_size."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
    if not m:
        raise ValueError(f"bad size {size!r}; expected e.g. 2GB, 500MB, 200KB, 1GiB")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])


GEMMA = ("gemma2", "gemma3_text")  # model types with (1 + w) norms (stored as w) and norms around the MLP
# model types with DeepSeek's experts: dense first layers, n_shared_experts shared ones; all but V2 a router bias
DEEPSEEK_MOE = ("glm4_moe", "dots1", "solar_open", "deepseek_v2", "deepseek_v3", "glm4_moe_lite")
MLA = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")  # model types with DeepSeek's latent attention
OLMO = ("olmo2", "olmo3", "olmoe", "minimax_m2")  # model types whose q/k norms span all heads
NORM_BIASES = ("starcoder2", "nemotron")  # model types whose LayerNorms have biases
ENCODERS = ("bert", "xlm-roberta")  # encoder-only: embeddings, their tokenizer closing each text, CLS pooling
MIXTRAL_NAMES = ("mixtral", "minimax_m2")  # experts on every layer as `block_sparse_moe.experts.N.w1` (w3, w2)


def tensor_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes in transformers' state_dict order for the config's architecture: q/k norms
    for Qwen3, q/k/v biases for Qwen2 (and Qwen2-MoE), Llama's (and SmolLM3's) attention and MLP biases where its
    config sets them, experts (and Qwen2-MoE's shared one; GraniteMoE's stored whole per projection)."""
    kind = config["model_type"]
    if kind in ENCODERS:
        return _encoder_shapes(config)
    h, inter = config["hidden_size"], config.get("intermediate_size", 0)  # Solar Open has no dense MLP
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    if kind == "gpt_oss":
        return _gpt_oss_shapes(config)
    mlp_bias = bool(config.get("mlp_bias")) and kind in ("llama", "smollm3", "nemotron")
    attention_bias = bool(config.get("attention_bias")) and kind in ("llama", "smollm3", "qwen3", "qwen3_moe", "dots1",
                                                                     "cohere", "cohere2", "nemotron")
    qkv_bias = (attention_bias or kind == "qwen2" or (kind == "qwen2_moe" and config.get("qkv_bias", True))
                or (kind in ("glm", "glm4") and config.get("attention_bias", True))
                or (kind in ("glm4_moe", "solar_open", "seed_oss") and bool(config.get("attention_bias"))))
    if kind == "starcoder2":  # use_bias: every projection's
        attention_bias = qkv_bias = mlp_bias = config.get("use_bias", True)
    o_bias = attention_bias or (kind == "seed_oss" and bool(config.get("attention_out_bias")))
    qk_norm = (kind in ("qwen3", "qwen3_moe", "gemma3_text", "dots1")
               or (kind == "glm4_moe" and bool(config.get("use_qk_norm"))))
    moe_layers = set()
    if kind in ("qwen3_moe", "qwen2_moe"):
        step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or [])
        moe_layers = {i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0}
    if kind in DEEPSEEK_MOE:
        moe_layers = set(range(config.get("first_k_dense_replace", 0), config["num_hidden_layers"]))
    if kind == "gpt_oss":
        return _gpt_oss_shapes(config)
    if kind == "olmoe":
        moe_layers = set(range(config["num_hidden_layers"]))
    if kind == "ernie4_5_moe":
        first, last, step = config["moe_layer_start_index"], config["moe_layer_end_index"], config["moe_layer_interval"]
        moe_layers = {i for i in range(config["num_hidden_layers"]) if first <= i <= last and (i + 1) % step == 0}
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config["vocab_size"], h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if kind == "phi3":  # q, k and v stored as one tensor, gate and up as another
            shapes += [(p + "self_attn.o_proj.weight", (h, q)), (p + "self_attn.qkv_proj.weight", (q + 2 * kv, h)),
                       (p + "mlp.gate_up_proj.weight", (2 * inter, h)), (p + "mlp.down_proj.weight", (h, inter)),
                       (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
            continue
        if kind in MLA:
            shapes += _mla_shapes(config, p + "self_attn.")
        else:
            for name, out, bias in (("q_proj", q, qkv_bias), ("k_proj", kv, qkv_bias), ("v_proj", kv, qkv_bias)):
                shapes.append((p + f"self_attn.{name}.weight", (out, h)))
                if bias:
                    shapes.append((p + f"self_attn.{name}.bias", (out,)))
            shapes.append((p + "self_attn.o_proj.weight", (h, q)))
            if o_bias:
                shapes.append((p + "self_attn.o_proj.bias", (h,)))
            if qk_norm:
                shapes += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
            if kind in OLMO:  # q/k norms over all heads
                shapes += [(p + "self_attn.q_norm.weight", (q,)), (p + "self_attn.k_norm.weight", (kv,))]
            if kind == "cohere" and config.get("use_qk_norm"):  # a weight per head
                heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
                shapes += [(p + "self_attn.q_norm.weight", (heads, hd)),
                           (p + "self_attn.k_norm.weight", (kv_heads, hd))]
        if kind == "granitemoe":  # every layer's experts in one tensor per projection (gate and up as one)
            e, e_inter = config["num_local_experts"], inter
            shapes += [(p + "block_sparse_moe.input_linear.weight", (e, 2 * e_inter, h)),
                       (p + "block_sparse_moe.output_linear.weight", (e, h, e_inter)),
                       (p + "block_sparse_moe.router.layer.weight", (e, h)),
                       (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
            continue
        if kind in MIXTRAL_NAMES or i in moe_layers:  # routed experts, under Mixtral's names (every layer) or Qwen's
            mixtral = kind in MIXTRAL_NAMES
            module = "block_sparse_moe" if mixtral else "mlp"
            count = (config.get("num_local_experts") or config.get("num_experts") or config.get("moe_num_experts")
                     or config["n_routed_experts"])
            e_inter = inter if mixtral or kind == "olmoe" else config["moe_intermediate_size"]
            widen, narrow = (e_inter, h), (h, e_inter)  # gate and up; down
            names = ((("w1", widen), ("w2", narrow), ("w3", widen)) if mixtral else
                     (("gate_proj", widen), ("up_proj", widen), ("down_proj", narrow)))
            shapes.append((p + f"{module}.gate.weight", (count, h)))
            if kind in DEEPSEEK_MOE and kind != "deepseek_v2":  # the router's correction bias (ERNIE's below)
                shapes.append((p + "mlp.gate.e_score_correction_bias", (count,)))
            if kind == "minimax_m2":  # its router's correction bias, beside the router
                shapes.append((p + "block_sparse_moe.e_score_correction_bias", (count,)))
            if kind == "ernie4_5_moe":
                shapes.append((p + "mlp.moe_statics.e_score_correction_bias", (1, count)))
            for e in range(count):
                shapes += [(p + f"{module}.experts.{e}.{name}.weight", shape) for name, shape in names]
            shared = {"qwen2_moe": ("shared_expert", config.get("shared_expert_intermediate_size")),
                      "ernie4_5_moe": ("shared_experts", e_inter * config.get("moe_num_shared_experts", 0))}.get(kind)
            if kind in DEEPSEEK_MOE:
                shared = ("shared_experts", e_inter * config.get("n_shared_experts", 1))
            if shared:  # the shared expert (Qwen2-MoE's with its gate)
                module, s_inter = shared
                shapes += [(p + f"mlp.{module}.{name}.weight", shape) for name, shape in
                           (("gate_proj", (s_inter, h)), ("up_proj", (s_inter, h)), ("down_proj", (h, s_inter)))]
                if kind == "qwen2_moe":
                    shapes.append((p + "mlp.shared_expert_gate.weight", (1, h)))
            shapes += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
            continue
        mlp = ((("gate_up_proj", (2 * inter, h)),) if kind in ("glm", "glm4")  # GLM: gate and up as one tensor
               else (("c_fc", (inter, h)),) if kind == "starcoder2"  # not gated
               else (("up_proj", (inter, h)),) if kind == "nemotron"
               else (("gate_proj", (inter, h)), ("up_proj", (inter, h))))
        for name, shape in (*mlp, ("c_proj" if kind == "starcoder2" else "down_proj", (h, inter))):
            shapes.append((p + f"mlp.{name}.weight", shape))
            if mlp_bias:
                shapes.append((p + f"mlp.{name}.bias", shape[:1]))
        if kind in ("olmo2", "olmo3"):  # norms on the attention's and the MLP's outputs only
            shapes += [(p + "post_attention_layernorm.weight", (h,)), (p + "post_feedforward_layernorm.weight", (h,))]
            continue
        if kind in ("cohere", "cohere2"):  # parallel blocks: one norm
            shapes.append((p + "input_layernorm.weight", (h,)))
            continue
        if kind in NORM_BIASES:
            shapes += [(p + f"{norm}.{part}", (h,)) for norm in ("input_layernorm", "post_attention_layernorm")
                       for part in ("weight", "bias")]
            continue
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if kind in GEMMA:
            shapes += [(p + "pre_feedforward_layernorm.weight", (h,)), (p + "post_feedforward_layernorm.weight", (h,))]
        if kind == "glm4":  # norms on the attention's and the MLP's outputs
            shapes += [(p + "post_self_attn_layernorm.weight", (h,)), (p + "post_mlp_layernorm.weight", (h,))]
    shapes.append(("model.norm.weight", (h,)))
    if kind in NORM_BIASES:
        shapes.append(("model.norm.bias", (h,)))
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (config["vocab_size"], h)))
    return shapes


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # MXFP4's magnitudes; code | 8: negative


def _encoder_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """BertModel's (and XLMRobertaModel's) tensors, pooler included, as transformers saves them."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    shapes = [("embeddings.word_embeddings.weight", (config["vocab_size"], h)),
              ("embeddings.position_embeddings.weight", (config["max_position_embeddings"], h)),
              ("embeddings.token_type_embeddings.weight", (config["type_vocab_size"], h)),
              ("embeddings.LayerNorm.weight", (h,)), ("embeddings.LayerNorm.bias", (h,))]
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for name, shape in (("attention.self.query", (h, h)), ("attention.self.key", (h, h)),
                            ("attention.self.value", (h, h)), ("attention.output.dense", (h, h)),
                            ("attention.output.LayerNorm", (h,)), ("intermediate.dense", (inter, h)),
                            ("output.dense", (h, inter)), ("output.LayerNorm", (h,))):
            shapes += [(p + name + ".weight", shape), (p + name + ".bias", shape[:1])]
    return shapes + [("pooler.dense.weight", (h, h)), ("pooler.dense.bias", (h,))]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] (n a multiple of 32) in MXFP4 as gpt-oss publishes it: blocks uint8 [..., n / 32, 16] of two e2m1 codes
    a byte (the first value in the low nibble), scales uint8 [..., n / 32] of 2^(scale - 127), the OCP choice
    floor(log2 max|x|) - 2 (e2m1's largest exponent); each value rounded to the nearest code (ties to the lower
    magnitude), those past 6 to 6."""
    x = w.float().unflatten(-1, (-1, 32))
    amax = x.abs().amax(-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2, -127.0).clamp(-127, 127)
    scaled = (x / torch.exp2(exponent)).clamp(-6.0, 6.0)
    code = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) | (scaled < 0).to(torch.int64) << 3
    pairs = code.unflatten(-1, (16, 2))
    blocks = (pairs[..., 0] | pairs[..., 1] << 4).to(torch.uint8)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def _mla_shapes(config: dict, a: str) -> list[tuple[str, tuple[int, ...]]]:
    """DeepSeek's latent attention's tensors under `a` (a layer's `self_attn.`): q straight from the hidden state or
    through its rank-q_lora_rank bottleneck, the latent and the rope dims of K, each head's K and V from the latent."""
    h, heads, rank = config["hidden_size"], config["num_attention_heads"], config.get("q_lora_rank")
    nope, rope, v, latent = (config[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
    q = [(a + "q_proj.weight", (heads * (nope + rope), h))] if rank is None else [
        (a + "q_a_proj.weight", (rank, h)), (a + "q_a_layernorm.weight", (rank,)),
        (a + "q_b_proj.weight", (heads * (nope + rope), rank))]
    return q + [(a + "kv_a_proj_with_mqa.weight", (latent + rope, h)), (a + "kv_a_layernorm.weight", (latent,)),
                (a + "kv_b_proj.weight", (heads * (nope + v), latent)), (a + "o_proj.weight", (h, heads * v))]


def _gpt_oss_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """gpt-oss's tensors as published: each expert projection of every expert as one [experts, out, in] tensor (its
    MXFP4 `_blocks` and `_scales`, make_model writes), with `_bias`; the router's bias; a sink per head."""
    h, inter, e = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    hd, heads, kv_heads = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config["vocab_size"], h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, out in (("q_proj", heads * hd), ("k_proj", kv_heads * hd), ("v_proj", kv_heads * hd)):
            shapes += [(p + f"self_attn.{name}.weight", (out, h)), (p + f"self_attn.{name}.bias", (out,))]
        shapes += [(p + "self_attn.o_proj.weight", (h, heads * hd)), (p + "self_attn.o_proj.bias", (h,)),
                   (p + "self_attn.sinks", (heads,)),
                   (p + "mlp.router.weight", (e, h)), (p + "mlp.router.bias", (e,)),
                   (p + "mlp.experts.gate_up_proj", (e, 2 * inter, h)),
                   (p + "mlp.experts.gate_up_proj_bias", (e, 2 * inter)),
                   (p + "mlp.experts.down_proj", (e, h, inter)), (p + "mlp.experts.down_proj_bias", (e, h)),
                   (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (config["vocab_size"], h))]
    return shapes


def _mxfp4(config: dict, name: str) -> bool:
    """Whether make_model writes the tensor in MXFP4 (gpt-oss's experts, as its config says)."""
    quantized = (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    return quantized and name.endswith((".experts.gate_up_proj", ".experts.down_proj"))


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] as an FP8 block-scaled checkpoint stores it (DeepSeek-V3's): float8_e4m3fn values and their
    weight_scale_inv, float32 [cdiv(rows, block[0]), cdiv(cols, block[1])], each block's largest magnitude at e4m3's
    largest (448)."""
    rows, cols = w.shape
    grid = (cdiv(rows, block[0]), cdiv(cols, block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = w.float()
    tiles = padded.view(grid[0], block[0], grid[1], block[1])
    scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)
    q = (tiles / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def _fp8(config: dict, name: str) -> bool:
    """Whether make_model writes the tensor in FP8 with block scales: every projection (`*_proj.weight`) of a config
    that says so, as DeepSeek-V3 is published (embeddings, norms, routers and the head in 16 bits)."""
    quantized = (config.get("quantization_config") or {}).get("quant_method") == "fp8"
    return quantized and name.endswith("_proj.weight")


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def init_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype,
                norm_offset: float = 0.0) -> torch.Tensor:
    """The random value of one parameter (see the module docstring for the scaling)."""
    gen = _generator(seed, name)
    if name.endswith((".bias", "e_score_correction_bias")):  # ERNIE's router bias against softmax scores: smaller
        return (torch.randn(shape, generator=gen) * (0.001 if ".moe_statics." in name else 0.1)).to(dtype)
    if len(shape) == 1 and norm_offset:  # Gemma's (1 + w) norms: the same weights less the 1
        return (init_tensor(name, shape, seed, torch.float32) - norm_offset).to(dtype)
    if len(shape) == 1 or name.endswith("norm.weight"):  # Command R+'s q/k norms: a row a head
        t = torch.rand(shape, generator=gen) + 0.5
        if name == "model.norm.weight":
            t *= LOGIT_SCALE
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            t *= QK_NORM_SCALE
        return t.to(dtype)
    std = shape[-1] ** -0.5  # fan_in; for embeddings and lm_head 1/sqrt(hidden) gives unit-norm rows
    out = torch.empty(shape, dtype=dtype)
    rows = max(1, _CHUNK_ELEMENTS // math.prod(shape[1:]))
    for start in range(0, shape[0], rows):
        chunk = out[start : start + rows]
        chunk.copy_(torch.randn(chunk.shape, generator=gen).mul_(std))
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        out[TOKENIZER_SIZE:] = 0  # padding ids the tokenizer never emits: logit 0, never the argmax
    return out


def plan_shards(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Group tensors as huggingface_hub's `split_torch_state_dict_into_shards` does.

    A tensor larger than the limit gets a shard of its own; otherwise the current shard is closed
    when the next tensor would overflow it.
    """
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if nbytes > max_shard_size:
            shards.append([name])
            continue
        if current and used + nbytes > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        shards.append(current)
    return shards


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def make_model(
    preset: str,
    out: Path,
    seed: int = 0,
    max_shard_size: str | int = "2GB",
    dtype: str | None = None,
    num_layers: int | None = None,
) -> Path:
    """Write config, generation config, safetensors weights and tokenizer files of `preset` into `out`.

    `dtype` defaults to the preset's (float32 for test presets, bfloat16 for real ones); `num_layers` keeps the
    first layers only (each of the preset's shape).
    """
    config = get_preset(preset)
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
        for key in ("layer_types", "mlp_only_layers"):
            if config.get(key):
                config[key] = config[key][:num_layers] if key == "layer_types" else [
                    i for i in config[key] if i < num_layers]
    dtype = dtype or config["dtype"]
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    torch_dtype = _DTYPES[dtype]
    config["dtype"] = config["torch_dtype"] = dtype
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    shapes = dict(tensor_shapes(config))
    itemsize = torch_dtype.itemsize
    # MXFP4: half a byte a value and a byte a block of 32
    sizes = [(name, math.prod(shape) * 17 // 32 if _mxfp4(config, name) else math.prod(shape) if _fp8(config, name)
              else math.prod(shape) * itemsize) for name, shape in shapes.items()]
    shards = plan_shards(sizes, parse_size(max_shard_size))
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]

    weight_map = {}
    for file, names in zip(files, shards):
        offset = 1.0 if config["model_type"] in (*GEMMA, "nemotron") else 0.0
        tensors = {}
        for name in names:
            if _mxfp4(config, name):
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4(
                    init_tensor(name, shapes[name], seed, torch.float32))
            elif _fp8(config, name):
                tensors[name], tensors[f"{name}_scale_inv"] = quantize_fp8_blocks(
                    init_tensor(name, shapes[name], seed, torch.float32),
                    tuple(config["quantization_config"]["weight_block_size"]))
            else:
                tensors[name] = init_tensor(name, shapes[name], seed, torch_dtype, offset)
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors  # free this shard before drawing the next one
    if len(files) > 1:
        total = sum(nbytes for _, nbytes in sizes)
        _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})

    _write_json(out / "config.json", config)
    write_qwen_tokenizer(out)
    if config["model_type"] in ENCODERS:  # an embedding model as bge's is published: [CLS] pooled, normalised
        add_encoder_special_tokens(out)
        write_sentence_transformers(out, "cls_token", normalize=True)
    else:
        _write_json(out / "generation_config.json", GENERATION_CONFIG)
    return out


def write_sentence_transformers(model_dir: Path, mode: str, normalize: bool) -> None:
    """sentence-transformers' files of an embedding checkpoint: modules.json with a Pooling module of `mode` (its
    config.json key, e.g. cls_token, mean_tokens, lasttoken) and, where asked, a Normalize one."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    config = {"word_embedding_dimension": 64, **{f"pooling_mode_{m}": m == mode for m in modes}}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(config))


def cache_root() -> Path:
    """`$SPLITSERVE_CACHE`, else `~/.cache/splitserve`."""
    return Path(os.environ.get("SPLITSERVE_CACHE") or Path.home() / ".cache" / "splitserve")


def default_model_dir(preset: str = DEFAULT_PRESET, seed: int = 0) -> Path:
    """Where `ensure_model` keeps `preset` written with `seed`."""
    return cache_root() / "models" / f"{preset}-seed{seed}"


def ensure_model(preset: str = DEFAULT_PRESET, seed: int = 0) -> Path:
    """The cached checkpoint folder of `preset`, written once.

    Written into a temporary sibling folder and renamed into place, so a folder that exists is
    complete; when two processes race, the loser's copy is discarded.
    """
    final = default_model_dir(preset, seed)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        make_model(preset, tmp, seed=seed)
        tmp.chmod(0o755)  # mkdtemp makes it private
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(model_dir: Path, out: Path, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                      targets: tuple[str, ...] = LORA_TARGETS, std: float = 0.05) -> Path:
    """A LoRA adapter of the checkpoint in `model_dir`, in PEFT's layout (adapter_config.json, adapter_model.safetensors
    with `base_model.model.<module>.lora_A.weight` [rank, in] and `lora_B.weight` [out, rank]) over every projection
    of the checkpoint named by `targets`. Random A and B (PEFT starts B at zero, which would change nothing)."""
    from safetensors import safe_open

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in sorted(f.keys()):
                module = name.removesuffix(".weight")
                if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets:
                    continue
                rows, cols = f.get_slice(name).get_shape()
                key = f"base_model.model.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, cols, generator=generator) * std
                tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=generator) * std
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
              "target_modules": sorted(targets), "bias": "none", "use_rslora": False, "modules_to_save": None,
              "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
