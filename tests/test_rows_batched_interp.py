"""The one-launch sync kernels (Triton, pcppass.sync.row_kernels) give the reference ops' bytes.

The kernels run on CPU tensors under ``TRITON_INTERPRET=1`` and are compared byte for byte with the
reference ops: ``sync_pack`` over caches of every layout kind (several caches sharing one slot
tensor, others with their own), then ``sync_scatter_rows_all`` of two ranks' packed buffers as rank 0
of a one-rank gloo group (rank 1's rows are the remote ones), against the per-cache reference op.
Also: the device tables are built once per configuration and reused; a cache the kernels cannot
address (non-contiguous rows) falls back to the plain-torch path with the same bytes.
"""

import pytest
import torch

from pcppass.sync import row_kernels, rows_cuda
from pcppass.sync.rows import encode_layout
from pcppass.spec import ResolvedLayout
from sync_cases import group_name, interpret  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("interpret")

OPS = torch.ops.pcppass
FP = "fedcba9876543210fedcba9876543210"
BS, NB = 4, 6

PAGED = ResolvedLayout("paged_rows", BS, 2 * 3 * 2)  # bf16 [nb, bs, 2, 3]
SPLIT = ResolvedLayout("block_split", BS, 8 + 4, segments=((0, 8, 8), (BS * 8, 4, 4)))  # uint8 [nb, bs*12]
INDEXED = ResolvedLayout("indexed_dim", 1, 2 * 5 * 4, dim=1)  # fp32 [2, nb*bs, 5]
MLA = ResolvedLayout("paged_rows", BS, 20)  # uint8 [nb, bs, 20], odd row bytes: unaligned segments
LAYOUTS = [PAGED, SPLIT, INDEXED, MLA, SPLIT]
ENCODED = [x for lay in LAYOUTS for x in encode_layout(lay)]


def caches(seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(NB, BS, 2, 3, generator=g).to(torch.bfloat16),
        torch.randint(0, 256, (NB, BS * 12), generator=g, dtype=torch.uint8),
        torch.randn(2, NB * BS, 5, generator=g),
        torch.randint(0, 256, (NB, BS, 20), generator=g, dtype=torch.uint8),
        torch.randint(0, 256, (NB, BS, 12), generator=g, dtype=torch.uint8),  # block-split, 3-d
    ]


def cache_slots(slots, other):
    # caches 0-2 share one slot tensor, 3-4 another (as a model's two cache groups do)
    return [slots, slots, slots, other, other]


CASES = {
    "mixed": ([torch.tensor([3, -1, 9, 0, 14]), torch.tensor([-1, 17, 5, 22, 2])],
              [torch.tensor([1, 2, -1, 7, 4]), torch.tensor([11, -1, 13, 18, 20])]),
    "remote_all_padding": ([torch.tensor([3, 1, 9, 0, 6]), torch.tensor([-1, -1, -1, -1, -1])],
                           [torch.tensor([1, 2, 5, 7, 4]), torch.tensor([-1, -1, -1, -1, -1])]),
}


def pack_both(fn, case):
    slots, other = CASES[case]
    out = []
    for rank in range(2):
        payloads = [slots[rank], other[rank], torch.arange(6, dtype=torch.float32).view(3, 2) + rank]
        out.append(fn(FP, caches(10 + rank), cache_slots(slots[rank], other[rank]), ENCODED, payloads))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_pack_and_scatter_match_reference(group_name, case):
    reference = pack_both(OPS.sync_pack, case)
    mine = pack_both(rows_cuda.pack_batched, case)
    for a, b in zip(reference, mine):
        assert torch.equal(a, b)
    gathered = torch.cat(mine)
    n = len(LAYOUTS)
    nseg = n + 3
    index = rows_cuda.read_header(gathered, 2, FP, nseg, False)
    slots_segments = [n, n, n, n + 1, n + 1]
    sites = [f"site{i}" for i in range(n)]
    joined = "\n".join(sites)

    expected = caches(0)
    for i, lay in enumerate(LAYOUTS):
        OPS.sync_scatter_rows(expected[i], gathered, index, i, slots_segments[i], encode_layout(lay),
                              group_name, sites[i], False)

    row_kernels._TABLES.clear()
    for fn in (OPS.sync_scatter_rows_all, rows_cuda.scatter_rows_all):
        got = caches(0)
        fn(got, gathered, index, list(range(n)), slots_segments, ENCODED, group_name, joined, False)
        for i in range(n):
            assert torch.equal(expected[i].view(torch.uint8), got[i].view(torch.uint8)), (fn, LAYOUTS[i])
            if case == "mixed":  # the remote rank's real rows did land
                assert not torch.equal(got[i].view(torch.uint8), caches(0)[i].view(torch.uint8))
    assert [key[0] for key in row_kernels._TABLES] == ["scatter"]  # one kernel table: no fallback


def test_tables_built_once_and_unaddressable_caches_fall_back(group_name):
    slots = torch.tensor([3, -1, 9, 0, 14])
    cs = caches(3)
    encoded = encode_layout(PAGED)
    rows_cuda.pack_batched(FP, cs[:1], [slots], encoded, [slots])
    tables = len(row_kernels._TABLES)
    again = rows_cuda.pack_batched(FP, cs[:1], [slots], encoded, [slots])
    assert len(row_kernels._TABLES) == tables
    # rows not contiguous in memory: [nb, bs, 3, 2] viewed as [nb, bs, 2, 3] transposed
    strided = cs[0].transpose(2, 3).contiguous().transpose(2, 3)
    assert row_kernels.addressing(strided, PAGED) is None
    fallback = rows_cuda.pack_batched(FP, [strided], [slots], encoded, [slots])
    assert torch.equal(fallback, again) and torch.equal(fallback, OPS.sync_pack(FP, [strided], [slots], encoded, [slots]))
