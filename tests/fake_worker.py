"""A fake worker for scheduler tests, and the model folder it stands for.

FakeWorker applies StepPlans through the workers' own PersistentBatch (worker_svc/runtime/batch.py), which
rejects step gaps, a wrong epoch, unknown or duplicate ids, decodes that are not at the end of the known
tokens, block tables that do not cover the scheduled positions and writes to a block another live sequence
holds. On top it checks that every read of KV is what the sequence's prefix wrote there: each KV slot stores
a hash of the whole prefix up to its position, so a prefix hit on the wrong block, or a block reused while
still live, shows up as a mismatch.

A host pool of num_host_blocks blocks stands behind the KV blocks: a plan's swaps copy slot contents
between them before its reads, swap-outs first, and a swap-in into a block another live sequence holds
is a violation; its offloads copy after its writes.

With a sliding window a step reads only the keys inside the window of its first position, so a released
block (StepPlan.released_ids) that the window still covers shows up as a mismatch once it is reused.

With LoRA slots (lora_slots, and lora_capacity adapters held) it loads, unloads and places adapters into slots as
plans say (a path "bad" or one in `unreadable` fails to load; a placement of an adapter it does not hold, or into a
slot a held sequence runs under, is a violation), and a sequence's KV content chains from its adapter's weights, one
set per folder (path), so that a prefix hit on KV that other weights under the same name computed shows up as a
mismatch too (KV computed under the same weights, whatever slots and loads they went through, is still right).

It reads the model's weights again from a folder where a plan says so (StepPlan.load_weights; a path "bad" or one in
`unreadable` fails; a sequence held then is a violation): each folder's weights have an id (0: the ones it started
with), which a sequence admitted after the load samples under (token_fn(seed ^ id, position)) and chains its KV
from, so that a token or a prefix hit of the weights before shows up.

It samples token = token_fn(seed, position): results do not depend on batching, chunking or
preemption, so tests can predict every sequence's output.
"""

from __future__ import annotations

import json
import math
import shutil
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from protos import WORKER_PROTOCOL_VERSION, worker_pb2
from worker_svc.runtime.batch import PersistentBatch, PlanError

QWEN_EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>


class ProtocolViolation(AssertionError):
    pass


def default_token_fn(vocab_size: int) -> Callable[[int, int], int]:
    def token(seed: int, position: int) -> int:
        return xxhash.xxh64_intdigest(position.to_bytes(8, "little"), seed) % vocab_size

    return token


def weights_id(path: str) -> int:
    """The id of the model's weights in a folder, the same for every fake (0: the ones a fake starts with)."""
    return 0 if path == "fake-model" else zlib.crc32(path.encode())


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ProtocolViolation(msg)


@dataclass
class _Tokens:
    """What the fake knows of a sequence beyond the batch's counts: its tokens (sent, then sampled) and the
    KV content each position must hold."""
    token_ids: list[int]
    seed: int
    logprobs: int
    root: int = 0  # its LoRA adapter's weights and the model's (0: none, and the ones the worker started with)
    model: int = 0  # the model's weights it runs under (FakeWorker.model_weights)
    keys: list[int] = field(default_factory=list)

    def key(self, position: int) -> int:
        while len(self.keys) <= position:
            p = len(self.keys)
            prev = self.keys[-1] if p else self.root
            self.keys.append(hash((prev, self.token_ids[p])))
        return self.keys[position]


