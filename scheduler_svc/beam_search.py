"""Beam search, as vLLM's use_beam_search: n beams, each extended a step by the 2n likeliest next tokens the model
gives it (one step of each beam's text so far: a completion of one token with its top 2n logprobs, its prompt from
the prefix cache but for the last block), the n best kept by their summed logprob over their length, prompt included,
to the power length_penalty. A beam whose next token ends the sequence (an EOS, unless ignore_eos) is complete. After
max_tokens steps the answer is the n best of the complete and the running beams, best first. Greedy steps: the same
request gives the same beams."""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass


@dataclass(slots=True)
class Beam:
    tokens: list[int]                # generated (an ending EOS not among them)
    logprob: float = 0.0             # summed over tokens (and the ending EOS)
    finish_reason: str = "length"    # or "stop": it drew an EOS
    stop_token: int | None = None    # that EOS


# next_tokens(prompts, k): for each prompt, the k likeliest next tokens as (token id, logprob), best first
NextTokens = Callable[[list[list[int]], int], Awaitable[list[list[tuple[int, float]]]]]


async def beam_search(next_tokens: NextTokens, prompt: list[int], width: int, max_tokens: int,
                      eos_token_ids: Collection[int], ignore_eos: bool = False,
                      length_penalty: float = 1.0) -> list[Beam]:
    """The `width` best beams after max_tokens steps, best first."""
    def score(beam: Beam) -> float:
        return beam.logprob / (len(prompt) + len(beam.tokens)) ** length_penalty

    beams, complete = [Beam([])], []
    for _ in range(max_tokens):
        grown = []
        for beam, top in zip(beams, await next_tokens([prompt + b.tokens for b in beams], 2 * width)):
            for token, logprob in top:
                if token in eos_token_ids and not ignore_eos:
                    complete.append(Beam(beam.tokens, beam.logprob + logprob, "stop", token))
                else:
                    grown.append(Beam(beam.tokens + [token], beam.logprob + logprob))
        beams = sorted(grown, key=score, reverse=True)[:width]
        if not beams:
            break
    return sorted(complete + beams, key=score, reverse=True)[:width]
