"""Encoder-only embedding models: BERT (BAAI/bge-base-en-v1.5, bge-large-en-v1.5, intfloat/e5-base-v2,
sentence-transformers/all-MiniLM-L6-v2), RoBERTa and XLM-RoBERTa (BAAI/bge-m3, intfloat/multilingual-e5-large), in
transformers' layout (`embeddings.*`, `encoder.layer.N.*`; a `bert.` / `roberta.` prefix of a model saved with a head
is stripped, the head and the pooler left). Every layer attends both ways (AttentionMetadata.causal False), so a
sequence runs whole in one step and no prefix of it is cached (DescribeResponse.encoder tells the scheduler); the
layers are post-norm: LayerNorm(x + attention(x)), then LayerNorm(x + down(act(up(x)))), all with biases. Positions
are learnt embeddings added to the tokens' with the first token type's, then a LayerNorm; RoBERTa's count from
pad_token_id + 1. These serve embeddings only (no LM head), pooled as the checkpoint's sentence-transformers files
say; or, saved as `ForSequenceClassification` (BAAI/bge-reranker-base / large / v2-m3, cross-encoders), scores: the
first token's state through the checkpoint's head (BERT's pooler and classifier, RoBERTa's classifier.dense and
out_proj), which is not linear, so it sees the state of the whole sequence (one step)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.kernels import Kernels
from worker_svc.kernels.attention import AttentionMetadata
from worker_svc.model.config import PLAIN_ACTIVATIONS, EncoderConfig, ModelConfig
from worker_svc.model.layers import MLP, Attention, RotaryEmbedding
from worker_svc.model.parallel import VocabParallelEmbedding


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, kernels: Kernels):
        super().__init__()
        self.self_attn = Attention(cfg, layer, rotary, kernels)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.encoder.layer_norm_eps)
        self.mlp = MLP(cfg, kernels, cfg.encoder.hidden_act, bias=True)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.encoder.layer_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.attn_norm(x + self.self_attn(positions, x, meta))
        return self.mlp_norm(x + self.mlp(x))


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        enc = cfg.encoder
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(enc.positions, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(enc.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=enc.layer_norm_eps)
        self.offset = enc.position_offset
        for embedding in (self.position_embeddings, self.token_type_embeddings):
            embedding.weight.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.offset)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class SequenceHead(nn.Module):
    """A ForSequenceClassification's head over the first token's state: out(tanh(dense(x))), in float32 (BERT's
    pooler.dense and classifier; RoBERTa's classifier.dense and classifier.out_proj)."""

    def __init__(self, hidden: int, labels: int):
        super().__init__()
        self.dense, self.out = nn.Linear(hidden, hidden), nn.Linear(hidden, labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.linear(x, self.dense.weight.float(), self.dense.bias.float()))
        return F.linear(h, self.out.weight.float(), self.out.bias.float())


class BertModel(nn.Module):
    checkpoint_prefixes: tuple[str, ...] = ("bert.", "roberta.")
    ignored_prefixes: tuple[str, ...] = ("pooler.", "bert.pooler.", "cls.", "lm_head.", "embeddings.position_ids",
                                         "bert.embeddings.position_ids", "roberta.embeddings.position_ids")
    head_names = {"pooler.dense.": "score.dense.", "classifier.": "score.out."}  # its head's, as ours
    # the attention's output names first: "output.dense" is also the MLP's
    renamed_fragments = {"encoder.layer.": "layers.", "attention.self.query": "self_attn.q_proj",
                         "attention.self.key": "self_attn.k_proj", "attention.self.value": "self_attn.v_proj",
                         "attention.output.dense": "self_attn.o_proj", "attention.output.LayerNorm": "attn_norm",
                         "intermediate.dense": "mlp.up_proj", "output.dense": "mlp.down_proj",
                         "output.LayerNorm": "mlp_norm"}
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, 1.0, rotary_dim=0)  # no rope
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(EncoderLayer(cfg, i, rotary, kernels) for i in range(cfg.num_hidden_layers))
        self.lm_head = None
        self.score = None  # a classifier's head, over the first token's float32 state (ModelRunner._pool)
        if cfg.classifier is not None:
            self.score = SequenceHead(cfg.hidden_size, len(cfg.classifier.labels))
            for p in self.score.parameters():
                p.requires_grad_(False)
            self.ignored_prefixes = tuple(p for p in self.ignored_prefixes if "pooler." not in p)
            self.renamed_fragments = {**self.renamed_fragments, **self.head_names}

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {raw['position_embedding_type']!r} is not served (only "
                             "'absolute')")
        act = raw.get("hidden_act", "gelu")
        if act not in PLAIN_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r} of an encoder ({', '.join(PLAIN_ACTIVATIONS)})")
        positions, offset = raw.get("max_position_embeddings", 512), cls.position_offset(raw)
        encoder = EncoderConfig(positions, offset, raw.get("type_vocab_size", 2), raw.get("layer_norm_eps", 1e-12),
                                act)
        # a sequence's positions: past the padding rows; no LM head (BERT's MLM head is not served); the activation
        # ModelConfig checks is a gated MLP's, which this model has not (its own is the encoder's)
        return ModelConfig.common({**raw, "hidden_act": "silu", "max_position_embeddings": positions - offset,
                                   "tie_word_embeddings": False}, qkv_bias=True, o_bias=True, encoder=encoder)

    @staticmethod
    def position_offset(raw: dict) -> int:
        return 0

    def fold_scales(self) -> None:
        pass

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return x


class RobertaModel(BertModel):
    """RoBERTa's and XLM-RoBERTa's positions count from pad_token_id + 1 (the rows before stand for padding)."""

    head_names = {"classifier.dense.": "score.dense.", "classifier.out_proj.": "score.out."}

    @staticmethod
    def position_offset(raw: dict) -> int:
        return raw.get("pad_token_id", 1) + 1


class XLMRobertaModel(RobertaModel):
    pass
