"""Row movement ops of the replica sync (single process): layouts, packing, header, conflicts.

The multi-rank behaviour of the same ops is covered by tests/test_sharding_models.py; here the
byte-level contract is checked against hand-computed positions, including the block-split indexer
layout where one token's bytes are two separate segments of its block.
"""

from __future__ import annotations

import pytest
import torch

import pcppass.sync.rows as rows
from pcppass.errors import PcpSyncError
from pcppass.spec import BlockSplit, IndexedDim, PagedRows, ResolvedLayout

FP = "ab" * 32


class _Arg:
    def __init__(self, *shape):
        self.shape = shape


def _random_bits(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (*shape[:-1], shape[-1] * torch.empty((), dtype=dtype).element_size()),
                         generator=g, dtype=torch.uint8).view(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8])
def test_paged_rows_round_trip_exact_bits(dtype):
    cache = _random_bits((5, 4, 2, 3), dtype)
    layout = PagedRows().resolve(cache.shape, cache.element_size(), {})
    slots = torch.tensor([7, 0, 19])
    got = rows.read_rows(cache, slots, layout)
    assert got.shape == (3, 6 * cache.element_size())
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(got[i], cache[s // 4, s % 4].contiguous().view(torch.uint8).reshape(-1))
    other = torch.zeros_like(cache)
    rows.write_rows(other, slots, got, layout)
    for s in slots.tolist():
        assert torch.equal(other[s // 4, s % 4].view(torch.uint8), cache[s // 4, s % 4].view(torch.uint8))
    untouched = torch.ones(5 * 4, dtype=torch.bool)
    untouched[slots] = False
    assert not other.view(torch.uint8).reshape(20, -1)[untouched].any()


def test_paged_rows_non_contiguous_cache():
    base = _random_bits((2, 5, 4, 6), torch.float32)
    cache = base[1]  # a strided view: [5, 4, 6] with block stride of the parent
    layout = PagedRows().resolve(cache.shape, 4, {})
    slots = torch.tensor([3, 17])
    data = rows.read_rows(cache, slots, layout)
    target = torch.zeros_like(base)
    rows.write_rows(target[1], slots, data, layout)
    assert torch.equal(target[1][0, 3].view(torch.int32), cache[0, 3].view(torch.int32))
    assert torch.equal(target[1][4, 1].view(torch.int32), cache[4, 1].view(torch.int32))
    assert not target[0].view(torch.int32).any()


def test_block_split_moves_both_segments_of_a_token():
    d, qbs, bs, nb = 8, 4, 4, 3
    layout = BlockSplit().resolve((nb, bs * (d + 4 * d // qbs)), 1, {"k": _Arg(5, d), "quant_block_size": qbs})
    assert layout.bytes_per_row == d + 8 and layout.segments == ((0, d, d), (bs * d, 8, 8))
    cache = torch.randint(0, 256, (nb, bs * (d + 8)), dtype=torch.uint8)
    slot = 1 * bs + 2  # block 1, token 2
    data = rows.read_rows(cache, torch.tensor([slot]), layout)
    assert torch.equal(data[0, :d], cache[1, 2 * d:3 * d])
    assert torch.equal(data[0, d:], cache[1, bs * d + 2 * 8: bs * d + 3 * 8])
    other = torch.zeros_like(cache)
    rows.write_rows(other, torch.tensor([slot]), data, layout)
    expect = torch.zeros_like(cache)
    expect[1, 2 * d:3 * d] = cache[1, 2 * d:3 * d]
    expect[1, bs * d + 16: bs * d + 24] = cache[1, bs * d + 16: bs * d + 24]
    assert torch.equal(other, expect)


def test_indexed_dim_rows_along_a_middle_dim():
    cache = torch.randn(2, 3, 10, 4)  # HF StaticCache: [B, H, max_len, D], rows along dim 2
    layout = IndexedDim(dim=2).resolve(cache.shape, 4, {})
    idx = torch.tensor([9, 4])
    data = rows.read_rows(cache, idx, layout)
    other = torch.zeros_like(cache)
    rows.write_rows(other, idx, data, layout)
    assert torch.equal(other[:, :, idx], cache[:, :, idx])
    assert not other[:, :, :4].any() and not other[:, :, 5:9].any()


def test_pack_header_and_unpack_round_trip():
    cache = torch.randn(4, 2, 3)
    layout = PagedRows().resolve(cache.shape, 4, {})
    slots = torch.tensor([5, -1, 2])
    extra = torch.arange(6, dtype=torch.float64).view(3, 2)
    enc = rows.encode_layout(layout)
    assert rows.decode_layouts(enc + enc) == [layout, layout]
    packed = torch.ops.pcppass.sync_pack(FP, [cache], [slots], enc, [slots, extra])
    assert packed.numel() == rows.header_bytes(3) + 3 * 12 + 3 * 8 + 6 * 8
    index = torch.ops.pcppass.sync_read_header(packed, 1, FP, 3, True)
    assert index[0, :, 1].tolist() == [36, 24, 48]
    seg0 = packed[index[0, 0, 0]: index[0, 0, 0] + 36].view(3, 12)
    assert torch.equal(seg0[0], cache[2, 1].view(torch.uint8)) and not seg0[1].any()
    back = torch.ops.pcppass.sync_unpack(packed, index, 2, extra, "unused", False)
    assert torch.equal(back, extra)


def test_header_rejects_a_different_fingerprint():
    packed = torch.ops.pcppass.sync_pack(FP, [], [], [], [torch.arange(4)])
    with pytest.raises(PcpSyncError, match="ranks traced different graphs"):
        torch.ops.pcppass.sync_read_header(packed, 1, "cd" * 32, 1, True)
    with pytest.raises(PcpSyncError, match="no valid pcppass header"):
        torch.ops.pcppass.sync_read_header(torch.zeros_like(packed), 1, FP, 1, True)


def test_two_ranks_writing_one_slot_keep_the_lowest_ranks_row():
    applied, problem = rows._one_writer_per_slot([torch.tensor([6, -1]), torch.tensor([-1, 6])], 16, "site")
    assert "slot 6 was written by ranks [0, 1]" in problem and problem.startswith("site: ")
    assert [a.tolist() for a in applied] == [[True, False], [False, False]]
    applied, problem = rows._one_writer_per_slot([torch.tensor([16, 2])], 16, "site")
    assert "outside" in problem and applied[0].tolist() == [False, True]
    _, problem = rows._one_writer_per_slot([torch.tensor([3, 3, -1]), torch.tensor([4, -1, -1])], 16, "site")
    assert problem is None


def test_resolved_layout_encoding_is_stable():
    layout = ResolvedLayout("block_split", 4, 12, segments=((0, 8, 8), (32, 4, 4)))
    assert rows.encode_layout(layout) == [1, 4, 12, 0, 2, 0, 8, 8, 32, 4, 4]
