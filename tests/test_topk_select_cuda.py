"""The sort-free top-k kernel on CUDA at the DeepSeek-V3.2 indexer's shape (64 rows, span 32768,
top-2048), against the reference ``launch.select_topk``: the same tensor, bitwise, with heavy ties
and every path of a sampled row; a row's result does not depend on the other rows; a captured CUDA
graph's replay gives the eager tensor (skipped without a GPU)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROWS, SPAN, K = 64, 32768, 2048


def indexer_like_scores(seed: int) -> torch.Tensor:
    """Scores on a coarse grid (many ties, both zeros) with per-row context lengths (-inf tails),
    all-invisible rows, rows with fewer visible scores than k, rows whose sampled positions stand
    above the rest, and rows whose top is one long run of equal scores."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(ROWS, SPAN, device="cuda", generator=g).mul(16).round().div(16)
    scores[scores == 0] = -0.0
    scores[::5, ::3] = 0.0
    lengths = torch.randint(1, SPAN + 1, (ROWS,), device="cuda", generator=g)
    lengths[:4] = torch.tensor([0, 100, K - 1, K + 1], device="cuda")
    scores[torch.arange(SPAN, device="cuda")[None, :] >= lengths[:, None]] = float("-inf")
    scores[4, :: SPAN // 2048] += 50.0
    scores[5, : 3 * K] = 7.0
    return scores


def test_matches_reference_with_ties():
    from pcppass.engine.attention.launch import select_topk
    from pcppass.engine.attention.select import select_topk_triton

    for seed in (0, 1):
        scores = indexer_like_scores(seed)
        assert torch.equal(select_topk_triton(scores, K), select_topk(scores, K))
    plain = torch.randn(ROWS, SPAN, device="cuda")
    assert torch.equal(select_topk_triton(plain, K), select_topk(plain, K))
    short = plain[:, :1500]
    assert torch.equal(select_topk_triton(short, K), select_topk(short, K))


def test_rows_do_not_depend_on_their_step_and_graph_replays_match():
    from pcppass.engine.attention.select import select_topk_triton

    scores = indexer_like_scores(2)
    eager = select_topk_triton(scores, K)
    for row in (0, 4, 5, 17):
        assert torch.equal(select_topk_triton(scores[row:row + 1].clone(), K), eager[row:row + 1])
    static = scores.clone()
    select_topk_triton(static, K)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = select_topk_triton(static, K)
    static.copy_(indexer_like_scores(3))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, select_topk_triton(static, K))
    static.copy_(scores)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
