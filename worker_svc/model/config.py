"""The model's shape, read from a Hugging Face config.json: the fields every architecture of the registry
(model/registry.py) reads, with the features that tell them apart."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from common import model_files
from worker_svc.model.awq import Awq
from worker_svc.model.bitsandbytes import BitsAndBytes
from worker_svc.model.compressed_tensors import CompressedTensors
from worker_svc.model.gptq import Gptq
from typing import Callable

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# --kv-cache-dtype: `auto` keeps K and V in the model's dtype; `fp8` stores e4m3 values with a scale per layer
# and tensor (half the bytes: about twice the blocks in the same memory, outputs no longer bit-identical)
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # of the gated MLP: SwiGLU, GeGLU
PLAIN_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "relu2")  # of a plain one (layers.MLP)


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """Scaled rotary frequencies: Llama 3's frequency-dependent scaling (`rope_type: llama3`), YaRN's (`yarn`: Qwen's
    long-context setting, DeepSeek), LongRoPE's (`longrope`: Phi-3.5, Phi-4-mini, the Phi-3 128k models) or a linear
    one."""
    kind: str  # "llama3", "yarn", "longrope" or "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the frequencies between beta_fast and beta_slow rotations over the original length blend from kept to
    # interpolated (the bounds rounded outwards with truncate), and cos / sin are scaled by attention_factor
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0  # yarn and longrope: cos and sin scaled by it
    # longrope: a divisor per frequency, the long ones where the served length passes the original one
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def long_factors(self, positions: int) -> bool:
        """Whether LongRoPE takes its long factors on a worker serving `positions`: where that passes the original
        length, for every sequence, as a position's rope cannot depend on how long its sequence grows later (its K
        is cached). vLLM decides the same way; transformers switches per call by the sequence's own length."""
        return self.kind == "longrope" and positions > self.original_max_position_embeddings


@dataclass(slots=True, frozen=True)
class MoeConfig:
    """Routed experts (Qwen3-MoE): each token's top_k of num_experts, on the layers listed."""
    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    norm_topk_prob: bool    # the top-k routing weights renormalised to sum to 1
    layers: tuple[int, ...]  # the layers whose MLP is the experts (the others keep a dense MLP)
    shared_intermediate_size: int = 0  # a shared expert every token takes (0: none)
    shared_expert_gated: bool = True   # its output scaled by sigmoid(x . shared_expert_gate) (Qwen2-MoE; GLM's not)
    # the router's scores: "softmax" (Qwen, Mixtral, ERNIE 4.5) or "sigmoid" (GLM-4.5's, DeepSeek-V3's). With
    # score_correction_bias (GLM-4.5, ERNIE 4.5) the experts are chosen by score plus a learnt per-expert bias, among
    # the best topk_groups of num_groups groups of experts, and weighted by their scores (renormalised with
    # norm_topk_prob) times routed_scaling_factor; without, the top k scores are the weights
    scoring: str = "softmax"
    score_correction_bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # a group's rank: the sum of its two best scores (DeepSeek-V3's, GLM-4.5's) or its best one (DeepSeek-V2's)
    group_score: str = "top2"
    # "softmax": logits in the model's dtype, the top k of their softmax (Qwen, Mixtral); "deepseek": float32 logits,
    # the choice above (sigmoid or softmax scores, a correction bias, groups, a scaling factor) as DeepSeek's
    router: str = "softmax"
    bias: bool = False  # gpt-oss: biases on the router's logits and on every expert's projections
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU (kernels.clamped_swiglu); None: plain SwiGLU


