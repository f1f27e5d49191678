"""ModelRunner: applies each StepPlan (a delta) to the persistent batch (runtime/batch.py), builds the
step's tensors, runs the model and samples.

Each sequence's last sampled token stays on the device in its row, so a decode needs no token id from the
scheduler and no host round trip.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from common import model_files
from common.limits import MAX_BAD_WORD_TOKENS, Limits
from common.util import cdiv
from protos import WORKER_PROTOCOL_VERSION
from protos import worker_pb2 as pb
from worker_svc import kernels
from worker_svc.kernels.attention import AttentionMetadata, prefill_metadata
from worker_svc.kernels.reference import FP8_GROUP
from worker_svc.kernels.uploads import upload
from worker_svc.model.config import DTYPES, KV_CACHE_DTYPES, ModelConfig
from worker_svc.model.loader import checkpoint_names, lm_head_rows, load_weights
from worker_svc.model.lora import LoraSlots, adapter_rank, step_adapters
from worker_svc.model.parallel import (ReplicatedLinear, all_over_ranks, deferred_projections, min_over_ranks,
                                       tp_size)
from worker_svc.model.packed_ints import allocate_packed
from worker_svc.model.quantized import allocate_projections, fp8_gemms
from worker_svc.model.registry import ARCHITECTURES
from worker_svc.runtime.batch import (POOLING, BatchStep, PersistentBatch, PlanError, SamplingArrays,
                                      pooled_span)
from worker_svc.runtime.grammar import Grammars, StepMasks
from worker_svc.runtime.kv_offload import HostKVPool
from worker_svc.runtime.kernel_builds import BUILDS
from worker_svc.runtime.decode_step import DecodeInputs, DecodeStep, capture_sizes
from worker_svc.runtime.sampler import Penalties, RecentTokens, SamplerOutput, SamplingBatch, sample
from worker_svc.runtime.tier_policy import host_tier_pays

log = logging.getLogger("splitserve.worker")


@dataclass(slots=True)
class RunnerConfig:
    device: str = "cpu"
    dtype: str | None = None            # default: the checkpoint's dtype
    block_size: int | None = None       # default: 256 on a GPU (flash-attn-4 reads KV fastest), 16 on a CPU
    num_blocks: int | None = None       # default: from a memory profile (GPU) or kv_cache_memory (CPU)
    kv_cache_memory: int = 256 << 20    # bytes for the KV cache on a CPU when num_blocks is not given
    gpu_memory_utilization: float = 0.9 # share of the GPU's memory this worker may use in all
    cuda_graphs: bool = True            # capture decode steps (GPU, a Triton or flash_attn backend)
    limits: Limits = field(default_factory=Limits)
    attention: str = "auto"
    kv_cache_dtype: str = "auto"        # "auto": the model's dtype; "fp8": e4m3 with a scale per layer and tensor
    kv_offload_bytes: int = 0           # the host KV pool behind the GPU's blocks (runtime/kv_offload.py); 0: none
    lora_modules: dict[str, str] = field(default_factory=dict)  # LoRA adapters to serve: name -> PEFT folder
    max_loras: int = 0                  # LoRA adapter slots on the device; 0: as many as lora_modules
    enable_lora: bool = False           # vLLM's: LoRA slots with no lora_modules too (max_loras 0 then means 1)
    max_cpu_loras: int = 0              # LoRA adapters held in host memory; 0: max_loras or lora_modules, the more
    max_lora_rank: int = 0              # the largest rank a slot takes; 0: 16, or the lora_modules' largest
    hf_overrides: dict = field(default_factory=dict)  # over config.json's top-level keys (vLLM's --hf-overrides)
    quantization: str = "auto"          # the projections' GEMMs: one of QUANTIZATIONS


# --quantization: `auto` multiplies an FP8 checkpoint's projections in FP8 where the GPU can (kernels/fp8_gemm.py), in
# 16 bits elsewhere; `fp8` quantises any checkpoint's projections to FP8 blocks at load; `packed` keeps an integer-group
# checkpoint's (AWQ, GPTQ, pack-quantized) as stored (model/packed_ints.py); `none` keeps them in 16 bits
QUANTIZATIONS = ("auto", "fp8", "packed", "none")

PROMPT_SCORE_SLICE = 1024  # prompt positions per LM-head call when scoring prompts (bounds the logits' memory)


@dataclass(slots=True)
class PromptScores:
    """The prompt positions a step scored (rows that asked for prompt logprobs): per sequence its first
    position, count and top-n; per position the next prompt token's logprob and the top n (best first)."""
    seq_ids: list[int]
    starts: list[int]
    counts: list[int]
    tops: list[int]
    logprobs: torch.Tensor             # float32 [positions]
    top_logprobs: torch.Tensor | None  # float32 [positions, max top]
    top_ids: torch.Tensor | None

    def to_host(self) -> None:
        for name in ("logprobs", "top_logprobs", "top_ids"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to("cpu", non_blocking=True))

    def write(self, res: pb.StepResult) -> None:
        res.prompt_seq_ids.extend(self.seq_ids)
        res.prompt_starts.extend(self.starts)
        res.prompt_counts.extend(self.counts)
        res.prompt_logprobs.extend(self.logprobs.tolist())
        at = 0
        for count, n in zip(self.counts, self.tops):
            if n > 0:
                res.prompt_top_token_ids.extend(self.top_ids[at:at + count, :n].flatten().tolist())
                res.prompt_top_logprobs.extend(self.top_logprobs[at:at + count, :n].flatten().tolist())
            at += count


@dataclass(slots=True)
class PooledRows:
    """What a step gives its embedding requests (StepResult.pooled_*): per sequence a row of hidden_size values (a
    classifier's: one per label)."""
    seq_ids: list[int]
    starts: list[int]
    counts: list[int]
    values: torch.Tensor  # float32 [sequences, hidden or labels]

    def to_host(self) -> None:
        self.values = self.values.to("cpu", non_blocking=True)

    def write(self, res: pb.StepResult) -> None:
        res.pooled_seq_ids.extend(self.seq_ids)
        res.pooled_starts.extend(self.starts)
        res.pooled_counts.extend(self.counts)
        res.pooled.extend(self.values.flatten().tolist())


