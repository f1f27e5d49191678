"""What a checkpoint's own files say that both the scheduler and the worker read: its tokenizer, its EOS token ids,
the size of a token's K and V, how its embeddings pool; and the arguments its chat template is rendered with, which
the scheduler passes and the gateway's document keeps requests from giving."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from common import tiktoken_bpe

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")  # tokenizer_config.json's, for the template
# what the chat template is rendered with besides a request's keyword arguments
TEMPLATE_ARGUMENTS = ("messages", "tools", "add_generation_prompt", *SPECIAL_TOKEN_KEYS)


def read_json(path: Path) -> dict[str, Any]:
    """The file's JSON object, or {} where the checkpoint has no such file."""
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


@lru_cache(maxsize=4)
def tokenizer_json(model_dir: str | Path) -> str:
    """The checkpoint's tokenizer.json text or, where it ships tiktoken BPE ranks instead (tiktoken.model: Kimi-K2,
    Moonlight), that tokenizer converted (common/tiktoken_bpe.py). FileNotFoundError where it has neither."""
    model_dir = Path(model_dir)
    if (path := model_dir / "tokenizer.json").exists():
        return path.read_text(encoding="utf-8")
    if (ranks := model_dir / tiktoken_bpe.RANKS_FILE).exists():
        config = read_json(model_dir / "tokenizer_config.json")
        return tiktoken_bpe.checkpoint_tokenizer_json(ranks.read_bytes(), config)
    raise FileNotFoundError(f"{model_dir} holds no tokenizer.json (nor {tiktoken_bpe.RANKS_FILE})")


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """generation_config.json's eos_token_id (one or a list), then config.json's, in order and each once."""
    model_dir = Path(model_dir)
    eos: list[int] = []
    for cfg in (read_json(model_dir / "generation_config.json"), read_json(model_dir / "config.json")):
        ids = cfg.get("eos_token_id")
        for i in ids if isinstance(ids, list) else [ids] if ids is not None else []:
            if i not in eos:
                eos.append(i)
    return eos


def kv_bytes_per_token(config: dict[str, Any], element_bytes: int) -> int:
    """K and V of one token over every layer of a config.json's model, at element_bytes an element (DeepSeek's latent
    attention as the worker caches it, its latent and K's rope dims once, V being K: worker_svc/model/mla.py)."""
    if "kv_lora_rank" in config:
        return config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * element_bytes
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * heads * head_dim * element_bytes


POOLING_TYPES = ("last", "mean", "cls")  # how an embedding pools the prompt's final hidden states
_ST_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                     "pooling_mode_cls_token": "cls"}
_ST_MODULE = "sentence_transformers.models."


@dataclass(frozen=True, slots=True)
class Pooling:
    kind: str  # one of POOLING_TYPES
    normalize: bool  # L2-normalised by default


@lru_cache(maxsize=4)
def pooling(model_dir: str | Path) -> Pooling:
    """How the checkpoint's embeddings are made, as its sentence-transformers files say (modules.json: a Pooling
    module's config.json, a Normalize module after it); without them the last token's state, normalised (decoder
    embedding models' way: Qwen3-Embedding, gte-Qwen2, e5-mistral). ValueError for a mode not computed here."""
    model_dir = Path(model_dir)
    path = model_dir / "modules.json"
    if not path.exists():
        return Pooling("last", True)
    modules = {m.get("type", "").removeprefix(_ST_MODULE): m.get("path", "")
               for m in json.loads(path.read_text(encoding="utf-8"))}
    if "Pooling" not in modules:
        return Pooling("last", "Normalize" in modules)
    config = read_json(model_dir / modules["Pooling"] / "config.json")
    modes = [mode for mode, on in config.items() if mode.startswith("pooling_mode_") and on]
    if len(modes) != 1 or modes[0] not in _ST_POOLING_MODES:
        raise ValueError(f"{model_dir.name} pools by {' + '.join(modes) or 'no mode'}; this service pools by one of "
                         f"{', '.join(_ST_POOLING_MODES)}")
    return Pooling(_ST_POOLING_MODES[modes[0]], "Normalize" in modules)


CLASSIFIER_SUFFIX = "ForSequenceClassification"  # transformers' class of a sequence classifier or cross-encoder
# vLLM's overrides (the worker's --hf-overrides) that serve Qwen3-Reranker as published, a causal LM judging "yes" or
# "no", as a cross-encoder: its head the LM head's "yes" row minus its "no" row
QWEN3_RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                            "is_original_qwen3_reranker": True}


def config_json(model_dir: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json's contents, `overrides` (the worker's --hf-overrides, vLLM's) replacing its top-level keys. A
    ModelOpt checkpoint that says how it is quantized only in hf_quant_config.json (nvidia's earlier -FP8 models) gets
    that as its quantization_config, as vLLM reads it."""
    config = {**read_json(Path(model_dir) / "config.json"), **(overrides or {})}
    modelopt = Path(model_dir) / "hf_quant_config.json"
    if config and "quantization_config" not in config and modelopt.exists():
        config["quantization_config"] = {"quant_method": "modelopt", **read_json(modelopt)}
    return config


@dataclass(frozen=True, slots=True)
class Classifier:
    """A sequence classifier's head, as config.json (with the worker's overrides) describes it: its labels in output
    order, and how its logits become probabilities: "sigmoid" each (one label, as a cross-encoder's relevance, or
    multi-label) or "softmax" over them. `from_tokens`: the head is the LM head's rows of these tokens (vLLM's
    `classifier_from_token`), one label each, or with `two_way` (vLLM's `is_original_qwen3_reranker`) one label whose
    logit is the second token's minus the first's (Qwen3-Reranker's "yes" against "no")."""
    labels: tuple[str, ...]
    activation: str
    from_tokens: tuple[str, ...] = ()
    two_way: bool = False


def classifier(config: dict[str, Any]) -> Classifier | None:
    """The classification head a config.json's contents describe (transformers' id2label, else num_labels as
    LABEL_i; or vLLM's classifier_from_token), or None where the model is not a sequence classifier."""
    if not any(a.endswith(CLASSIFIER_SUFFIX) for a in config.get("architectures") or []):
        return None
    if tokens := tuple(config.get("classifier_from_token") or ()):
        two_way = bool(config.get("is_original_qwen3_reranker"))
        if two_way and len(tokens) != 2:
            raise ValueError(f"is_original_qwen3_reranker needs two classifier_from_token (no, yes), got {tokens}")
        return Classifier(tokens[1:] if two_way else tokens, "sigmoid" if two_way or len(tokens) == 1 else "softmax",
                          tokens, two_way)
    id2label = config.get("id2label") or {}
    count = int(config.get("num_labels") or len(id2label) or 2)
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))
    multi = count == 1 or config.get("problem_type") == "multi_label_classification"
    return Classifier(labels, "sigmoid" if multi else "softmax")