class FakeWorker:
    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 256,
        vocab_size: int = 1000,
        epoch: int = 7,
        token_fn: Callable[[int, int], int] | None = None,
        check_kv: bool = True,
        num_host_blocks: int = 0,
        sliding_window: int = 0,
        lora_slots: int = 0,
        lora_capacity: int = 0,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.epoch = epoch
        self.token_fn = token_fn or default_token_fn(vocab_size)
        self.check_kv = check_kv
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.num_host_blocks = num_host_blocks
        self.sliding_window = sliding_window  # a query at position p reads keys in (p - this, p]; 0: all
        self.host_kv: list[list[int | None]] = [[None] * block_size for _ in range(num_host_blocks)]
        self.num_swapped = 0  # blocks copied either way
        self.lora_slots = lora_slots
        self.lora_capacity = max(lora_capacity, lora_slots)
        self.loads: dict[str, int] = {}  # a loaded adapter's weights, by name
        self.folders: dict[str, str] = {}  # where each loaded adapter was read from
        self.dropped: dict[str, str] = {}  # adapters dropped for room (StepPlan.drop_loras): their folders
        self.weights: dict[str, int] = {}  # the weights in each folder read so far
        self.unreadable: set[str] = set()  # folders that fail to load (as "bad" does)
        self.weights_path = "fake-model"  # where the model's weights came from
        self.model_weights = 0  # their id (weights_id)
        self.num_loads = 0
        self.num_placements = 0
        self.batch: PersistentBatch | None = None  # sized by Describe's limits
        self.seqs: dict[int, _Tokens] = {}
        self.plans: list[worker_pb2.StepPlan] = []
        self.results: list[worker_pb2.StepResult] = []
        self._pending: deque[worker_pb2.StepResult] = deque()
        self.closed = False

    # --- the Executor protocol -------------------------------------------------------------------

    def describe(self, request: worker_pb2.DescribeRequest) -> worker_pb2.DescribeResponse:
        self.batch = PersistentBatch(request.max_num_seqs or 1024, self.num_blocks, self.block_size,
                                     self.max_model_len, request.max_num_batched_tokens, self.epoch,
                                     self.num_host_blocks, self.sliding_window, [""] * self.lora_slots)
        return worker_pb2.DescribeResponse(
            protocol_version=WORKER_PROTOCOL_VERSION,
            model="fake",
            dtype="float32",
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            tensor_parallel_size=1,
            epoch=self.epoch,
            vocab_size=self.vocab_size,
            worker_id="fake-0",
            device="cpu",
            max_num_seqs=request.max_num_seqs,
            max_num_batched_tokens=request.max_num_batched_tokens,
            num_host_blocks=self.num_host_blocks,
            sliding_window=self.sliding_window,
            max_loras=self.lora_slots,
            max_cpu_loras=self.lora_capacity,
            lora_slots=self.batch.lora_adapters,
            lora_adapters=list(self.loads),
            lora_paths=[self.folders[name] for name in self.loads],
            dropped_loras=list(self.dropped),
            dropped_lora_paths=list(self.dropped.values()),
            weights_path=self.weights_path,
        )

    def submit(self, plan: worker_pb2.StepPlan) -> None:
        self._pending.append(self.execute(plan))

    def receive(self) -> worker_pb2.StepResult:
        return self._pending.popleft()

    def close(self) -> None:
        self.closed = True

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    @property
    def step(self) -> int:
        """The last step applied."""
        return self.batch.next_step - 1

    # --- applying a plan -------------------------------------------------------------------------

    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        """The worker's own checks (PersistentBatch.apply), then the KV each step reads and writes."""
        bs = self.block_size
        try:
            step = self.batch.apply(plan)
        except PlanError as e:
            raise ProtocolViolation(str(e)) from None
        self.plans.append(plan)
        for sid in (*plan.finished_ids, *plan.preempted_ids):
            del self.seqs[sid]
        self._swap(plan)
        result = worker_pb2.StepResult(step=plan.step)
        if plan.load_weights:
            _check(not self.seqs, f"weights read again while {len(self.seqs)} sequence(s) are held")
            if plan.load_weights == "bad" or plan.load_weights in self.unreadable:
                result.failed_weights = f"cannot read weights from {plan.load_weights!r}"
            else:
                self.weights_path = plan.load_weights
                self.model_weights = weights_id(plan.load_weights)
        for name in plan.unload_loras:  # the batch freed its slot, if it had one
            _check(name in self.loads or name in self.dropped, f"unload of {name!r}, which is not loaded")
            if self.dropped.pop(name, None) is None:
                del self.loads[name], self.folders[name]
        for name in plan.drop_loras:
            _check(name in self.loads, f"drop of {name!r}, which is not loaded")
            self.dropped[name] = self.folders.pop(name)
            del self.loads[name]
        for adapter in plan.load_loras:
            _check(len(self.loads) < self.lora_capacity, f"load of {adapter.name!r} beyond {self.lora_capacity}")
            self.dropped.pop(adapter.name, None)
            if adapter.path == "bad" or adapter.path in self.unreadable or adapter.name in self.loads:
                result.failed_loras[adapter.name] = f"cannot load {adapter.name!r} from {adapter.path!r}"
                continue
            self.num_loads += 1
            self.loads[adapter.name] = self.weights.setdefault(adapter.path, len(self.weights) + 1)
            self.folders[adapter.name] = adapter.path
        for placed in plan.lora_slots:
            _check(placed.name in self.loads and placed.name not in result.failed_loras,
                   f"{placed.name!r} placed into a slot but not loaded")
            self.num_placements += 1
        for ns in plan.new_seqs:
            lora, model = self.loads.get(ns.sampling.lora, 0), self.model_weights
            self.seqs[ns.seq_id] = _Tokens(list(ns.token_ids), ns.sampling.seed, ns.sampling.logprobs,
                                           hash((lora, model)) if model else lora, model)
        batch = [(int(sid), self.seqs[int(sid)], self.batch.block_table[row], int(c), int(n))
                 for sid, row, c, n in zip(step.seq_ids, step.rows, step.num_computed, step.num_scheduled)]
        # Reads first (KV of earlier steps only), then writes: a hit on a block written in this same
        # step reads nothing and fails.
        if self.check_kv:
            for sid, m, table, c, n in batch:
                for p in range(max(c + 1 - self.sliding_window, 0) if self.sliding_window else 0, c):
                    got = self.kv[table[p // bs]][p % bs]
                    _check(got == m.key(p), f"seq {sid}: wrong KV at position {p}")
        sampled: list[tuple[_Tokens, int]] = []
        for (sid, m, table, c, n), samples in zip(batch, step.samples):
            for p in range(c, c + n):
                self.kv[table[p // bs]][p % bs] = m.key(p)
            if samples:
                tok = self.token_fn(m.seed ^ m.model, c + n)
                m.token_ids.append(tok)
                result.seq_ids.append(sid)
                result.token_ids.append(tok)
                sampled.append((m, tok))
        if any(m.logprobs >= 0 for m, _ in sampled):
            for m, tok in sampled:
                result.logprobs.append(fake_logprob(tok) if m.logprobs >= 0 else math.nan)
                for r in range(max(m.logprobs, 0)):
                    result.top_token_ids.append((tok + r) % self.vocab_size)
                    result.top_logprobs.append(fake_logprob(tok) - r)
        for g, h in zip(plan.offload_blocks, plan.offload_host_blocks):  # after the step's writes
            self.host_kv[h] = list(self.kv[g])
        self.num_swapped += len(plan.offload_blocks)
        self.results.append(result)
        return result

    def _swap(self, plan: worker_pb2.StepPlan) -> None:
        """The copies (PersistentBatch.apply checked the columns): swap-outs first."""
        for g, h in zip(plan.swap_out_blocks, plan.swap_out_host_blocks):
            self.host_kv[h] = list(self.kv[g])
        for h, g in zip(plan.swap_in_host_blocks, plan.swap_in_blocks):
            self.kv[g] = list(self.host_kv[h])
        self.num_swapped += len(plan.swap_out_blocks) + len(plan.swap_in_blocks)


def fake_logprob(token_id: int) -> float:
    return -0.125 * (1 + token_id % 8)


def write_model_dir(out_dir: Path, tokenizer_cache: Path, *, max_position_embeddings: int = 1024) -> Path:
    """The model folder the fake worker stands for: config files and Qwen3's tokenizer, copied from
    tokenizer_cache (written there on first use)."""
    from worker_svc.checkpoints.tokenizer_files import write_qwen_tokenizer

    if not (tokenizer_cache / "tokenizer.json").exists():
        write_qwen_tokenizer(tokenizer_cache)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_cache / name, out_dir / name)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "eos_token_id": QWEN_EOS_IDS[0],
        "bos_token_id": QWEN_EOS_IDS[1],
        "max_position_embeddings": max_position_embeddings,
    }
    (out_dir / "config.json").write_text(json.dumps(config))
    generation = {"eos_token_id": list(QWEN_EOS_IDS), "bos_token_id": QWEN_EOS_IDS[1]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation))
    return out_dir
