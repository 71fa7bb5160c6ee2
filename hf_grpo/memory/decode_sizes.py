"""The decoder's sizing rules as plain arithmetic: its cache lengths and its prefill pieces.

``hf_grpo.generation`` sizes its static KV cache and splits a long prompt's prefill by these; ``context_fit``
estimates a run's memory by the same rules, without importing the decoder (memory/ sits below generation/).
"""

from __future__ import annotations


def cache_len_ladder(need: int, minimum: int = 256) -> int:
    """The smallest rung of ``minimum x {1, 1.5} x 2^k`` that holds ``need`` positions.

    Rungs 1.5x or 4/3x apart bound the compiles of a run to about 2 log2(longest / minimum) while
    wasting at most a third of the cache on attention over masked positions.
    """
    if need < 1 or minimum < 1:
        raise ValueError(f"cache lengths must be positive, got need={need}, minimum={minimum}")
    rung = minimum
    while True:
        for candidate in (rung, rung * 3 // 2):
            if need <= candidate:
                return candidate
        rung *= 2


# A reserved cache is rounded up to a multiple of this many positions (whole blocks for the decode attention).
RESERVED_ALIGN = 256


def cache_positions(need: int, reserved: int, minimum: int = 256) -> int:
    """The static cache's length for a call that needs ``need`` positions, in a run that reserved ``reserved`` (its
    longest prompt + ``max_completion_length``, ``CudaGraphBackend.reserve``; 0 when unknown).

    Unreserved, the cache climbs ``cache_len_ladder``'s rungs (a bounded number of compiles). A reserved length is
    the run's one cache, so it is sized to the rows: the ladder's rung or the reserved length rounded up to
    ``RESERVED_ALIGN``, whichever is shorter. At long completions a rung wastes up to a third of the cache (8 x
    (1k + 64k) positions of a 7B model: 45 GB on rung 98,304 against 30.5 GB for 66,560).
    """
    if need > reserved:
        return cache_len_ladder(need, minimum)
    return min(cache_len_ladder(reserved, minimum), max(minimum, -(-reserved // RESERVED_ALIGN) * RESERVED_ALIGN))


# Attention-score bytes one prefill forward may allocate (see StaticDecoder.prefill_pieces).
PREFILL_SCORE_BYTES = 256 * 2**20


def prefill_pieces(prompt_len: int, score_bytes: int, cache_len: int, sliced: bool) -> list[tuple[int, int]]:
    """The ``(start, end)`` prompt positions of each prefill forward: each piece a multiple of 16 positions (but the
    last), at least 16, as long as its scores against its keys (the positions up to its end when ``sliced``, else
    the whole ``cache_len``) fit ``PREFILL_SCORE_BYTES``; ``score_bytes`` is one query's scores against one key over
    the rows and heads (rows x heads x 4)."""

    def fits(start: int, piece: int) -> bool:
        keys = min(start + piece, prompt_len) if sliced else cache_len
        return score_bytes * piece * keys <= PREFILL_SCORE_BYTES

    pieces, start = [], 0
    while start < prompt_len:
        piece = 16
        while start + piece < prompt_len and fits(start, piece + 16):
            piece += 16
        pieces.append((start, min(start + piece, prompt_len)))
        start += piece
    return pieces