class PendingStep:
    """A launched step; `result()` waits for its sampled ids (the step's one host sync). seq_ids: the sequences
    whose prompt or decode ends this step, in plan order; `sampled`: which of them `out`'s rows are, where
    embedding requests (which sample nothing, a 0 each in the result) are among them."""

    def __init__(self, step: int, seq_ids: list[int], out: SamplerOutput | None,
                 logprob_counts: list[int], started: float, prompt: PromptScores | None = None,
                 pooled: PooledRows | None = None, sampled: list[int] | None = None):
        self.step, self.seq_ids, self.logprob_counts, self.started = step, seq_ids, logprob_counts, started
        self.prompt, self.pooled, self.sampled = prompt, pooled, sampled
        self.grammar_dead: list[int] = []  # sequences whose grammar no token continued (they sampled an EOS)
        self.failed_loras: dict[str, str] = {}  # the plan's LoRA loads that failed, and why
        self.failed_weights = ""  # why the plan's load_weights failed
        # asked before the copies: after them every tensor is the host's, yet filled only once the event is reached
        on_gpu = ((out is not None and out.token_ids.is_cuda) or (prompt is not None and prompt.logprobs.is_cuda)
                  or (pooled is not None and pooled.values.is_cuda))
        for part in (prompt, pooled):
            if part is not None:
                part.to_host()
        self.host: list[torch.Tensor | None] = []
        if out is not None:
            tensors = [out.token_ids, out.logprobs, out.top_ids, out.top_logprobs]
            # copy=True: on a CPU, token_ids may be the decode step's static buffer, which the next step reuses
            self.host = [t.to("cpu", non_blocking=True, copy=True) if t is not None else None for t in tensors]
        self.event = None
        if on_gpu:
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> pb.StepResult:
        if self.event is not None:
            self.event.synchronize()
        res = pb.StepResult(step=self.step, seq_ids=self.seq_ids)
        tokens, logprobs, top_ids, top_logprobs = self.host or (None, None, None, None)
        res.token_ids.extend(self._in_plan_order(tokens, 0))
        if logprobs is not None:
            res.logprobs.extend(self._in_plan_order(logprobs, math.nan))
            for i, n in enumerate(self.logprob_counts):
                if n > 0:
                    res.top_token_ids.extend(top_ids[i, :n].tolist())
                    res.top_logprobs.extend(top_logprobs[i, :n].tolist())
        for part in (self.prompt, self.pooled):
            if part is not None:
                part.write(res)
        res.grammar_dead_ids.extend(self.grammar_dead)
        res.failed_loras.update(self.failed_loras)
        res.failed_weights = self.failed_weights
        res.forward_ms = (time.perf_counter() - self.started) * 1e3
        return res

    def _in_plan_order(self, values: torch.Tensor | None, fill: float) -> list:
        """The sampled rows' values at their places among seq_ids, `fill` at the embedding requests'."""
        got = [] if values is None else values.tolist()
        if self.sampled is None:
            return got
        full = [fill] * len(self.seq_ids)
        for k, value in zip(self.sampled, got):
            full[k] = value
        return full


