"""The sort-free top-k kernel (pcppass.engine.attention.select) against the reference
``launch.select_topk`` on CPU tensors under ``TRITON_INTERPRET=1``: the same tensor, bitwise, for
random scores, heavy ties (``0.0`` and ``-0.0`` are different keys), -inf rows, rows with fewer
visible scores than ``k``, rows shorter than ``k``, ``k = 1`` and ``k = span``, negative scores,
``+inf``, denormals, strided rows, and a hypothesis property over small shapes.

Each case runs with the launcher's chunk sizes and with tiny ones (several chunks and a sampled
lower bound even in short rows), the latter with a row's candidates found by several programs
(parts of 32 positions) and by the row's own program; the sampled rows are also driven through
each of their paths, both ways: the bound leaves a few candidates, too few (dropped), too many
(the row is read).
"""

import pytest
import torch
import triton  # noqa: F401  (imported in compiled mode before the interpreter is switched on, as in the
# full suite: the kernels must not call the library's compiled-mode @triton.jit functions)
from hypothesis import given, settings
from hypothesis import strategies as st

NEG_INF, POS_INF = float("-inf"), float("inf")
DENORMALS = [1e-45, -1e-45, 3e-42, -3e-42, 1.1754942e-38, -1.1754942e-38]
#: a handful of levels: ties everywhere, both zeros, both infinities
LEVELS = [0.0, -0.0, 1.0, -1.0, 2.5, -2.5, NEG_INF, POS_INF, 1e-45, -1e-45]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def tiny_tiles(chunk: int = 16, candidate_chunk: int = 8, sample: int = 16, part: int = 32, part_rows: int = 32):
    """Chunks of 16 keys (8 candidates), samples of 16 keys and parts of 32 positions: short rows
    span many chunks, are sampled too and narrowed by several programs (``part=0``: by one)."""
    from pcppass.engine.attention.select import SelectTiles

    return SelectTiles(chunk=chunk, warps=4, sample=sample, min_chunk=16, min_warps=4,
                       candidate_chunk=candidate_chunk, part=part, part_rows=part_rows)


def use_tiny_tiles(monkeypatch, **sizes):
    from pcppass.engine.attention import select

    monkeypatch.setattr(select, "SELECT_TILES", tiny_tiles(**sizes))


@pytest.fixture(params=["launcher", "tiny", "tiny_one_program"])
def tiles(request, monkeypatch):
    """the launcher's chunk sizes, or tiny ones (a sampled row's candidates found by a program per
    part, or by the row's own)."""
    if request.param == "tiny":
        use_tiny_tiles(monkeypatch)
    elif request.param == "tiny_one_program":
        use_tiny_tiles(monkeypatch, part=0)
    return request.param


def check(scores: torch.Tensor, k: int) -> torch.Tensor:
    from pcppass.engine.attention.launch import select_topk
    from pcppass.engine.attention.select import select_topk_triton

    got, want = select_topk_triton(scores, k), select_topk(scores, k)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), f"k={k}\nscores={scores}\ngot={got}\nwant={want}"
    return got


def levels(shape, values, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(values, dtype=torch.float32)
    return pool[torch.randint(0, len(values), shape, generator=g)]


def test_random_scores(tiles):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 301, generator=g)  # 301: not a multiple of any chunk
    for k in (1, 7, 37, 300, 301):
        check(scores, k)


def test_heavy_ties_both_zeros(tiles):
    """Few levels, ``0.0`` and ``-0.0`` among them: the lowest positions win among equal keys, and
    ``-0.0`` ranks below ``+0.0``."""
    scores = levels((6, 203), [0.0, -0.0, 1.0, -1.0, 0.5], seed=1)
    for k in (1, 20, 70, 150, 203):
        check(scores, k)
    zeros = torch.tensor([[-0.0, 0.0, -0.0, 0.0, -0.0, 0.0]])
    assert check(zeros, 3).tolist() == [[1, 3, 5]]


def test_invisible_rows_and_fewer_visible_than_k(tiles):
    """All -inf rows give k -1s; rows with fewer visible scores than k give -1s first, then every
    visible position."""
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(5, 150, generator=g)
    scores[1] = NEG_INF
    scores[2, 10:] = NEG_INF
    scores[3, ::7] = NEG_INF
    scores[4, :140] = NEG_INF
    for k in (5, 12, 64, 150):
        check(scores, k)
    assert (check(scores, 64)[1] == -1).all()


def test_rows_shorter_than_k(tiles):
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 10, generator=g)
    scores[1, 4:] = NEG_INF
    scores[2] = NEG_INF
    for k in (11, 25):
        check(scores, k)
    check(torch.empty(2, 0), 4)


def test_negative_infinite_and_denormal_scores(tiles):
    g = torch.Generator().manual_seed(4)
    negative = -torch.rand(2, 90, generator=g) - 1e-3
    infinite = levels((2, 90), [POS_INF, NEG_INF, 3.0, -3.0], seed=5)
    denormal = levels((2, 90), DENORMALS + [0.0, -0.0], seed=6)
    for scores in (negative, infinite, denormal):
        for k in (1, 9, 45, 90):
            check(scores, k)


