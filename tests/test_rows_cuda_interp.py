"""The host-sync-free sync kernels (pcppass.sync.rows_cuda) give the reference ops' bytes.

The kernels are plain torch, so they run on CPU tensors here and are compared byte for byte with
the reference ops (which the CPU dispatch still runs). Two ranks' packed buffers are built in one
process and concatenated as the all-gather would; the scatter runs as rank 0 of a one-rank gloo
group, so rank 1's rows are the remote ones.
"""


import pytest
import torch

from pcppass.sync import rows_cuda
from pcppass.sync.rows import encode_layout
from pcppass.spec import ResolvedLayout
from sync_cases import group_name  # noqa: F401  (a fixture)

OPS = torch.ops.pcppass
FP = "0123456789abcdef0123456789abcdef"
BS = 4
NB = 6

PAGED = ResolvedLayout("paged_rows", BS, 2 * 3 * 2)  # bf16 [nb, bs, 2, 3]
SPLIT = ResolvedLayout("block_split", BS, 8 + 4, segments=((0, 8, 8), (BS * 8, 4, 4)))  # uint8 [nb, bs*12]
INDEXED = ResolvedLayout("indexed_dim", 1, 2 * 5 * 4, dim=1)  # fp32 [2, nb*bs, 5]


def caches(seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(NB, BS, 2, 3, generator=g).to(torch.bfloat16),
        torch.randint(0, 256, (NB, BS * 12), generator=g, dtype=torch.uint8),
        torch.randn(2, NB * BS, 5, generator=g),
    ]


LAYOUTS = [PAGED, SPLIT, INDEXED]
ENCODED = [x for lay in LAYOUTS for x in encode_layout(lay)]


def pack_both(fn, slots_by_rank, payload_by_rank):
    packed = []
    for rank, slots in enumerate(slots_by_rank):
        cs = caches(10 + rank)
        packed.append(fn(FP, cs, [slots] * 3, ENCODED, [slots, payload_by_rank[rank]]))
    return packed


SLOT_CASES = {
    "mixed": ([torch.tensor([3, -1, 9, 0]), torch.tensor([-1, 17, 5, 22])]),
    "remote_all_padding": ([torch.tensor([3, 1, 9, 0]), torch.tensor([-1, -1, -1, -1])]),
}


@pytest.mark.parametrize("case", sorted(SLOT_CASES))
def test_pack_header_scatter_unpack_match_reference(group_name, case):
    slots = SLOT_CASES[case]
    payloads = [torch.arange(8, dtype=torch.float32).view(4, 2) + r for r in range(2)]
    reference = pack_both(OPS.sync_pack, slots, payloads)
    mine = pack_both(rows_cuda.pack, slots, payloads)
    for a, b in zip(reference, mine):
        assert torch.equal(a, b)
    gathered = torch.cat(mine)
    nseg = 3 + 2
    ref_index = OPS.sync_read_header(gathered, 2, FP, nseg, True)
    cached_index = rows_cuda.read_header(gathered, 2, FP, nseg, False)
    device_index = rows_cuda._device_table(gathered, 2, gathered.numel() // 2, nseg)
    assert torch.equal(ref_index, cached_index) and torch.equal(ref_index, device_index)
    assert rows_cuda._INDEX_HOST[cached_index.data_ptr()] == ref_index.tolist()

    for i, lay in enumerate(LAYOUTS):
        expected, got = caches(0)[i], caches(0)[i]
        OPS.sync_scatter_rows(expected, gathered, ref_index, i, 3, encode_layout(lay), group_name, "s", False)
        rows_cuda.scatter_rows(got, gathered, cached_index, i, 3, encode_layout(lay), group_name, "s", False)
        assert torch.equal(expected.view(torch.uint8), got.view(torch.uint8)), lay.kind
        if case == "mixed":  # the remote rank's real rows did land
            assert not torch.equal(got.view(torch.uint8), caches(0)[i].view(torch.uint8))
    for seg, like, mask in ((3, slots[0], True), (4, payloads[0], False)):
        assert torch.equal(OPS.sync_unpack(gathered, ref_index, seg, like, group_name, mask),
                           rows_cuda.unpack(gathered, cached_index, seg, like, group_name, mask))
