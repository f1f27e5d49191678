"""Structured output on the worker: an llguidance matcher per constrained sequence, advanced by the tokens the
sequence samples, and the token mask of each step it samples in (scheduler_svc/structured.py says why here).

Steps are pipelined: step N+1 is launched before step N's tokens reach the host. A constrained row's mask for
N+1 needs N's token, so masking first drains the steps whose tokens its matchers still lack (waiting for their
copy to the host, which step N+1's forward overlaps) and then fills the masks on the host, one bit per token.
Steps without constrained rows wait for nothing. A matcher that no token can continue (an error, or no bit
set) is dead: its row may then sample only an EOS, and the step reports the sequence so the scheduler ends it
with finish reason "grammar".
"""
from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import torch
from tokenizers import Tokenizer

from common.byte_level import char_to_byte
from common.model_files import eos_token_ids, tokenizer_json
from common.util import available_cpus
from worker_svc.kernels.uploads import upload

MASK_THREADS = 16
PARALLEL_ROWS = 16  # fewer rows are masked and fed on the calling thread: a hand-off to the pool costs more


@dataclass(slots=True)
class StepMasks:
    """The masks of one step's constrained sampling rows."""
    index: torch.Tensor     # int64 [C]: which of the step's sampling rows
    host_index: np.ndarray  # the same on the host
    allowed: torch.Tensor   # int32 [C, words]: bit t of word t // 32 set where token t may come next
    matchers: list[llguidance.LLMatcher]
    dead: np.ndarray        # bool [C]: no token continues its grammar (an EOS is forced)

    def apply(self, logits: torch.Tensor) -> None:
        """Sets the logits of disallowed tokens to -inf, in place, on the masked rows."""
        vocab = logits.shape[1]
        bits = (self.allowed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=logits.device)) & 1
        allowed = bits.view(len(self.matchers), -1)[:, :vocab].bool()
        logits[self.index] = logits[self.index].masked_fill(~allowed, float("-inf"))


class _Vocabulary:
    """A byte-level BPE checkpoint's tokens as llguidance takes them (its TokenizerWrapper's interface): each
    token's bytes, and as special only the added tokens the checkpoint marks special. (Read from tokenizer.json
    directly, llguidance counts every added token special, so text such as Qwen's `<tool_call>`, an added
    token marked not special, could never be written.) Ids past the tokenizer's vocabulary (the model's padding)
    are special too: no grammar reaches them."""

    def __init__(self, model_dir: Path, vocab_size: int):
        text = tokenizer_json(model_dir)
        self._tokenizer = Tokenizer.from_str(text)
        spec = json.loads(text)
        to_byte = char_to_byte()
        tokens = [b""] * vocab_size
        special = set(range(vocab_size))
        for text, i in spec["model"]["vocab"].items():
            if i < vocab_size:
                tokens[i] = bytes(to_byte[c] for c in text)
                special.discard(i)
        for added in spec.get("added_tokens", ()):
            i = added["id"]
            if i < vocab_size:
                tokens[i] = added["content"].encode()
                if not added.get("special", True):
                    special.discard(i)
        for i in special:
            tokens[i] = tokens[i] or f"<[{i}]>".encode()
        self.tokens, self.special_token_ids = tokens, sorted(special)
        eos = eos_token_ids(model_dir)
        self.eos_token_id, self.bos_token_id = eos[0], None

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


class Grammars:
    """Matchers of the rows whose sequences carry a grammar, and the sampled tokens still to feed them."""

    def __init__(self, model_dir: str | Path, vocab_size: int, device: torch.device):
        self.model_dir, self.vocab_size, self.device = Path(model_dir), vocab_size, device
        self._tokenizer: llguidance.LLTokenizer | None = None
        # The masks of a step's rows are filled on llguidance's own threads: on one core, hundreds of
        # constrained rows would hold up the step's sampling for longer than its forward takes.
        self._executor = llguidance.LLExecutor(min(available_cpus(), MASK_THREADS))
        self._matchers: dict[int, llguidance.LLMatcher] = {}  # row -> matcher of the sequence started there
        # (host token ids of a launched step, the event after their copy, which of them, the matchers they feed)
        self._unfed: deque[tuple[list[torch.Tensor | None], object, np.ndarray, list[llguidance.LLMatcher]]] = deque()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (about a second for a 150k vocabulary), from the checkpoint's tokenizer.json."""
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(
                _Vocabulary(self.model_dir, self.vocab_size)))
        return self._tokenizer

    def warm_up(self) -> None:
        """Builds the tokenizer and runs one matcher through a JSON schema's first masks now, so that the first
        constrained request of a serving worker pays neither (about two seconds on a 150k vocabulary)."""
        grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object", "properties": {"a": {}}}')
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        allowed = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        for token in self.tokenizer.tokenize_str('{"a": 1}'):
            llguidance.numpy.fill_next_token_bitmask(matcher, allowed, 0)
            matcher.consume_token(token)

    def start(self, row: int, grammar: str, generated: list[int]) -> None:
        """A new sequence in `row`; `generated`: the tokens it sampled before a preemption, fed at once."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if generated:
            matcher.consume_tokens(generated)
        self._matchers[row] = matcher

    def reset(self) -> None:
        self._matchers.clear()
        self._unfed.clear()

    def masks(self, rows: np.ndarray, index: np.ndarray) -> StepMasks:
        """The masks of the sampling rows rows[index] (each started with a grammar), after feeding every token
        their matchers lack."""
        self._feed()
        matchers = [self._matchers[int(r)] for r in rows[index]]
        allowed = llguidance.numpy.allocate_token_bitmask(len(matchers), self.vocab_size)
        if len(matchers) < PARALLEL_ROWS:
            for i, m in enumerate(matchers):
                llguidance.numpy.fill_next_token_bitmask(m, allowed, i)
        else:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, list(zip(matchers, range(len(matchers)))),
                                                         allowed)
        dead = ~allowed.any(axis=1) | np.fromiter((m.is_error() for m in matchers), bool, len(matchers))
        if dead.any():
            eos = self.tokenizer.eos_token
            allowed[dead] = 0
            allowed[dead, eos // 32] = np.int32(np.uint32(1 << (eos % 32)).view(np.int32))
        index_t, allowed_t = upload([index.astype(np.int64), allowed], self.device)
        return StepMasks(index_t, index, allowed_t.view(allowed.shape), matchers, dead)

    def sampled(self, host_tokens: list[torch.Tensor | None], event, masks: StepMasks) -> None:
        """A launched step sampled the masked rows' next tokens into host_tokens[0] (ready once `event` is)."""
        self._unfed.append((host_tokens, event, masks.host_index, masks.matchers))

    def _feed(self) -> None:
        while self._unfed:
            host, event, index, matchers = self._unfed.popleft()
            if event is not None:
                event.synchronize()
            fed = list(zip(matchers, host[0][index].tolist()))
            if len(fed) < PARALLEL_ROWS:
                for m, t in fed:
                    m.consume_token(t)
            else:
                llguidance.numpy.consume_token_par(self._executor, fed)