def test_strided_rows_and_edge_sizes(tiles):
    """Rows that are a slice of a wider tensor (row stride != span), a transposed tensor, no rows,
    ``k = 0``."""
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(4, 200, generator=g)
    check(wide[:, 30:130], 17)
    check(torch.randn(60, 3, generator=g).t(), 11)
    check(torch.empty(0, 50), 5)
    check(wide, 0)


def test_parts_only_in_calls_of_few_rows(monkeypatch):
    """Past ``part_rows`` rows a call narrows each row in its own program: the same picks."""
    from pcppass.engine.attention.select import select_topk_triton

    g = torch.Generator().manual_seed(10)
    scores = torch.randn(5, 300, generator=g).mul(4).round()
    use_tiny_tiles(monkeypatch, part_rows=4)
    whole = check(scores, 20)
    assert torch.equal(select_topk_triton(scores[:4], 20), whole[:4])  # 4 rows: by parts


def test_long_row_with_the_launcher_sample():
    """Rows long enough for the launcher's own sample: candidates at or above the sampled bound,
    every visible score (fewer than k), every visible score (the sample mostly -inf)."""
    g = torch.Generator().manual_seed(8)
    scores = torch.randn(3, 5000, generator=g).mul(8).round()  # ties
    scores[1, 700:] = NEG_INF
    scores[2, 1100:] = NEG_INF
    assert [sampled_path(row, 1000) for row in scores] == ["candidates"] * 3
    check(scores, 1000)


def sampled_path(row: torch.Tensor, k: int) -> str:
    """Which path the launcher's plan sends a sampled row down (the kernel's rule, in torch)."""
    from pcppass.engine.attention import select
    from pcppass.engine.attention.launch import _NEG_INF_MONOTONIC, ordered_keys

    length = row.shape[0]
    keys = ordered_keys(row[None])[0] >> 32
    tiles = select.SELECT_TILES
    assert select.samples_the_row(length, k, tiles), "the launcher would not sample this row"
    sample = keys[:: length // tiles.sample][: tiles.sample]
    rank = select.sample_rank(k, length, tiles.sample)
    low = max(int(sample.sort(descending=True).values[rank - 1]), _NEG_INF_MONOTONIC + 1)
    candidates = int((keys >= low).sum())
    if candidates < k and low > _NEG_INF_MONOTONIC + 1:
        return "dropped"
    return "candidates" if candidates <= select.CANDIDATE_SLOTS * k else "row"


@pytest.mark.parametrize("part", [0, 256, 100])
def test_sampled_bound_paths(monkeypatch, part):
    """Each path of a sampled row (small chunks, 512 sampled keys): a bound that leaves a little
    more than k candidates (random rows, ties, a -inf tail); one that leaves fewer than k (every
    sampled key above the rest: dropped); one with more candidates than their slots (ties at the
    top: the row is read); fewer visible keys than k (every one a candidate). The candidates found
    by the row's own program, by 8 programs of 256 positions, and by 21 of 100 (parts that split
    chunks, a short last part)."""
    use_tiny_tiles(monkeypatch, chunk=64, candidate_chunk=32, sample=512, part=part)
    g = torch.Generator().manual_seed(9)
    span, k = 2048, 400
    scores = torch.rand(6, span, generator=g)
    scores[1] = scores[1].mul(64).round()
    scores[2, 1900:] = NEG_INF
    scores[3, :: span // 512] += 100.0
    scores[4, :1000] = 5.0
    scores[5, 300:] = NEG_INF
    paths = [sampled_path(row, k) for row in scores]
    assert paths == ["candidates", "candidates", "candidates", "dropped", "row", "candidates"], paths
    check(scores, k)


@settings(max_examples=60, derandomize=True, database=None, deadline=None)
@given(data=st.data())
def test_property_small_shapes(data):
    """Any small row set and k, values from ties, both zeros, both infinities, denormals and
    normal floats: the reference's tensor (tiny tiles, so short rows are sampled too)."""
    from pcppass.engine.attention import select

    rows = data.draw(st.integers(1, 3), label="rows")
    span = data.draw(st.integers(0, 80), label="span")
    k = data.draw(st.integers(1, 90), label="k")
    value = st.one_of(st.sampled_from(LEVELS + DENORMALS),
                      st.floats(-1e3, 1e3, allow_nan=False, width=32))
    values = data.draw(st.lists(value, min_size=rows * span, max_size=rows * span), label="values")
    scores = torch.tensor(values, dtype=torch.float32).reshape(rows, span)
    saved = select.SELECT_TILES
    try:
        select.SELECT_TILES = tiny_tiles(sample=8)
        check(scores, k)
    finally:
        select.SELECT_TILES = saved


def test_bad_input_is_refused():
    from pcppass.engine.attention.select import select_topk_triton

    with pytest.raises(ValueError, match="float32"):
        select_topk_triton(torch.zeros(2, 8, dtype=torch.float16), 3)
    with pytest.raises(ValueError, match="float32"):
        select_topk_triton(torch.zeros(8), 3)
    with pytest.raises(ValueError, match="negative"):
        select_topk_triton(torch.zeros(2, 8), -1)
