"""Scores of text pairs, as vLLM's score and rerank APIs give them: by an embedding model the cosine similarity of
the two texts' embeddings, by a cross-encoder (a sequence classifier of one label) its probability for the two texts
read as one input. The pairing rule (one to one, one to many, many to many) is here, for the client, the gateway and
the offline LLM alike."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Text = str | Sequence[int]  # a text, or its token ids


@dataclass(frozen=True, slots=True)
class ScorePlan:
    """What to embed (the first side's texts, then the second's) and the pairs to score, as indices into it."""
    inputs: list[Text]
    pairs: list[tuple[int, int]]

    def side_of(self, index: int) -> int:
        """Which side (0: text_1, 1: text_2) input `index` comes from."""
        return int(index >= len(self.inputs) - len(self.pairs))


@dataclass(frozen=True, slots=True)
class Scores:
    """One score per pair, in order, and the tokens embedded."""
    scores: list[float]
    prompt_tokens: int


def _texts(side: Text | Sequence[Text]) -> list[Text]:
    if isinstance(side, str) or (side and all(isinstance(t, int) for t in side)):
        return [side]
    return list(side)


def score_plan(text_1: Text | Sequence[Text], text_2: Text | Sequence[Text]) -> ScorePlan:
    """text_1 against text_2: one text against one, one against each of many, or the i-th against the i-th.
    ValueError naming the side that is empty or does not pair."""
    first, second = _texts(text_1), _texts(text_2)
    for name, side in (("text_1", first), ("text_2", second)):
        if not side:
            raise ValueError(f"{name} must hold at least one text")
    if len(first) > 1 and len(first) != len(second):
        raise ValueError(f"text_2 must hold one text for each of text_1's {len(first)} (or text_1 one text): "
                         f"it holds {len(second)}")
    n = len(first)
    return ScorePlan(first + second, [(j if n > 1 else 0, n + j) for j in range(len(second))])


def cosine(u: Sequence[float], v: Sequence[float]) -> float:
    norm = math.sqrt(math.fsum(x * x for x in u) * math.fsum(y * y for y in v))
    return math.fsum(x * y for x, y in zip(u, v)) / norm if norm else 0.0


def pair_scores(plan: ScorePlan, vectors: Sequence[Sequence[float]]) -> list[float]:
    """The plan's pairs' scores from the embeddings of its inputs."""
    return [cosine(vectors[i], vectors[j]) for i, j in plan.pairs]


def cross_encoder_pairs(plan: ScorePlan, labels: Sequence[str]) -> list[tuple[str, str]]:
    """The plan's pairs as the text pairs a cross-encoder (a classifier of one label) reads, one input each; its
    score of a pair is that label's probability. ValueError for a classifier of several labels, or token ids on a
    side (naming it): a pair is tokenized as the tokenizer joins two texts."""
    if len(labels) != 1:
        raise ValueError(f"text_1 and text_2 are scored by an embedding model or a cross-encoder (a classifier of "
                         f"one label); this model classifies into {len(labels)} labels: use classify")
    for i, j in plan.pairs:
        for index in (i, j):
            if not isinstance(plan.inputs[index], str):
                raise ValueError(f"{('text_1', 'text_2')[plan.side_of(index)]} must hold texts, not token ids: a "
                                 "cross-encoder reads each pair as the tokenizer joins two texts")
    return [(plan.inputs[i], plan.inputs[j]) for i, j in plan.pairs]
