"""Prompt lookup: the n-gram proposals of SSD's fast fallback (no draft forward)."""

from __future__ import annotations

NGRAM_MAX = 3
NGRAM_WINDOW = 1024


def common_prefix(a: tuple[int, ...] | list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def ngram_next(hist: list[int]) -> int:
    """The token that followed the most recent earlier occurrence of the longest suffix
    (n <= NGRAM_MAX) of ``hist``; the last token when nothing matches."""
    h = len(hist)
    for n in range(min(NGRAM_MAX, h - 1), 0, -1):
        suffix = hist[h - n:]
        for i in range(h - n - 1, -1, -1):
            if hist[i:i + n] == suffix:
                return hist[i + n]
    return hist[-1]
