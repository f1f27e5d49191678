"""Text helpers of the gateway's stream parsers (reasoning, tool calls)."""
from __future__ import annotations


def held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (may become the tag): what a
    stream parser holds back until the next delta says whether the tag comes."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
