"""gpt-oss (openai/gpt-oss-20b, gpt-oss-120b): sliding-window (128) and global layers alternating, a learnt sink per
head in each attention softmax, q/k/v/o biases, YaRN rope; routed experts on every layer with biases on the router
and on every expert's projections, the top k's logits softmaxed among themselves, and a clamped SwiGLU
(kernels.clamped_swiglu). Published checkpoints store the experts in MXFP4 (model/quantized.py: dequantised at load);
transformers saves them in 16 or 32 bits, each projection of every expert as one [experts, in, out] tensor with gate
and up interleaved by column: `converted` brings both to the [experts, out, in] halves the experts load."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from worker_svc.model.config import ModelConfig, MoeConfig
from worker_svc.model.layers import CausalLM
from worker_svc.model.loader import CheckpointTensor
from worker_svc.model.quantized import dequantize_mxfp4

EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _halves(t: torch.Tensor) -> torch.Tensor:
    """gate_up's rows (or a bias's columns) interleaved gate, up, gate, ... -> all of gate, then all of up."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def _ours(name: str, experts: torch.Tensor) -> torch.Tensor:
    """An [experts, out, in] projection in the layout FusedExperts loads."""
    return _halves(experts) if name.endswith(".gate_up_proj") else experts


class GptOssForCausalLM(CausalLM):
    renamed_fragments = {".mlp.router.": ".mlp.gate."}

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        layers, bias = raw["num_hidden_layers"], raw.get("attention_bias", True)
        types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(layers)]
        moe = MoeConfig(num_experts=raw["num_local_experts"], top_k=raw["num_experts_per_tok"],
                        intermediate_size=raw["intermediate_size"], norm_topk_prob=True, layers=tuple(range(layers)),
                        bias=True, swiglu_limit=raw.get("swiglu_limit", 7.0))
        return ModelConfig.common(
            raw, qkv_bias=bias, o_bias=bias, attention_sinks=True, moe=moe,
            layer_windows=tuple(raw["sliding_window"] if t == "sliding_attention" else None for t in types))

    def converted(self, tensors: Iterator[CheckpointTensor]) -> Iterator[CheckpointTensor]:
        """The experts' tensors as FusedExperts loads them: MXFP4 `*_blocks` and `*_scales` pairs dequantised
        ([experts, out, in] as stored), 16/32-bit ones ([experts, in, out]) transposed, gate and up de-interleaved,
        `*_proj_bias` as the projection's `.bias`; every other tensor as it is."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, get, file in tensors:
            base, _, part = name.rpartition("_")
            if part in ("blocks", "scales") and base.endswith(EXPERTS):
                pair = pending.setdefault(base, {})
                pair[part] = get()  # now: the other half may lie in another file
                if len(pair) == 2:
                    weight = _ours(base, dequantize_mxfp4(pair["blocks"], pair["scales"]))
                    yield base, lambda w=weight: w, file
                    del pending[base]
            elif name.endswith(EXPERTS):
                yield name, lambda name=name, get=get: _ours(name, get().transpose(1, 2)), file
            elif base.endswith(EXPERTS) and part == "bias":
                yield f"{base}.bias", lambda base=base, get=get: _ours(base, get()), file
            else:
                yield name, get, file
        if pending:
            raise KeyError(f"MXFP4 experts without both blocks and scales: {sorted(pending)[:3]}")
