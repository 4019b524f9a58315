"""Checks of the all-gather transport done on the device (pcppass.kernels.rows_cuda with
TRITON_INTERPRET=1 on CPU tensors): no host read, errors recorded in the device status and raised
by pcppass.runtime.device_checks, replicas identical after every error.

Two ranks are simulated in one process: both pack (the bytes the all-gather would carry), the
buffers are concatenated as the all-gather would, and each rank's scatter runs as that rank
(``_group_rank`` answers the simulated rank). Also: slot-mapping inputs checked on the device, and
the wrapper that raises an earlier step's error before the next step runs.
"""

import pytest
import torch

from pcppass.errors import PcpInputError, PcpSyncError
from pcppass.kernels import rows_cuda
from pcppass.kernels.rows import read_rows
from pcppass.runtime import device_checks
from sync_cases import (ENCODED, FP, LAYOUTS, SITES, assert_replicas, cache_slots, expected_replica,
                        clean_status, group_name, interpret, make_ranks)  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("interpret", "clean_status")


def all_gather_sync(ranks, slots, other, group_name, monkeypatch, *, fingerprints=(FP, FP)):
    packed = [rows_cuda.pack_batched(fingerprints[r], ranks[r]["caches"], cache_slots(slots[r], other[r]), ENCODED,
                                     [slots[r], other[r]]) for r in range(2)]
    gathered = torch.cat(packed)
    n = len(LAYOUTS)
    index = rows_cuda.read_header(gathered, 2, FP, n + 2, True)
    for r in range(2):
        monkeypatch.setattr(rows_cuda, "_group_rank", lambda _group, r=r: r)
        rows_cuda.scatter_rows_all(ranks[r]["caches"], gathered, index, list(range(n)), [n, n, n, n + 1], ENCODED,
                                   group_name, SITES, True)

    return gathered, index


def test_checked_scatter_applies_every_rank_rows(group_name, monkeypatch):
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 5, -1, 22])]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    ranks = make_ranks(2, slots, other)
    expected = expected_replica(ranks, slots, other, 0)
    all_gather_sync(ranks, slots, other, group_name, monkeypatch)
    assert_replicas(ranks, expected)
    device_checks.raise_pending("cpu")


def test_conflicting_slot_is_zeroed_on_every_replica(group_name, monkeypatch):
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 9, -1, 22])]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    ranks = make_ranks(2, slots, other)
    all_gather_sync(ranks, slots, other, group_name, monkeypatch)
    for i in range(3):
        rows = [read_rows(r["caches"][i], torch.tensor([9]), LAYOUTS[i]) for r in ranks]
        assert not rows[0].any() and not rows[1].any()
    for i, lay in enumerate(LAYOUTS):
        assert torch.equal(ranks[0]["caches"][i].view(torch.uint8), ranks[1]["caches"][i].view(torch.uint8)), lay
    with pytest.raises(PcpSyncError, match=r"site\d writing cache\d: slot 9 was written by rank"):
        device_checks.raise_pending("cpu")


def test_headers_that_differ_apply_nothing(group_name, monkeypatch):
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 5, -1, 22])]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    ranks = make_ranks(2, slots, other)
    before = [[c.clone() for c in r["caches"]] for r in ranks]
    gathered, index = all_gather_sync(ranks, slots, other, group_name, monkeypatch, fingerprints=(FP, "ee" * 16))
    for r in range(2):
        for got, want in zip(ranks[r]["caches"], before[r]):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(PcpSyncError, match=r"rank \d's sync header differs"):
        device_checks.raise_pending("cpu")
    # a re-run's slots read from that buffer are -1 for every rank: the re-run writes nothing
    monkeypatch.setattr(rows_cuda, "_group_rank", lambda _group: 0)
    every = rows_cuda.unpack(gathered, index, len(LAYOUTS), slots[0], group_name, True)
    assert torch.equal(every, torch.full((8,), -1))
    device_checks.status("cpu").zero_()


def test_remote_slot_out_of_range_is_dropped(group_name, monkeypatch):
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 5, -1, 5000])]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    ranks = make_ranks(2, slots, other)
    all_gather_sync(ranks, slots, other, group_name, monkeypatch)
    for i, lay in enumerate(LAYOUTS):
        assert torch.equal(ranks[0]["caches"][i].view(torch.uint8), ranks[1]["caches"][i].view(torch.uint8)), lay
    with pytest.raises(PcpSyncError, match="wrote slot 5000, outside the cache"):
        device_checks.raise_pending("cpu")


def test_slot_inputs_checked_on_the_device_and_raised_before_the_next_step():
    checks = device_checks.DeviceSlotChecks(
        [device_checks.SlotRange(0, "op writing k_cache: slot mapping slots", -1, 24, rows=4),
         device_checks.SlotRange(1, "aten index_copy_ writing buf: slot mapping idx", 0, 8)],
        lambda expr, args: expr)
    calls = []
    step = device_checks.checking(lambda *args: calls.append(args), "cpu", checks)
    step(torch.tensor([3, -1, 9, 0]), torch.tensor([1, 7]))
    step(torch.tensor([3, -1, 24, 0]), torch.tensor([1, 7]))  # recorded on the device, raised next call
    with pytest.raises(PcpInputError, match="slot mapping slots holds slot 24"):
        step(torch.tensor([3, -1, 9, 0]), torch.tensor([1, 7]))
    assert len(calls) == 2
    step(torch.tensor([3, -1, 9, 0]), torch.tensor([-1, 7]))  # an aten write: -1 is the last row
    with pytest.raises(PcpInputError, match="slot mapping idx holds slot -1"):
        device_checks.raise_pending("cpu")
    with pytest.raises(PcpInputError, match="must be an int64 tensor, got torch.int32"):
        step(torch.tensor([3, -1, 9, 0], dtype=torch.int32), torch.tensor([1, 7]))
    with pytest.raises(PcpInputError, match="has 3 slots for 4 rows"):
        step(torch.tensor([3, -1, 9]), torch.tensor([1, 7]))
