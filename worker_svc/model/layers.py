"""Layers the architectures compose (model/qwen3.py, llama.py, ...); each calls the kernels its runner selected
(worker_svc.kernels). A dense decoder-only architecture is CausalLM with the features of its ModelConfig."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from worker_svc.kernels import Kernels
from worker_svc.kernels.attention import AttentionMetadata
from worker_svc.model.config import ModelConfig, RopeScaling
from worker_svc.model.parallel import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                       QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding, _shard, tp_rank,
                                       tp_size)


def _norm_weight(size: int, offset: float, order: list[int] | None = None) -> nn.Parameter:
    """A norm's weight. With an offset ((1 + w) norms: Gemma's, Nemotron's), the checkpoint's w is loaded as
    offset + w; with an order, a head's dims as the rope stores them (rotary_order)."""
    weight = nn.Parameter(torch.ones(size), requires_grad=False)
    if offset or order is not None:
        weight.weight_loader = lambda param, w: param.data.copy_((w if order is None else w[order]).float() + offset)
    return weight


class RMSNorm(nn.Module):
    """weight * x / rms(x), its weight as _norm_weight loads it."""

    def __init__(self, size: int, eps: float, kernels: Kernels, offset: float = 0.0,
                 order: list[int] | None = None):
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.weight = _norm_weight(size, offset, order)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    """weight * (x - mean(x)) / std(x) (+ bias: StarCoder 2's, Nemotron's; Cohere's have none) in float32; called as
    RMSNorm is; its weight as _norm_weight loads it (Nemotron's LayerNorm1P: (1 + w))."""

    def __init__(self, size: int, eps: float, bias: bool = False, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight = _norm_weight(size, offset)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(), bias, self.eps).to(x.dtype)


def make_norm(cfg: ModelConfig, kernels: Kernels) -> RMSNorm | LayerNorm:
    """A norm over the hidden state, of the config's kind."""
    if cfg.layer_norm:
        return LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias, cfg.norm_offset)
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, cfg.norm_offset)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None, positions: int = 0) -> torch.Tensor:
    """The rotary inverse frequencies over `head_dim` rotated dims, scaled as the checkpoint's rope_scaling says;
    `positions`: how far they are served (LongRoPE's choice of factors)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "longrope":
        factors = scaling.long_factor if scaling.long_factors(positions) else scaling.short_factor
        return inv_freq / torch.tensor(factors, dtype=torch.float32)
    if scaling.kind == "yarn":  # turning over beta_fast times in the original length: kept; under beta_slow: scaled
        def dim_of(rotations: float) -> float:
            return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low or 0.001)).clamp(0, 1)
        return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)
    # llama3: long wavelengths slowed by `factor`, short ones kept, the band between blended
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rotary_order(head_dim: int, rotary_dim: int | None, interleaved: bool) -> list[int] | None:
    """Where a head's dims are stored so that the rope kernels' pairs (i, i + head_dim / 2) are the model's: rope
    turns only the first rotary_dim (partial_rotary_factor), pairing dim i with i + rotary_dim / 2, or (interleaved,
    GLM's) 2i with 2i + 1. Stored as [first of each rotated pair, first half of the passed dims, second of each
    rotated pair, second half of the passed dims], the passed ones taking a turn of 0. q and k are stored in this
    order (their dot products are unchanged), so no kernel knows of it. None: the stored order is rope's already."""
    rotary_dim = rotary_dim or head_dim
    if rotary_dim == head_dim and not interleaved:
        return None
    half, passed = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first, second = (range(0, rotary_dim, 2), range(1, rotary_dim, 2)) if interleaved else (
        range(half), range(half, rotary_dim))
    return [*first, *range(rotary_dim, rotary_dim + passed), *second, *range(rotary_dim + passed, head_dim)]


