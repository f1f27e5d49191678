"""Token counts of a finished completion, as the public API reports them (splitserve.proto's Usage)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache at the first admission