@dataclass(slots=True, frozen=True)
class MlaConfig:
    """DeepSeek-V2/V3's multi-head latent attention: q from the hidden state (through a rank-q_lora_rank bottleneck
    where set), K's rope part (qk_rope_head_dim, one for every head) and a kv_lora_rank latent from which each head's
    K (qk_nope_head_dim more dims) and V (v_head_dim) are projected."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(slots=True, frozen=True)
class EncoderConfig:
    """An encoder's (BERT's, model/bert.py): its attention sees both ways, its positions are a learnt table."""
    positions: int        # rows of the position table, the first `position_offset` standing for padding (RoBERTa's)
    position_offset: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str       # of its MLP, not gated: gelu (erf), gelu_new (tanh), relu


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    qk_norm: bool = False          # per-head RMSNorm of q and k before rope (Qwen3)
    qk_norm_over_heads: bool = False  # RMSNorm of q and of k over all their heads at once (OLMo 2, OLMoE)
    qk_layer_norm: bool = False    # Cohere's use_qk_norm: a LayerNorm of each head's q and k, weights per head
    post_norms: bool = False       # OLMo 2: no norm before the attention or the MLP, one on each's output
    layer_norm: bool = False       # Cohere: the norms subtract the mean (LayerNorm, no bias), not RMSNorm
    parallel_block: bool = False   # Cohere: attention and MLP read the same normed input, their outputs added
    norm_bias: bool = False        # StarCoder 2: the LayerNorms have biases
    gated_mlp: bool = True         # False: down(act(up(x))) (StarCoder 2), not down(act(gate(x)) * up(x))
    qkv_bias: bool = False         # biases on the q, k and v projections (Qwen2, Llama's attention_bias)
    o_bias: bool = False           # a bias on the output projection (Llama's attention_bias)
    mlp_bias: bool = False         # biases on gate, up and down (Llama's mlp_bias)
    rope_scaling: RopeScaling | None = None
    rotary_dim: int | None = None  # rope over the first rotary_dim of each head (partial_rotary_factor), None: all
    nope_layers: tuple[int, ...] = ()  # layers without rope (SmolLM3's NoPE layers)
    rope_interleaved: bool = False  # rope turns dims (2i, 2i + 1) together (GLM's), not (i, i + rotary_dim / 2)
    sliding_window: int | None = None  # every layer attends to its last `sliding_window` tokens (Mistral)
    moe: MoeConfig | None = None
    hidden_act: str = "silu"       # the gated MLP's: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU, Gemma)
    # Gemma 3: a window per layer (None: global), local layers' own rope, (1 + w) norms, norms around the
    # attention and the MLP outputs too, embeddings times sqrt(hidden), its own attention scale, logit softcap
    layer_windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attention_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: attention scores capped to c * tanh(s / c)
    attention_sinks: bool = False  # gpt-oss: a learnt logit per head joins its softmax (AttentionBackend.forward)
    # Llama 4's and Mistral 4's (Ministral 3's): q times 1 + beta * log(1 + floor(position / length)), (beta, length)
    query_log_scale: tuple[float, int] | None = None
    # DeepSeek-V2/V3: latent attention (model/mla.py), one "KV head" of the latent and K's rope dims cached (head_dim)
    mla: MlaConfig | None = None
    # Granite: the attention's and the MLP's outputs scaled before the residual add, and the logits scaled; both
    # folded into the weights that produce them at load (CausalLM.fold_scales)
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    mtp_layers: int = 0  # multi-token-prediction layers stored after the last one (GLM-4.5's): not loaded
    fp8_weight_block: tuple[int, int] | None = None  # an FP8 block-scaled checkpoint's blocks (model/quantized.py)
    # a compressed-tensors (or scaled FP8), AWQ, GPTQ or bitsandbytes checkpoint's scheme: dequantised as it loads
    weight_scheme: CompressedTensors | Awq | Gptq | BitsAndBytes | None = None
    # a sequence classifier's head in the LM head's place (*ForSequenceClassification, vLLM's classifier_from_token)
    classifier: model_files.Classifier | None = None
    encoder: EncoderConfig | None = None  # an encoder-only model: bidirectional attention, embeddings only

    @property
    def causal(self) -> bool:
        return self.encoder is None

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows is not None else self.sliding_window

    @property
    def kv_window(self) -> int:
        """How far back any layer reads: the longest window when every layer has one, else 0 (the whole
        context). KV blocks wholly before it are read by no later step."""
        windows = [self.window_of(i) for i in range(self.num_hidden_layers)]
        return 0 if None in windows else max(windows)

    @classmethod
    def from_dir(cls, model_dir: str | Path, overrides: dict | None = None) -> "ModelConfig":
        """The config.json of model_dir, `overrides` (--hf-overrides) over its top-level keys; ValueError for an
        architecture, rope or classifier this worker does not serve."""
        from worker_svc.model.registry import architecture_of

        raw = model_files.config_json(model_dir, overrides)
        if not raw:
            raise FileNotFoundError(f"no config.json in {model_dir}")
        arch = architecture_of(raw)
        return dataclasses.replace(arch.config(raw), architecture=arch.__name__,
                                   classifier=model_files.classifier(raw))

    @property
    def fp8_blocks(self) -> tuple[int, int] | None:
        """The blocks an FP8 checkpoint stores its projections' codes in, whichever its format; None for others."""
        return self.fp8_weight_block or (self.weight_scheme.fp8_blocks if self.weight_scheme else None)

    @classmethod
    def common(cls, raw: dict, **features) -> "ModelConfig":
        """The fields every architecture reads the same way, plus its `features`."""
        heads, positions = raw["num_attention_heads"], raw.get("max_position_embeddings", 40960)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        act = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        partial = raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        allowed = ACTIVATIONS if features.get("gated_mlp", True) else PLAIN_ACTIVATIONS
        if act not in allowed:
            raise ValueError(f"unsupported hidden_act {act!r} ({', '.join(allowed)})")
        return cls(
            architecture=raw["architectures"][0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta") or rope.get("rope_theta", 10000.0),
            hidden_act=act,
            max_position_embeddings=positions,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            dtype=DTYPES[str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16")],
            rope_scaling=rope_scaling(rope, positions, raw.get("original_max_position_embeddings")),
            rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
            **checkpoint_quantization(raw.get("quantization_config")),
            **features,
        )


QUANTIZATIONS = ("fp8 (blocks or per tensor)", "mxfp4 (gpt-oss)", "compressed-tensors", "awq (gemm)",
                 "gptq (2, 4 or 8 bits)", "modelopt (FP8)", "fbgemm_fp8", "bitsandbytes")


def checkpoint_quantization(quantization: dict | None) -> dict:
    """The ModelConfig fields that say how a checkpoint's weights are stored, by its `quant_method`: FP8 blocks
    (model/quantized.py), compressed-tensors or scaled FP8 (model/compressed_tensors.py), AWQ (model/awq.py), GPTQ
    (model/gptq.py) or bitsandbytes (model/bitsandbytes.py) schemes; none for one not quantized or in MXFP4 (gpt-oss's
    experts, model/gpt_oss.py). Any other refused with the supported list, as is a scheme its parser does not serve."""
    method = (quantization or {}).get("quant_method")
    if method in (None, "mxfp4"):
        return {}
    if method == "fp8" and quantization.get("weight_block_size"):
        rows, cols = quantization["weight_block_size"]
        return {"fp8_weight_block": (rows, cols)}
    if method in ("fp8", "modelopt", "fbgemm_fp8"):  # FP8 codes, a scale per tensor or channel
        return {"weight_scheme": CompressedTensors.scaled_fp8(quantization)}
    if method == "compressed-tensors":
        return {"weight_scheme": CompressedTensors.parse(quantization)}
    if method == "awq":
        return {"weight_scheme": Awq.parse(quantization)}
    if method == "gptq":
        return {"weight_scheme": Gptq.parse(quantization)}
    if method == "bitsandbytes":
        return {"weight_scheme": BitsAndBytes.parse(quantization)}
    raise ValueError(f"unsupported quantization_config {quantization!r} (supported: {', '.join(QUANTIZATIONS)}); its "
                     "weights would not load")


def rope_scaling(rope: dict, max_positions: int, original: int | None = None) -> RopeScaling | None:
    """The checkpoint's rope scaling, read as transformers reads it; `original`: a config's top-level
    original_max_position_embeddings, which wins over the rope's (else the rope's, else max_positions)."""
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind in ("default", "mrope"):  # mrope (Qwen-VL): plain rope over text (model/qwen_vl.py)
        return None
    original = original or rope.get("original_max_position_embeddings") or max_positions
    if kind == "llama3":
        return RopeScaling("llama3", rope["factor"], rope.get("low_freq_factor", 1.0),
                           rope.get("high_freq_factor", 4.0), original)
    if kind == "linear":
        return RopeScaling("linear", rope["factor"])
    if kind == "yarn":
        factor = rope["factor"]
        attention = rope.get("attention_factor")
        if attention is None:
            mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                         if mscale and mscale_all_dim else _yarn_mscale(factor))
        return RopeScaling("yarn", factor, original_max_position_embeddings=original,
                           beta_fast=rope.get("beta_fast") or 32.0, beta_slow=rope.get("beta_slow") or 1.0,
                           truncate=rope.get("truncate", True), attention_factor=float(attention))
    if kind == "longrope":  # the default scale from the ratio of lengths, as transformers derives it for Phi-3
        factor = rope.get("factor") or max_positions / original
        attention = rope.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        return RopeScaling("longrope", factor, original_max_position_embeddings=original,
                           attention_factor=float(attention), short_factor=tuple(rope["short_factor"]),
                           long_factor=tuple(rope["long_factor"]))
    raise ValueError(f"unsupported rope_type {kind!r} (default, linear, llama3, yarn, longrope)")


def rope_by_layer_type(raw: dict, theta: float, local_theta_key: str | None = None,
                       local_theta: float | None = None) -> tuple[float, float, RopeScaling | None]:
    """(global layers' rope base, sliding-window layers' base, global layers' scaling) of a model whose two kinds of
    layers take their own rope (Gemma 3, OLMo 3): transformers 5's `rope_parameters` by layer type, or the published
    rope_theta and rope_scaling (global layers' scaling only) with the local base at `local_theta_key` (else the
    global one); `theta` and `local_theta`: the architecture's defaults."""
    rope, positions = raw.get("rope_parameters") or {}, raw["max_position_embeddings"]
    if "full_attention" in rope:
        full, local = rope["full_attention"], rope.get("sliding_attention") or {}
        theta = full.get("rope_theta", theta)
        if rope_scaling(local, positions) is not None:
            raise ValueError("a scaled rope on sliding-window layers is not supported")
        return theta, local.get("rope_theta", local_theta or theta), rope_scaling(full, positions)
    theta = raw.get("rope_theta", theta)
    local = raw.get(local_theta_key, local_theta) if local_theta_key else theta
    return theta, local, rope_scaling(raw.get("rope_scaling") or {}, positions)


def query_log_scale(raw: dict) -> tuple[float, int] | None:
    """(beta, length) of a config whose rope parameters carry `llama_4_scaling_beta` (Mistral 4's, Ministral 3's):
    the length is the rope's original_max_position_embeddings."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    beta = rope.get("llama_4_scaling_beta")
    return (float(beta), int(rope["original_max_position_embeddings"])) if beta else None


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def hybrid_windows(raw: dict) -> tuple[int | None, ...]:
    """Each layer's window in a model whose windowed layers alternate with global ones (EXAONE 4, Cohere 2), as
    transformers reads them: the layers `layer_types` marks, else those `sliding_window_pattern` picks (every n-th
    layer global, or a string of L (local) and G); no window anywhere where sliding_window is not set."""
    layers, window = raw["num_hidden_layers"], raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern") or 0
        types = [("sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention")
                 if isinstance(pattern, str) else
                 "sliding_attention" if pattern and (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    return tuple(window if window and t == "sliding_attention" else None for t in types)


def optional_windows(raw: dict, derived: Callable[[int], bool]) -> tuple[int | None, ...] | None:
    """Each layer's window in configs that turn theirs on with use_sliding_window (Qwen's, SmolLM3's; the published
    ones leave it off), as transformers reads them: on the layers `layer_types` marks, or where it does not (configs
    written before it), on the layers `derived` picks: each architecture has its own rule."""
    if not raw.get("use_sliding_window") or not raw.get("sliding_window"):
        return None
    types = raw.get("layer_types") or ["sliding_attention" if derived(i) else "full_attention"
                                       for i in range(raw["num_hidden_layers"])]
    return tuple(raw["sliding_window"] if t == "sliding_attention" else None for t in types)
