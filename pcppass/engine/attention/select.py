"""Top-k selection without a sort: the DeepSeek-V3.2 lightning indexer's top-2048 by radix select
(:mod:`.select_kernels`): one program per row, after a first kernel has narrowed a long row to its
candidates with one program per part of the row (``SelectTiles.part`` positions each).

Cost model (instructions counted in an sm_90 build of the kernel, not timed): a radix pass costs
about 60 instructions per key (``tl.histogram`` lowers to a warp ballot per digit bit and a
popcount per bin), so four passes over a 32768-key row would dominate; a long row is narrowed
first by one compaction pass (about 45 per key) to the few thousand keys at or above a bound taken
from a sample of the row, and the radix passes and the final compaction read those only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from pcppass.engine.attention.launch import kernels

#: rows of at least SAMPLE_RATIO * k keys (and twice the sample) are sampled: evenly spaced keys
#: give a lower bound that leaves a little more than k candidates, in CANDIDATE_SLOTS * k slots
SAMPLE_RATIO = 4
CANDIDATE_SLOTS = 2


@dataclass(frozen=True)
class SelectTiles:
    """Launch shape of :func:`select_topk_triton`.

    ``chunk`` keys per chunk of a row (a row is re-read from L2 by each pass) and
    ``candidate_chunk`` of the candidates (below 2**15: a compaction packs two counts of a chunk
    into one int32), ``warps`` per program, ``sample`` evenly spaced keys for the lower bound;
    rows of at most ``min_chunk`` keys run as one chunk on ``min_warps`` warps (at least one key
    per lane). In a call of at most ``part_rows`` rows, a sampled row longer than ``part``
    positions has its candidates found by one program per ``part`` positions (``part=0``: by its
    own program, as a whole). Measured on the H200 (a sweep of 27 shapes, every one's picks equal;
    docs/KERNELS.md): 8 warps take 36 / 52 µs per call at 32 rows, 16k / 32k,
    against 43 / 63 µs with 16 (8 warps spill some registers in an sm_90 build and are still
    faster). With one program per row a call takes 49-52 µs at 32k from 4 to 64 rows; with parts
    36 µs up to 16 rows, 50.5 at 32 and 74 at 64, where every part repeats its row's sample
    (bench/results/decode_rows_h200.*). Either way the picks are the same, bitwise."""

    chunk: int = 4096
    warps: int = 8
    sample: int = 2048
    min_chunk: int = 1024
    min_warps: int = 4
    candidate_chunk: int = 1024
    part: int = 4096
    part_rows: int = 32


SELECT_TILES = SelectTiles()


def samples_the_row(length: int, k: int, tiles: SelectTiles) -> bool:
    """Whether rows of ``length`` keys are first narrowed by a sampled lower bound."""
    return length >= max(SAMPLE_RATIO * k, 2 * tiles.sample)


def sample_rank(k: int, length: int, sample: int) -> int:
    """Rank, among ``sample`` evenly spaced keys of ``length``, of the key used as lower bound:
    ``e = k * sample / length`` of them are expected at or above the k-th largest key of the row;
    ``4 sqrt(e) + 8`` more keep it below that key unless the sample is far from the row's
    distribution (then the kernel falls back to every visible key: slower, the same result)."""
    expected = k * sample / length
    return min(sample, math.ceil(expected + 4 * math.sqrt(expected)) + 8)


def select_topk_triton(scores: torch.Tensor, k: int, tiles: SelectTiles | None = None) -> torch.Tensor:
    """Logical positions of the ``k`` largest scores of each row of ``scores [T, span]`` (float32,
    -inf: not visible, no NaN) -> ``[T, k]`` int64, ascending, ``-1`` for picks with a -inf score;
    bitwise the tensor :func:`pcppass.engine.attention.launch.select_topk` returns.

    The reference picks the ``k`` largest keys ``(score, -position)`` (scores as monotonic integer
    bits, so ``-0.0 < +0.0``; rows shorter than ``k`` padded with -inf) and sorts them. Those keys
    are distinct, so its set is: every score above the k-th largest score ``t`` (with multiplicity),
    then the lowest positions among the scores equal to ``t`` until there are ``k``. A -inf pick is
    a -1 whatever its position, and -1s sort first; so each program selects among the visible
    scores only: ``v = min(k, visible)`` picks, written after ``k - v`` -1s.

    Each program finds ``t`` by radix select over the monotonic bits (four 8-bit digits from the
    most significant, each a histogram of the keys sharing the digits found so far), then walks its
    keys in position order and writes each pick at its running count (a prefix sum per chunk and
    running totals across chunks): the output is ascending without a sort. A long row first
    narrows its keys to the candidates at or above a lower bound taken from a sample of the row
    (see :func:`sample_rank`), written in position order to a scratch buffer, and selects among
    those; a bound that leaves too few candidates is dropped, too many and the row itself is read.
    A row longer than ``tiles.part`` (in a call of at most ``tiles.part_rows`` rows) is narrowed by
    one program per part (each takes the same bound from the same sample), and its selecting program
    joins the parts' candidates in order. Which way a row goes changes the time, never the picks.

    A row's result depends on that row alone; no host reads and fixed shapes, so a step that calls
    this can be captured in a CUDA graph.
    """
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"select_topk_triton: scores must be a float32 [T, span] tensor, got "
                         f"{scores.dtype} {tuple(scores.shape)}")
    if k < 0:
        raise ValueError(f"select_topk_triton: k = {k} is negative")
    tiles = tiles or SELECT_TILES
    rows, span = scores.shape
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if rows == 0 or k == 0:
        return out
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    length = max(span, k)
    small = length <= tiles.min_chunk
    chunk = min(tiles.chunk, tiles.min_chunk if small else triton.next_power_of_2(length))
    sampled = samples_the_row(length, k, tiles)
    cap = min(length, CANDIDATE_SLOTS * k) if sampled else 0
    parts = -(-length // tiles.part) if sampled and tiles.part and rows <= tiles.part_rows else 1
    warps = tiles.min_warps if small else tiles.warps
    step, rank = (length // tiles.sample, sample_rank(k, length, tiles.sample)) if sampled else (0, 0)
    device = scores.device
    cand_keys = torch.empty(rows if sampled else 1, max(cap, 1), dtype=torch.int32, device=device)
    cand_pos = torch.empty_like(cand_keys)
    if parts > 1:
        part_keys = torch.empty(rows, parts * tiles.part, dtype=torch.int32, device=device)
        part_pos = torch.empty_like(part_keys)
        counts = torch.empty(rows, parts, dtype=torch.int32, device=device)
        lows = torch.empty(rows, dtype=torch.int32, device=device)
        kernels("select_kernels").topk_candidates_kernel[(rows, parts)](
            scores, part_keys, part_pos, counts, lows, span, length, scores.stride(0), part_keys.stride(0), parts,
            tiles.part, step, rank, SAMPLE=tiles.sample, ROW_CHUNK=min(chunk, triton.next_power_of_2(tiles.part)),
            num_warps=warps,
        )
    else:
        part_keys = part_pos = counts = lows = cand_keys
    kernels("select_kernels").topk_select_kernel[(rows,)](
        scores, out, cand_keys, cand_pos, part_keys, part_pos, counts, lows, span, length, k, scores.stride(0),
        out.stride(0), cand_keys.stride(0), part_keys.stride(0), cap, parts, tiles.part, step, rank,
        SAMPLED=sampled, PARTS=parts > 1, SAMPLE=tiles.sample, ROW_CHUNK=chunk, CAND_CHUNK=tiles.candidate_chunk,
        num_warps=warps,
    )
    return out