class RotaryEmbedding(nn.Module):
    """The cos/sin table of rotary position embedding, shared by the layers that take it: [cos | sin] of head_dim / 2
    columns each, the columns past rotary_dim / 2 a turn of 0 (heads in rotary_order; all of them with rotary_dim
    0: a layer without rope)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim  # 0: no rope (a turn of 0 everywhere)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                            rope_frequencies(rotary_dim, theta, scaling, max_positions))
        cos, sin = freqs.cos(), freqs.sin()
        if scaling is not None and scaling.attention_factor != 1.0:  # yarn's and longrope's
            cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        passed = (head_dim - rotary_dim) // 2
        table = torch.cat([nn.functional.pad(cos, (0, passed), value=1.0), nn.functional.pad(sin, (0, passed))], -1)
        self.register_buffer("cos_sin", table, persistent=False)


def scale_queries(q: torch.Tensor, positions: torch.Tensor, log_scale: tuple[float, int] | None) -> torch.Tensor:
    """q [tokens, heads, dim] times 1 + beta * log(1 + floor(position / length)) (ModelConfig.query_log_scale), in
    q's dtype as transformers rounds it; q itself without one."""
    if log_scale is None:
        return q
    beta, length = log_scale
    scale = 1 + beta * torch.log1p(torch.floor(positions.float() / length))
    return q * scale.to(q.dtype)[:, None, None]


class NormOverHeads(nn.Module):
    """RMSNorm over all of q's (or k's) heads at once (OLMo 2's q/k norms): this rank's heads' share of the weight
    (each head's dims in rotary_order), the sum of squares all-reduced over the ranks the heads are split across."""

    def __init__(self, heads: int, head_dim: int, eps: float, kernels: Kernels, order: list[int] | None):
        super().__init__()
        self.eps, self.kernels, self.width = eps, kernels, heads * head_dim
        self.weight = nn.Parameter(torch.ones(heads * head_dim // tp_size()), requires_grad=False)

        def load(param: nn.Parameter, w: torch.Tensor) -> None:
            if order is not None:
                w = w.unflatten(0, (-1, head_dim))[:, order].flatten()
            param.data.copy_(_shard(w, 0, tp_rank(), tp_size()))

        self.weight.weight_loader = load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        squares = x.float().pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares)
        return self.weight * (x.float() * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)


class HeadLayerNorm(nn.Module):
    """A LayerNorm of each head over its dims, each with a weight of its own (Cohere's q/k norms, use_qk_norm): this
    rank's `heads` from head `first` on (each head's dims in rotary_order: the mean and variance do not change)."""

    def __init__(self, heads: int, first: int, head_dim: int, eps: float, order: list[int] | None):
        super().__init__()
        self.eps, self.head_dim = eps, head_dim
        self.weight = nn.Parameter(torch.ones(heads, head_dim), requires_grad=False)

        def load(param: nn.Parameter, w: torch.Tensor) -> None:
            w = w.narrow(0, first, heads)
            param.data.copy_(w if order is None else w[:, order])

        self.weight.weight_loader = load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.unflatten(-1, (-1, self.head_dim)).float()
        normed = nn.functional.layer_norm(heads, heads.shape[-1:], eps=self.eps) * self.weight.float()
        return normed.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Packed QKV projection, (q/k norm,) rope and the KV-cache store in one kernel, paged attention (over the
    layer's window, if any), output projection."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        order = rotary_order(cfg.head_dim, cfg.rotary_dim, cfg.rope_interleaved)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, kernels, bias=cfg.qkv_bias, head_order=order)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, kernels,
                                        bias=cfg.o_bias)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels, cfg.norm_offset, order)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels, cfg.norm_offset, order)
        # q and k normed before the fused kernel, which norms a head at a time with one weight for all
        self.norms_apart = cfg.qk_norm_over_heads or cfg.qk_layer_norm
        if cfg.qk_layer_norm:
            proj = self.qkv_proj
            self.q_norm = HeadLayerNorm(self.num_heads, proj.tp_rank * self.num_heads, cfg.head_dim,
                                        cfg.rms_norm_eps, order)
            self.k_norm = HeadLayerNorm(self.num_kv_heads, proj.first_kv_head, cfg.head_dim, cfg.rms_norm_eps, order)
        if cfg.qk_norm_over_heads:
            if cfg.num_key_value_heads < tp_size():
                raise ValueError(f"q/k norms over all heads need the {cfg.num_key_value_heads} KV heads split, not "
                                 f"replicated, over tensor-parallel size {tp_size()}")
            self.q_norm = NormOverHeads(cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps, kernels, order)
            self.k_norm = NormOverHeads(cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, kernels, order)
        self.eps = cfg.rms_norm_eps
        self.rotary = rotary
        self.window = cfg.window_of(layer)
        self.scale = cfg.attention_scale or cfg.head_dim ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        self.query_log_scale = cfg.query_log_scale
        self.sinks = None
        if cfg.attention_sinks:  # this rank's heads' (float32, as the kernels read them)
            self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = lambda param, w: param.data.copy_(_shard(w, 0, tp_rank(), tp_size()))
        # bound by the ModelRunner once allocated; an fp8 cache holds k / k_scale and v / v_scale
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = 1.0

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_weight = k_weight = None
        if self.norms_apart:
            q, k, v = qkv.split([self.q_norm.weight.numel(), self.k_norm.weight.numel(), self.k_norm.weight.numel()],
                                dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        elif self.q_norm is not None:
            q_weight, k_weight = self.q_norm.weight, self.k_norm.weight
        q = self.kernels.qk_norm_rope_store(qkv, positions, self.rotary.cos_sin, q_weight, k_weight,
                                            self.eps, self.k_cache, self.v_cache, meta.slot_mapping,
                                            self.num_heads, self.num_kv_heads, self.k_scale, self.v_scale)
        q = scale_queries(q, positions, self.query_log_scale)
        o = self.kernels.attention.forward(q, self.k_cache, self.v_cache, meta, self.scale, self.k_scale,
                                           self.v_scale, window=self.window, softcap=self.softcap,
                                           sinks=self.sinks)
        return self.o_proj(o.flatten(1))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one matmul; act silu (SwiGLU) or gelu (GeGLU). `intermediate`:
    other than the config's (a shared expert's); `reduce=False`: down's partial sums left to the caller's
    all-reduce."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels, intermediate: int | None = None, reduce: bool = True):
        super().__init__()
        intermediate = intermediate or cfg.intermediate_size
        self.act_and_mul = kernels.silu_and_mul if cfg.hidden_act == "silu" else kernels.gelu_and_mul
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [intermediate] * 2, kernels,
                                                       bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(intermediate, cfg.hidden_size, kernels, bias=cfg.mlp_bias, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def scale_output(self, factor: float) -> None:
        scale_rows(self.down_proj, factor)


# config.PLAIN_ACTIVATIONS: BERT's, StarCoder 2's, Nemotron's (relu2: relu(x) squared)
_PLAIN_ACTIVATIONS = {"gelu": nn.functional.gelu, "relu": nn.functional.relu,
                      "relu2": lambda x: nn.functional.relu(x).square(),
                      "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
                      "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """down(act(up(x))), not gated (BERT's, StarCoder 2's, Nemotron's)."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels, act: str, bias: bool):
        super().__init__()
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, kernels, bias=bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, kernels, bias=bias)
        self.act = _PLAIN_ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))

    def scale_output(self, factor: float) -> None:
        scale_rows(self.down_proj, factor)