class ModelRunner:
    def __init__(self, model_dir: str | Path, config: RunnerConfig | None = None):
        self.config = cfg = config or RunnerConfig()
        self.model_dir = Path(model_dir)
        self.model_config = mc = ModelConfig.from_dir(model_dir, cfg.hf_overrides)
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype] if cfg.dtype else mc.dtype
        self.max_model_len = min(cfg.limits.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.limits = dataclasses.replace(cfg.limits, max_model_len=self.max_model_len)
        self.block_size = cfg.block_size or (256 if self.device.type == "cuda" else 16)
        self.worker_id = uuid.uuid4().hex[:12]
        if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {cfg.kv_cache_dtype!r} ({', '.join(KV_CACHE_DTYPES)})")
        self.kv_dtype = KV_CACHE_DTYPES[cfg.kv_cache_dtype] or self.dtype
        if self.device.type == "cuda":
            from worker_svc.kernels import build_hooks

            build_hooks.install(BUILDS.count)  # before the first kernel runs: the warm-up's builds count as warm-up
        self.kernels = kernels.select(self.device, cfg.attention, self.kv_dtype, mc.head_dim)

        # the rope table covers the positions served, and LongRoPE takes its factors for that length
        served = dataclasses.replace(mc, max_position_embeddings=self.max_model_len)
        if mc.rope_scaling is not None and mc.rope_scaling.kind == "longrope":
            log.info("LongRoPE: its %s factors at max_model_len %d (original length %d)",
                     "long" if mc.rope_scaling.long_factors(self.max_model_len) else "short", self.max_model_len,
                     mc.rope_scaling.original_max_position_embeddings)
        # A sequence classifier's head takes the LM head's place over the last token: its checkpoint's `score`, or
        # the LM head's rows of some tokens (vLLM's classifier_from_token)
        self.classifier = mc.classifier
        torch.set_default_dtype(self.dtype)
        fp8 = self._fp8_projections()
        packed = None if fp8 else self._packed_projections()
        with torch.device(self.device), deferred_projections() if fp8 or packed else contextlib.nullcontext():
            self.model = ARCHITECTURES[mc.architecture](served, self.kernels)
            if self.classifier is not None and not self.classifier.from_tokens and mc.causal:  # loaded below (an
                # encoder's head is its own)
                self.model.score = ReplicatedLinear(mc.hidden_size, len(self.classifier.labels), self.kernels)
        torch.set_default_dtype(torch.float32)
        self.fp8_linears = allocate_projections(self.model, self.device, self.dtype) if fp8 else 0
        if fp8:
            log.info("%d projections in FP8 blocks of %d x %d", self.fp8_linears, FP8_GROUP, FP8_GROUP)
        self.packed_linears = allocate_packed(self.model, self.device, self.dtype, *packed) if packed else 0
        # what the projections' weights hold (DescribeResponse.projection_dtype)
        self.projection_dtype = "float8_e4m3fn" if fp8 else str(self.dtype).removeprefix("torch.")
        if self.packed_linears:
            self.projection_dtype = f"int{packed[1]}"
            log.info("%d projections in packed %d-bit integer groups of %s", self.packed_linears, packed[1],
                     "a row" if packed[2] == -1 else packed[2])
        if mc.weight_scheme is not None and not fp8:
            log.info("the checkpoint's quantized weights (%s) %s to %s as they load", mc.weight_scheme,
                     "otherwise dequantised" if self.packed_linears else "dequantised",
                     str(self.dtype).removeprefix("torch."))
        # A checkpoint without an LM head (an embedding model's: Qwen3-Embedding-4B, gte-Qwen2; a classifier's)
        # serves embeddings (or classifications) only
        self.embedding_only = self.classifier is not None or not mc.causal or not mc.tie_word_embeddings and not any(
            name.endswith("lm_head.weight") for name in checkpoint_names(self.model_dir))
        if self.embedding_only:
            self.model.lm_head = None
        if self.classifier is not None and self.classifier.from_tokens:
            self.model.ignored_prefixes = (*getattr(self.model, "ignored_prefixes", ()), "lm_head.")
        self.weights_path = str(model_dir)  # where the weights came from: the model's, or the last load_weights
        kv_scales = self._read_weights(self.weights_path)
        static = list(cfg.lora_modules.items())
        max_loras = cfg.max_loras or len(static) or int(cfg.enable_lora)
        capacity = cfg.max_cpu_loras or max(max_loras, len(static))
        if capacity < max(max_loras, len(static)):
            raise ValueError(f"max_cpu_loras {capacity} is below max_loras {max_loras} or the {len(static)} LoRA "
                             "adapters to load at start")
        self.lora = LoraSlots(self.model, max_loras,  # before the scales fold: adapters take them too
                              cfg.max_lora_rank or max([16, *(adapter_rank(name, folder) for name, folder in static)]),
                              self.dtype, capacity)
        self._fold(kv_scales)
        for name, folder in static:
            self.lora.register(name, folder)
        placed = [name for name, _ in static[:max_loras]]
        for slot, name in enumerate(placed):
            self.lora.place(slot, name)
        self.model.eval()
        host_blocks = self._allocate_kv_cache()
        if self.device.type == "cuda":
            self._warm_up()
            if host_blocks and not self._host_tier_pays():
                host_blocks = 0
        self.host_pool = HostKVPool(self.kv_cache, host_blocks) if host_blocks else None
        rows = self.limits.max_num_seqs
        self.batch = PersistentBatch(rows, self.num_blocks, self.block_size, self.max_model_len,
                                     self.limits.max_num_batched_tokens, epoch=random.getrandbits(63),
                                     num_host_blocks=self.num_host_blocks, sliding_window=mc.kv_window,
                                     lora_adapters=placed + [""] * (max_loras - len(placed)))
        # each row's last sampled token (the next one it runs), and a scratch row for padding
        self.last_token = torch.zeros(rows + 1, dtype=torch.int64, device=self.device)
        self.penalties: Penalties | None = None
        self.recent: RecentTokens | None = None  # rows' last sampled tokens, once a sequence with bad words ran
        self.grammars = Grammars(model_dir, mc.vocab_size, self.device)
        if self.device.type == "cuda" and not self.embedding_only:  # an embedding model samples nothing
            self.grammars.warm_up()
        self.decode = DecodeStep(self.model, self.kernels, self.last_token, rows, self.batch.block_table.shape[1],
                                 scratch_block=self.num_blocks, block_size=self.block_size)
        if (self.device.type == "cuda" and cfg.cuda_graphs and self.kernels.attention.name != "torch"
                and not self.embedding_only):  # its graphs are decode steps, which embeddings never run
            self.decode.capture(capture_sizes(rows), adapters=bool(max_loras))

    @property
    def epoch(self) -> int:
        return self.batch.epoch

    # ---- set-up -------------------------------------------------------------------------------
    def _allocate_kv_cache(self) -> int:
        """One allocation for every layer's K and V (K alone where V is K), plus one scratch block (the last) that the
        scheduler never owns: padded rows of graph-captured steps write there. Returns how many blocks the
        host pool asked for holds (the same on every TP rank)."""
        mc, cfg = self.model_config, self.config
        kv_heads = self.model.layers[0].self_attn.num_kv_heads
        per_block = (self._planes * mc.num_hidden_layers * self.block_size * kv_heads * mc.head_dim
                     * self.kv_dtype.itemsize)
        if cfg.num_blocks:
            self.num_blocks = cfg.num_blocks
        elif self.device.type == "cuda":
            self.num_blocks = self._profile_num_blocks(per_block)
        else:
            self.num_blocks = max(1, cfg.kv_cache_memory // per_block)
        self.num_blocks = min_over_ranks(self.num_blocks, self.device)  # one block pool for all TP ranks
        shape = (self._planes, mc.num_hidden_layers, self.num_blocks + 1, self.block_size, kv_heads, mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self._bind_caches(self.kv_cache)
        return min_over_ranks(cfg.kv_offload_bytes // per_block, self.device)

    def _read_weights(self, folder: str) -> dict[str, float]:
        """The checkpoint in folder copied into the model's parameters (and a classifier's head made of its LM head's
        rows); returns its KV-cache scales, for _fold."""
        kv_scales = load_weights(self.model, folder)
        if self.classifier is not None and self.classifier.from_tokens:
            self.model.score = self._head_from_tokens(self.classifier, Path(folder))
        return kv_scales

    def _fold(self, kv_scales: dict[str, float]) -> None:
        """After _read_weights: the config's output scales folded into the weights, and an fp8 cache's scales set."""
        self.model.fold_scales()
        if self.kv_dtype == torch.float8_e4m3fn:
            # The checkpoint's scales where it has them, else 1. A scale must be fixed before the first block
            # is written (cached blocks outlive any change), so a dynamic one could only come from made-up
            # start-up traffic; e4m3's error is relative over its normal range, and a per-tensor absmax scale
            # measured no closer to the full-precision cache (bench/NOTES.md).
            for name, value in kv_scales.items():
                setattr(self.model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], value)

    def _fp8_projections(self) -> bool:
        """Whether the projections are served in FP8 blocks (`quantization`): `fp8` always, `auto` for an FP8
        checkpoint in 128 x 128 blocks (DeepSeek's format or compressed-tensors') where the GPU multiplies them
        (model/quantized.py: their codes kept as stored), else 16 bits."""
        cfg = self.config
        if cfg.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {cfg.quantization!r} ({', '.join(QUANTIZATIONS)})")
        if cfg.quantization in ("none", "packed") or cfg.quantization == "auto" and (
                self.model_config.fp8_blocks != (FP8_GROUP, FP8_GROUP) or not fp8_gemms(self.device)):
            return False  # an FP8 checkpoint is dequantised as it loads
        if cfg.quantization == "fp8" and self.device.type == "cuda" and not fp8_gemms(self.device):
            raise ValueError("quantization fp8 needs cuBLAS's block-scaled FP8 GEMM: an sm_90 GPU and CUDA >= 12.9")
        return True

    def _packed_projections(self) -> tuple[set[str], int, int] | None:
        """Where `quantization` is packed (model/packed_ints.py): the checkpoint weights that read as integer groups,
        their bits and group size; None: no packed projections. ValueError for a checkpoint not stored so."""
        if self.config.quantization != "packed":
            return None
        scheme = self.model_config.weight_scheme
        groups = getattr(scheme, "packed_groups", None)
        if groups is None:
            raise ValueError(f"quantization packed serves checkpoints stored in integer groups of 2, 4 or 8 bits (AWQ, "
                             f"GPTQ in row order, compressed-tensors pack-quantized by group or channel), not "
                             f"{scheme or 'one not quantized'}")
        part = f".{scheme.codes_part}"  # a module stored in integer groups: its codes part beside its others
        quantized = {f"{n.removesuffix(part)}.weight" for n in checkpoint_names(self.model_dir) if n.endswith(part)}
        return quantized, *groups

    def reload_weights(self, folder: str) -> str:
        """StepPlan.load_weights: the weights read again from another checkpoint of the served model, in place (the
        CUDA graphs keep reading the same memory), where no sequence is held. Returns why not ("": done); the
        worker then serves the weights it had, and so does every tensor-parallel rank where one could not."""
        if self.batch.seqs:
            raise PlanError("weights are read again only where no sequence is held")
        error, touched = "", False
        try:
            served, theirs = self.model_config, ModelConfig.from_dir(folder, self.config.hf_overrides)
            # its dtype may differ (a trainer's float32, a served FP8 checkpoint's dequantised weights): they load cast
            if dataclasses.replace(theirs, dtype=served.dtype, fp8_weight_block=served.fp8_weight_block,
                                   weight_scheme=served.weight_scheme) != served:
                raise ValueError(f"the config.json in {folder} describes another model than the one served "
                                 f"({self.model_dir.name}): its weights cannot take their place")
            if self.packed_linears and theirs.weight_scheme != served.weight_scheme:
                raise ValueError(f"{folder} does not store its projections as the served ones are held (packed "
                                 f"integer groups: {served.weight_scheme})")
            load_weights(self.model, folder, names_only=True)  # a tensor short or too many: refused untouched
            touched = True
            kv_scales = self._read_weights(folder)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            error = f"weights from {folder}: {e}"
            log.warning("%s", error)
        if not all_over_ranks([not error], self.device)[0] and not error:
            error = (f"weights from {folder}: another tensor-parallel rank of this worker could not read them (its log "
                     "says why)")
        if error:
            if touched:  # partly read, or read here and not on another rank: the weights it had, read again
                try:
                    self._fold(self._read_weights(self.weights_path))
                except Exception:
                    log.critical("weights from %s failed part way, and those before could not be read back from %s: "
                                 "exiting, as the model holds neither", folder, self.weights_path, exc_info=True)
                    os._exit(1)
            return error
        self._fold(kv_scales)
        self.weights_path = folder
        log.info("weights read again from %s", folder)
        return ""

    def _head_from_tokens(self, classifier: model_files.Classifier, folder: Path) -> ReplicatedLinear:
        """The classifier's head made of the LM head's rows of its tokens, read from the checkpoint in folder (whole
        on every TP rank, as the head is replicated; the LM head is not loaded)."""
        tokenizer = Tokenizer.from_str(model_files.tokenizer_json(folder))
        ids = [tokenizer.token_to_id(t) for t in classifier.from_tokens]
        if None in ids:
            raise ValueError(f"classifier_from_token {classifier.from_tokens[ids.index(None)]!r} is not a token of "
                             f"{self.model_dir.name}'s tokenizer")
        rows = lm_head_rows(folder, ids, self.model_config.tie_word_embeddings)
        head = ReplicatedLinear(rows.shape[1], len(classifier.labels), self.kernels)
        head.weight.data = (rows[1:] - rows[:1] if classifier.two_way else rows).to(self.device, self.dtype)
        return head

    @property
    def _planes(self) -> int:
        """K and V planes of the cache: 2, or 1 where a layer's V is its K (latent attention, model/mla.py)."""
        return 1 if getattr(self.model.layers[0].self_attn, "v_is_k", False) else 2

    def _bind_caches(self, cache: torch.Tensor) -> None:
        """Each layer's K and V views of a [planes, layers, ...] cache."""
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = cache[0, i], cache[-1, i]

    @torch.inference_mode()
    def _profile_num_blocks(self, per_block: int) -> int:
        """Runs the largest step the worker accepts on a throw-away cache and sizes the KV cache from
        what is left of gpu_memory_utilization, keeping room for CUDA graphs and the sampler."""
        cfg, mc = self.config, self.model_config
        limits = self.limits
        tokens = min(limits.max_num_batched_tokens, limits.max_num_seqs * self.max_model_len)
        seqs = max(1, min(limits.max_num_seqs, tokens))
        lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        blocks_each = cdiv(max(lens), self.block_size)
        kv_heads = self.model.layers[0].self_attn.num_kv_heads
        scratch = torch.zeros(self._planes, mc.num_hidden_layers, blocks_each, self.block_size, kv_heads, mc.head_dim,
                              dtype=self.kv_dtype, device=self.device)
        self._bind_caches(scratch)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        page = torch.arange(blocks_each, dtype=torch.int32, device=self.device).expand(seqs, -1).contiguous()
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(self.device)
        slots = positions % (blocks_each * self.block_size)
        meta = AttentionMetadata(cu_seqlens_q=cu, seqused_k=torch.tensor(lens, dtype=torch.int32, device=self.device),
                                 page_table=page, slot_mapping=slots, max_seqlen_q=max(lens),
                                 query_lens=lens, context_lens=lens, causal=mc.causal)
        hidden = self.model(torch.zeros(tokens, dtype=torch.int64, device=self.device), positions, meta)
        if not self.embedding_only:
            self.model.compute_logits(hidden[:limits.max_num_seqs]).float().softmax(-1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - scratch.numel() * scratch.element_size()
        del scratch, hidden
        torch.cuda.empty_cache()
        free_now, total = torch.cuda.mem_get_info(self.device)
        graph_reserve = 1 << 30
        # One worker per GPU (as vLLM assumes): it may use gpu_memory_utilization of the whole GPU.
        free = total * cfg.gpu_memory_utilization - peak - graph_reserve
        if free < per_block * 2:
            raise RuntimeError(f"no memory left for the KV cache: peak {peak >> 20} MiB, free {free_now >> 20} MiB "
                               f"of {total >> 20} MiB, gpu_memory_utilization {cfg.gpu_memory_utilization}")
        return int(free // per_block) - 1

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Runs steps of several query lengths before serving, through every prefill kernel the attention
        backend may pick, with and without a decode beside the chunks (token counts odd and even), so that
        kernels compiled on first use (flash-attn-4's variants, Triton's specialisations) are built now, not
        inside a request; runtime/kernel_builds.py counts any that are not."""
        budget = self.limits.max_num_batched_tokens
        longest = min(budget, self.max_model_len - 1, self.num_blocks * self.block_size - 1)  # a chunk's KV fits
        attention = self.kernels.attention
        for kernel in getattr(attention, "prefills", None) or [None]:
            if kernel is not None:
                attention.forced = kernel
            for q_len in sorted({min(4 ** i, longest) for i in range(12)}):
                for mixed in (True, False):
                    lens = self._warm_up_lens(q_len)
                    if mixed:
                        lens[0] = 1  # a decode beside the chunks
                    logits = self._warm_up_step(lens)
        if hasattr(attention, "forced"):
            attention.forced = None
            attention.steps = dict.fromkeys(attention.steps, 0)
        if self.packed_linears and self.device.type == "cuda":  # a step of each build of the fused packed kernel
            from worker_svc.kernels.int_gemm import WARM_UP_ROWS

            for rows in WARM_UP_ROWS:
                self._warm_up_step([rows])
        moe = self.model_config.moe
        if moe is not None and self.device.type == "cuda":  # a step of each token count that changes the tiles
            from worker_svc.kernels.moe import hopper_table, warm_up_token_counts
            from worker_svc.model.moe import ExpertWeights

            fp8 = any(isinstance(m, ExpertWeights) and m.weight_scale is not None for m in self.model.modules())
            table = hopper_table(self.model_config.hidden_size, moe.intermediate_size, self.dtype, self.device, fp8)
            for n in warm_up_token_counts(budget, moe.top_k, table):
                self._warm_up_step([longest] * (n // longest) + ([n % longest] if n % longest else []))
        if self.embedding_only:
            torch.cuda.synchronize()
            return
        rows = logits.shape[0]
        zeros = torch.zeros(rows, dtype=torch.int64, device=self.device)
        for x in (logits, logits.float()):  # _sample takes float32 logits under a grammar, penalty, bias or logprobs
            sample(x, SamplingBatch(torch.ones(rows, device=self.device), zeros, zeros, None, None, None,
                                    all_greedy=False, max_logprobs=-1), self.kernels)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def _host_tier_pays(self) -> bool:
        """Times a prefill step and a block's copy in from pinned host memory: whether a host tier pays on this GPU
        for this model (tier_policy.py), as every TP rank finds. The step is a full one of block-sized chunks with
        no context before them: the least a block costs to recompute (long prompts add attention per token)."""
        lens = self._warm_up_lens(self.block_size)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else lambda: None
        self._warm_up_step(lens)  # untimed: the first step of a shape may build kernels
        sync()
        start = time.perf_counter()
        self._warm_up_step(lens)
        sync()
        prefill_s = (time.perf_counter() - start) / sum(lens)
        blocks = min(8, self.num_blocks)
        copy_s = HostKVPool(self.kv_cache, blocks).copy_in_seconds(blocks)
        pays = bool(min_over_ranks(int(host_tier_pays(copy_s, prefill_s, self.block_size)), self.device))
        log.info("host KV tier %s: a block's copy in takes %.2f ms, its prefill %.2f ms", "kept" if pays else
                 "dropped", copy_s * 1e3, prefill_s * self.block_size * 1e3)
        return pays

    def _warm_up_lens(self, q_len: int) -> list[int]:
        """As many chunks of q_len tokens (each over a one-token cached prefix) as one step and the KV cache take."""
        limits = self.limits
        seqs = min(limits.max_num_seqs, limits.max_num_batched_tokens // q_len,
                   self.num_blocks // cdiv(q_len + 1, self.block_size))
        return [q_len] * max(1, seqs)

    def _warm_up_step(self, lens: list[int]) -> torch.Tensor:
        """One eager step of chunks of `lens` tokens, each over a one-token cached prefix; returns its logits (an
        embedding model's: its last rows)."""
        causal = self.model_config.causal  # an encoder's chunks: whole sequences, nothing cached before them
        positions, meta = prefill_metadata(lens, self.block_size, self.device, cached=int(causal), causal=causal)
        hidden = self.model(torch.zeros(sum(lens), dtype=torch.int64, device=self.device), positions, meta)
        last = hidden[meta.cu_seqlens_q[1:] - 1]
        return last if self.embedding_only else self.model.compute_logits(last)

    def describe(self, request: pb.DescribeRequest | None = None) -> pb.DescribeResponse:
        limits = self.limits
        return pb.DescribeResponse(
            protocol_version=WORKER_PROTOCOL_VERSION, model=self.model_dir.name,
            dtype=str(self.dtype).removeprefix("torch."), num_blocks=self.num_blocks,
            block_size=self.block_size, max_model_len=self.max_model_len, tensor_parallel_size=tp_size(),
            epoch=self.epoch, vocab_size=self.model_config.vocab_size, worker_id=self.worker_id,
            device=str(self.device), max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."), num_host_blocks=self.num_host_blocks,
            projection_dtype=self.projection_dtype,
            sliding_window=self.batch.sliding_window, hidden_size=self.model_config.hidden_size,
            embedding_only=self.embedding_only, lora_adapters=list(self.lora.registered),
            lora_paths=list(self.lora.folders.values()), dropped_loras=list(self.lora.dropped),
            dropped_lora_paths=list(self.lora.dropped.values()),
            max_loras=self.lora.slots, max_lora_rank=self.lora.max_rank if self.lora.slots else 0,
            max_cpu_loras=self.lora.capacity if self.lora.slots else 0, lora_slots=self.batch.lora_adapters,
            encoder=not self.model_config.causal,
            labels=self.classifier.labels if self.classifier else (),
            label_activation=self.classifier.activation if self.classifier else "",
            label_pooling=("last" if self.model_config.causal else "cls") if self.classifier else "",
            weights_path=self.weights_path)

    @property
    def num_host_blocks(self) -> int:
        return self.host_pool.num_blocks if self.host_pool is not None else 0

    def close(self) -> None:
        """Releases the model, the KV cache and the graphs (on a GPU, so that another runner can take them)."""
        self.model = self.kv_cache = self.host_pool = self.decode = self.penalties = self.recent = None
        self.last_token = self.lora = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reset(self, epoch: int | None = None) -> None:
        """Forgets every sequence and starts a new epoch (the scheduler that drove us is gone); a
        tensor-parallel follower takes its leader's."""
        self.batch.reset(random.getrandbits(63) if epoch is None else epoch)
        self.grammars.reset()

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: pb.StepPlan) -> PendingStep:
        """Applies the plan and launches its step, between the plan's swaps and its offloads; on a GPU it
        returns before the step has run."""
        started = time.perf_counter()
        step = self.batch.apply(plan)
        failed_weights = self.reload_weights(plan.load_weights) if plan.load_weights else ""
        failed_loras = self._update_adapters(plan, step)
        pool = self.host_pool
        if pool is not None:
            pool.swap(plan)
        pending = self._launch(plan, step, started)
        pending.failed_loras, pending.failed_weights = failed_loras, failed_weights
        if pool is not None:
            pool.offload(plan)
        return pending

    def _update_adapters(self, plan: pb.StepPlan, step: BatchStep) -> dict[str, str]:
        """The plan's LoRA adapters forgotten, read and placed into slots (the batch took the slots' changes);
        returns the reads that failed, with why."""
        lora = self.lora
        for slot in step.unloaded_loras:
            lora.clear(slot)
        for name in plan.unload_loras:
            if name not in lora.registered and name not in lora.dropped:
                raise PlanError(f"LoRA adapter {name!r} is unloaded but not loaded here")
            lora.forget(name)
        for name in plan.drop_loras:
            if name not in lora.registered:
                raise PlanError(f"LoRA adapter {name!r} is dropped but not loaded here")
            lora.drop(name)
        failed = {}
        for adapter in plan.load_loras:
            try:
                lora.register(adapter.name, adapter.path)
                log.info("LoRA adapter %s loaded from %s", adapter.name, adapter.path)
            except ValueError as e:
                log.warning("%s", e)
                failed[adapter.name] = str(e)
        # an adapter serves only where every rank read it: the ranks' batches place the same ones
        for adapter, everywhere in zip(plan.load_loras, all_over_ranks(
                [adapter.name not in failed for adapter in plan.load_loras], self.device)):
            if not everywhere and adapter.name not in failed:
                lora.forget(adapter.name)
                failed[adapter.name] = (f"LoRA adapter {adapter.name!r}: another tensor-parallel rank of this worker "
                                        "could not load it (its log says why)")
        for slot, name in step.placed_loras:
            if name not in lora.registered or name in failed:
                raise PlanError(f"LoRA adapter {name!r} is placed into slot {slot} but not loaded here")
            lora.place(slot, name)
        return failed

    def _launch(self, plan: pb.StepPlan, step: BatchStep, started: float) -> PendingStep:
        if self.embedding_only and step.new and not self.batch.pooling[[s.row for s in step.new]].all():
            raise PlanError("this model has no LM head: a sequence it runs must be an embedding (pooling)")
        if not self.model_config.causal and (len(plan.seq_ids) or any(
                ns.num_computed_tokens or ns.num_scheduled_tokens != len(ns.token_ids) for ns in plan.new_seqs)):
            raise PlanError("an encoder's sequence runs whole in the step that starts it (DescribeResponse.encoder)")
        for state in step.new:
            self._start_penalties(state)
            self._start_bad_words(state)
            if state.row in self.batch.grammar:
                self.grammars.start(state.row, self.batch.grammar[state.row], state.token_ids[state.prompt_len:])
        rows, n, c = step.rows, step.num_scheduled, step.num_computed
        if not len(rows):
            return PendingStep(plan.step, [], None, [], started)
        sampling = step.samples
        embedding = self.batch.pooling[rows] > 0
        if sampling.all() and n.max() == 1 and not embedding.any():
            return self._execute_decode(step, started)
        ended = sampling  # the rows in the result: the sampling ones and the embedding requests whose prompt ends
        sampling = sampling & ~embedding
        bs = self.block_size
        cu = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(n, out=cu[1:])
        total = int(cu[-1])
        seq_of_token = np.repeat(np.arange(len(rows)), n)
        positions = c[seq_of_token] + np.arange(total) - cu[:-1][seq_of_token]
        input_ids = np.zeros(total, np.int64)
        prefill = c < step.num_sent
        for i in np.flatnonzero(prefill):  # decodes take their token from the device instead
            input_ids[cu[i]:cu[i + 1]] = step.states[i].token_ids[c[i]:c[i] + n[i]]
        sample_at, sample_rows = cu[1:][sampling] - 1, rows[sampling]
        table = self.batch.block_table
        page_table = table[rows, :int(self.batch.num_table_blocks[rows].max())]
        slot_mapping = page_table[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        params = self.batch.sampling(sample_rows, self.model_config.vocab_size, self.penalties is not None)
        adapters = self.batch.lora[rows]
        (ids_t, pos_t, slots_t, dec_at_t, dec_rows_t, sample_at_t, rows_t, sample_pos_t, seeds_t,
         cu_t, seqused_t, page_t, adapter_t, *params_t) = upload(
            [input_ids, positions, slot_mapping, cu[:-1][~prefill], rows[~prefill], sample_at, sample_rows,
             positions[sample_at] + 1, self.batch.seed[sample_rows], cu.astype(np.int32), (c + n).astype(np.int32),
             page_table, adapters[seq_of_token], *params.arrays()], self.device)
        if not prefill.all():
            ids_t[dec_at_t] = self.last_token[dec_rows_t]
        meta = AttentionMetadata(cu_seqlens_q=cu_t, seqused_k=seqused_t, page_table=page_t.view(page_table.shape),
                                 slot_mapping=slots_t, max_seqlen_q=int(n.max()), query_lens=n.tolist(),
                                 context_lens=(c + n).tolist(), causal=self.model_config.causal)
        with step_adapters(adapter_t if (adapters >= 0).any() else None):
            hidden = self.model(ids_t, pos_t, meta)
        prompt, pooled = self._score_prompts(step, cu, hidden), self._pool(step, cu, hidden)
        sampled = np.flatnonzero(sampling[ended]).tolist() if embedding.any() else None
        if not len(sample_at):
            return PendingStep(plan.step, step.seq_ids[ended].tolist(), None, [], started, prompt, pooled, sampled)
        logits = self.model.compute_logits(hidden[sample_at_t] if len(sample_at) < total else hidden)
        masks = self._masks(params, sample_rows)
        out = self._sample(logits, params, params_t, rows_t, sample_pos_t, seeds_t, masks)
        self.last_token[rows_t] = out.token_ids
        return self._pending(plan.step, step.seq_ids[sampling], sample_rows, rows_t, out, started, prompt, masks,
                             pooled, step.seq_ids[ended], sampled)

    def _pool(self, step: BatchStep, cu: np.ndarray, hidden: torch.Tensor) -> PooledRows | None:
        """The embedding requests' pooled rows of this step (StepResult.pooled says which), in float32: the final
        norm's output, without the logit scale folded into that norm's weight; a classifier's head over it."""
        kinds = self.batch.pooling[step.rows]
        if not kinds.any():
            return None
        c, n = step.num_computed, step.num_scheduled
        seqs, starts, counts, rows = [], [], [], []
        for i in np.flatnonzero(kinds):
            span = pooled_span(POOLING[kinds[i]], int(c[i]), int(n[i]), step.states[i].prompt_len)
            if span is None:
                continue
            seqs.append(int(step.seq_ids[i]))
            starts.append(int(c[i]))
            counts.append(int(n[i]))
            rows.append(hidden[cu[i] + span[0]:cu[i] + span[1]].float().sum(0))
        if not seqs:
            return None
        values = torch.stack(rows)
        if self.model_config.logit_scale != 1.0:
            values /= self.model_config.logit_scale
        if self.classifier is not None and not self.model_config.causal:  # one whole sequence's first token
            values = self.model.score(values)
        elif self.classifier is not None:  # linear: a chunk's sum of rows maps to the sum of their scores
            values = values @ self.model.score.weight.float().T
        return PooledRows(seqs, starts, counts, values)

    def _score_prompts(self, step: BatchStep, cu: np.ndarray, hidden: torch.Tensor) -> PromptScores | None:
        """Logprobs of the prompt tokens after each prompt position this step computed, for the rows that
        asked; the LM head runs over those positions only, a slice at a time."""
        asked = self.batch.prompt_logprobs[step.rows]
        if (asked < 0).all():
            return None
        c, n = step.num_computed, step.num_scheduled
        seqs, starts, counts, tops, at, targets = [], [], [], [], [], []
        for i in np.flatnonzero(asked >= 0):
            state = step.states[i]
            end = min(int(c[i] + n[i]), state.prompt_len - 1)  # positions whose next token is a prompt token
            if end <= c[i]:
                continue
            seqs.append(int(step.seq_ids[i]))
            starts.append(int(c[i]))
            counts.append(end - int(c[i]))
            tops.append(int(asked[i]))
            at.append(np.arange(cu[i], cu[i] + counts[-1]))
            targets.append(np.asarray(state.token_ids[c[i] + 1:end + 1], np.int64))
        if not seqs:
            return None
        at_t, target_t = upload([np.concatenate(at), np.concatenate(targets)], self.device)
        k = max(tops)
        values, top_values, top_ids = [], [], []
        for lo in range(0, len(at_t), PROMPT_SCORE_SLICE):
            lp = self.model.compute_logits(hidden[at_t[lo:lo + PROMPT_SCORE_SLICE]]).float().log_softmax(-1)
            values.append(lp.gather(-1, target_t[lo:lo + PROMPT_SCORE_SLICE, None]).squeeze(-1))
            if k > 0:
                best = lp.topk(k, dim=-1)
                top_values.append(best.values)
                top_ids.append(best.indices)
        return PromptScores(seqs, starts, counts, tops, torch.cat(values),
                            torch.cat(top_values) if k > 0 else None, torch.cat(top_ids) if k > 0 else None)

    def _start_penalties(self, state) -> None:
        """A new sequence with a penalty: its row's token statistics, from the tokens sent."""
        if not self.batch.has_penalty(state.row):
            return
        if self.penalties is None:
            self.penalties = Penalties(self.limits.max_num_seqs, self.model_config.vocab_size, self.device)
        ids = upload([np.asarray(state.token_ids, np.int64)], self.device)[0]  # no wait for the GPU's queue
        self.penalties.reset_row(state.row, ids[: state.prompt_len], ids[state.prompt_len:])

    def _start_bad_words(self, state) -> None:
        """A new sequence with bad words: its row's recent tokens, from the tokens it generated before (a preempted
        one's)."""
        if state.row not in self.batch.bad_words:
            return
        if self.recent is None:
            self.recent = RecentTokens(self.limits.max_num_seqs, MAX_BAD_WORD_TOKENS - 1, self.device)
        generated = np.asarray(state.token_ids[state.prompt_len:], np.int64)
        self.recent.reset_row(state.row, upload([generated], self.device)[0])

    def _execute_decode(self, step: BatchStep, started: float) -> PendingStep:
        """A step of one token per row, every row sampling: DecodeStep runs it whole (a CUDA graph on a GPU);
        the sampler runs again outside only on the rows that need what its Gumbel kernel does not do (filters,
        penalties, a bias, a grammar), or on every row where one asks for logprobs. So a free row samples what
        it samples alone, and a few constrained rows do not cost the whole batch a second sampler."""
        bs = self.block_size
        rows, c = step.rows, step.num_computed
        input_ids = np.full(len(rows), -1, np.int64)
        for i in np.flatnonzero(c < step.num_sent):  # the last token of a prompt (or of a preempted sequence)
            input_ids[i] = step.states[i].token_ids[c[i]]
        table = self.batch.block_table[rows]
        params = self.batch.sampling(rows, self.model_config.vocab_size, self.penalties is not None)
        b = self.decode.run(DecodeInputs(
            rows=rows, input_ids=input_ids, positions=c,
            slot_mapping=table[np.arange(len(rows)), c // bs].astype(np.int64) * bs + c % bs,
            seqused_k=(c + 1).astype(np.int32), temperature=params.temperature, seeds=self.batch.seed[rows],
            lora=self.batch.lora[rows], page_table=table), all_greedy=params.all_greedy)
        v = b.inputs
        masks, out = None, SamplerOutput(b.tokens, None, None, None)
        if params.max_logprobs >= 0:  # logprobs come for every row of the step: all of them sampled again
            masks = self._masks(params, rows)
            out = self._sample(b.logits, params, upload(params.arrays(), self.device), v.rows, v.positions + 1,
                               v.seeds, masks)
            self.last_token[v.rows] = out.token_ids
        elif params.general.any():  # only the rows that need more than a temperature
            some = np.flatnonzero(params.general)
            sub = self.batch.sampling(rows[some], self.model_config.vocab_size, self.penalties is not None)
            some_t, *sub_t = upload([some, *sub.arrays()], self.device)
            masks = self._masks(sub, rows[some])
            got = self._sample(b.logits[some_t], sub, sub_t, v.rows[some_t], v.positions[some_t] + 1,
                               v.seeds[some_t], masks)
            b.tokens[some_t] = got.token_ids
            self.last_token[v.rows[some_t]] = got.token_ids
            if masks is not None:  # its rows among the step's, where the tokens are read back
                masks = dataclasses.replace(masks, host_index=some[masks.host_index])
        return self._pending(step.step, step.seq_ids, rows, v.rows, out, started, masks=masks)

    def _pending(self, step: int, ids: np.ndarray, rows: np.ndarray, rows_t: torch.Tensor, out: SamplerOutput,
                 started: float, prompt: PromptScores | None = None, masks: StepMasks | None = None,
                 pooled: PooledRows | None = None, ended: np.ndarray | None = None,
                 sampled: list[int] | None = None) -> PendingStep:
        """ended: the result's sequences where embedding requests end beside the sampled ones (`sampled` of them)."""
        if self.penalties is not None:
            self.penalties.record(rows_t, out.token_ids)
        if self.batch.bad_words:  # rows without bad words need no history: one that starts with some resets its own
            self.recent.record(rows_t, out.token_ids)
        counts = self.batch.logprobs[rows].tolist() if out.logprobs is not None else []
        pending = PendingStep(step, (ids if ended is None else ended).tolist(), out, counts, started, prompt, pooled,
                              sampled)
        if masks is not None:
            self.grammars.sampled(pending.host, pending.event, masks)
            pending.grammar_dead = ids[masks.host_index[masks.dead]].tolist()
        return pending

    def _masks(self, params: SamplingArrays, rows: np.ndarray) -> StepMasks | None:
        """The grammar masks of the sampling rows that follow one (structured output), else None."""
        return None if params.constrained is None else self.grammars.masks(rows, params.constrained)

    def _sample(self, logits: torch.Tensor, params: SamplingArrays, params_t: list[torch.Tensor],
                rows_t: torch.Tensor, positions: torch.Tensor, seeds: torch.Tensor,
                masks: StepMasks | None = None) -> SamplerOutput:
        """params_t: the device copies of params.arrays()."""
        temperature_t, penalty_t, top_k_t, top_p_t, min_p_t = params_t
        if (params.use_penalty or params.max_logprobs >= 0 or params.bias is not None or params.allowed is not None
                or params.bad_words is not None or masks is not None):
            logits = logits.float()
        if params.bias is not None:  # OpenAI's logit_bias: before penalties and filters
            row, token, value = upload(list(params.bias), self.device)
            logits = logits.index_put((row, token), value, accumulate=True)
        if params.use_penalty:
            penalty_t = penalty_t.view(-1, 3)
            logits = self.penalties.apply(logits, rows_t, penalty_t[:, 0], penalty_t[:, 1], penalty_t[:, 2])
        if params.bad_words is not None:  # vLLM's bad_words, after penalties (a -inf they would not move)
            word_row, before, last = upload(list(params.bad_words), self.device)
            logits = self.recent.ban(logits, rows_t, word_row, before.view(len(last), -1), last)
        if masks is not None:  # last: a disallowed token stays at -inf whatever its bias or penalty
            masks.apply(logits)
        if params.allowed is not None:  # vLLM's allowed_token_ids, as last
            row, token = upload(list(params.allowed), self.device)
            blocked = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
            blocked[row] = True  # the restricted rows, then their allowed tokens let through
            blocked[row, token] = False
            logits = logits.masked_fill(blocked, float("-inf"))
        return sample(logits, SamplingBatch(
            temperature=temperature_t, seeds=seeds, positions=positions, top_k=top_k_t if params.use_k else None,
            top_p=top_p_t if params.use_p else None, min_p=min_p_t if params.use_min_p else None,
            all_greedy=params.all_greedy, max_logprobs=params.max_logprobs), self.kernels)
