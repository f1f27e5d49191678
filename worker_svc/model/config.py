"""The model's shape, read from a Hugging Face config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# --kv-cache-dtype: `auto` keeps K and V in the model's dtype; `fp8` stores e4m3 values with a scale per layer
# and tensor (half the bytes: about twice the blocks in the same memory, outputs no longer bit-identical)
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}


@dataclass(slots=True, frozen=True)
class ModelConfig:
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

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        model_type = raw.get("model_type")
        if model_type != "qwen3":
            raise ValueError(f"unsupported model_type {model_type!r}: only dense qwen3 is implemented")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {rope['rope_type']!r}")
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta") or rope.get("rope_theta", 10000.0),
            max_position_embeddings=raw.get("max_position_embeddings", 40960),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            dtype=DTYPES[str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16")],
        )