def scale_rows(proj: nn.Module, factor: float) -> None:
    """A loaded projection's output times `factor`, folded into its weight (an FP8 weight's block scales), its bias
    and its LoRA adapters' B: no kernel spends time on it."""
    scale = getattr(proj, "weight_scale", None)
    (proj.weight if scale is None else scale).mul_(factor)
    if getattr(proj, "bias", None) is not None:
        proj.bias.mul_(factor)
    if getattr(proj, "lora", None) is not None:
        proj.lora.b.mul_(factor)
        proj.lora.scale *= factor  # adapters loaded later too


def make_mlp(cfg: ModelConfig, layer: int, kernels: Kernels) -> nn.Module:
    """The layer's MLP: routed experts where the config puts them, else the dense one."""
    if cfg.moe is not None and layer in cfg.moe.layers:
        from worker_svc.model.moe import SparseMoE

        return SparseMoE(cfg, kernels)
    return GatedMLP(cfg, kernels) if cfg.gated_mlp else MLP(cfg, kernels, cfg.hidden_act, cfg.mlp_bias)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, the residual added inside the next norm. With sandwich norms (Gemma) the
    attention's and the MLP's outputs are normed too before they join the residual stream (post_attention_layernorm
    then norms the attention output, and pre_feedforward_layernorm the MLP's input); with post norms (OLMo 2) only
    those outputs are (post_attention_layernorm and post_feedforward_layernorm), the layers passing the whole hidden
    state. A parallel block (Cohere) has one norm: attention and MLP both read its output, and their sum joins the
    residual."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, kernels: Kernels):
        super().__init__()
        norm = lambda: make_norm(cfg, kernels)  # noqa: E731
        self.post_norms, self.parallel = cfg.post_norms, cfg.parallel_block
        if cfg.mla is not None:
            from worker_svc.model.mla import MultiLatentAttention

            self.self_attn = MultiLatentAttention(cfg, layer, rotary, kernels)
        else:
            self.self_attn = Attention(cfg, layer, rotary, kernels)
        self.mlp = make_mlp(cfg, layer, kernels)
        self.input_layernorm, self.post_attention_layernorm = norm(), None if cfg.parallel_block else norm()
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        if cfg.post_norms:
            self.input_layernorm, self.post_feedforward_layernorm = None, norm()

    def forward(self, positions, x, residual, meta):
        if self.post_norms:  # OLMo 2: the layer's input whole (no residual apart), each output normed before its add
            x = x + self.post_attention_layernorm(self.self_attn(positions, x, meta))
            return x + self.post_feedforward_layernorm(self.mlp(x)), None
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.parallel:
            return self.self_attn(positions, x, meta) + self.mlp(x), residual
        x = self.self_attn(positions, x, meta)
        if self.pre_feedforward_layernorm is None:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class CausalLM(nn.Module):
    """A dense decoder-only language model in Hugging Face's layout (`model.layers.N...`, `lm_head`). An
    architecture subclasses it with `config(raw)`: how its config.json reads into a ModelConfig."""

    # checkpoint names: the prefix stripped (the first that matches), prefixes of tensors this model leaves, and
    # fragments renamed to the ones below (Mixtral's `block_sparse_moe.experts.3.w1` is `mlp.experts.3.gate_proj`)
    checkpoint_prefixes: tuple[str, ...] = ("model.",)
    ignored_prefixes: tuple[str, ...] = ()
    renamed_fragments: dict[str, str] = {}
    # checkpoint name fragment -> (our packed parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                 cfg.rotary_dim)
        local = rotary  # the windowed layers' own rope (Gemma 3), where the config gives one
        if cfg.local_rope_theta is not None:
            local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta,
                                    rotary_dim=cfg.rotary_dim)
        nope = None  # the layers without rope (SmolLM3's)
        if cfg.nope_layers:
            nope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, 1.0, rotary_dim=0)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, nope if i in cfg.nope_layers else local if cfg.window_of(i) else rotary, kernels)
            for i in range(cfg.num_hidden_layers))
        self.norm = make_norm(cfg, kernels)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.ignored_prefixes = type(self).ignored_prefixes + tuple(
            f"model.layers.{cfg.num_hidden_layers + i}." for i in range(cfg.mtp_layers))

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        raise NotImplementedError

    @torch.no_grad()
    def fold_scales(self) -> None:
        """After loading: the config's output scales multiplied into the weights that produce those outputs, so
        that no step spends a kernel on them: the residual scale into every layer's o_proj and its MLP's down
        projections (the experts' too; rows of a row-parallel weight: each rank's share), the logit scale into
        the final norm's weight."""
        cfg = self.config
        if cfg.residual_scale != 1.0:
            for layer in self.layers:
                scale_rows(layer.self_attn.o_proj, cfg.residual_scale)
                layer.mlp.scale_output(cfg.residual_scale)
        if cfg.logit_scale != 1.0:
            assert cfg.norm_offset == 0.0 and not cfg.norm_bias, "the final norm's weight alone scales its output"
            self.norm.weight.mul_(cfg.logit_scale)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Returns the final hidden states of every input token; `compute_logits` takes the rows needed."""
        x, residual = self.embed_tokens(input_ids), None
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)  # rounded to the dtype, as Gemma's
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(hidden, out)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap, out=logits).mul_(cap)
        return logits


# a plain MLP's models: q, k and v packed as every model's, while their MLP's up projection is not gate_up's half
PLAIN_MLP_PACKED = {k: v for k, v in CausalLM.packed_modules.items() if k not in ("gate_proj", "up_proj")}
