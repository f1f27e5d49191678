"""GPT-2's byte-level BPE alphabet (Qwen's tokenizer uses it): every byte stands for a printable character.
The worker's tokenizer writer and the gateway's token rendering both read it."""
from __future__ import annotations

import functools


@functools.cache
def byte_to_char() -> dict[int, str]:
    """The reversible byte -> printable character map: printable Latin-1 bytes stand for themselves,
    the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


@functools.cache
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_char().items()}
