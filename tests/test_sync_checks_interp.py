"""Checks of the all-gather transport done on the device (pcppass.sync.rows_cuda with
TRITON_INTERPRET=1 on CPU tensors): no host read, errors recorded in the device status and raised
by pcppass.sync.device_checks, replicas identical after every error.

Two ranks are simulated in one process: both pack (the bytes the all-gather would carry), the
buffers are concatenated as the all-gather would, and each rank's scatter runs as that rank
(``_group_rank`` answers the simulated rank). Also: slot-mapping inputs checked on the device, and
the wrapper that raises an earlier step's error before the next step runs.
"""

import pytest
import torch

from pcppass.errors import PcpInputError, PcpSyncError
from pcppass.sync import rows_cuda
from pcppass.sync.rows import encode_layout
from pcppass.sync import device_checks, input_checks
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


def verdict_sync(slots, other, group_name, monkeypatch, *, entries=None):
    """The deferred protocol on two simulated ranks: snapshot before the rank's own writes, pack,
    all-gather, verdict (device checks, write-back on a refusal), scatter with the verdict.
    ``entries``: (cache, slot segment) pairs the verdict checks (default: cache i with its own)."""
    n = len(LAYOUTS)
    before = make_ranks(2, [torch.tensor([-1] * 4)] * 2, [torch.tensor([-1] * 4)] * 2)  # nothing written yet
    snaps = [rows_cuda.snapshot_batched(before[r]["caches"], cache_slots(slots[r], other[r]), ENCODED)
             for r in range(2)]
    ranks = make_ranks(2, slots, other)
    packed = [rows_cuda.pack_batched(FP, ranks[r]["caches"], cache_slots(slots[r], other[r]), ENCODED,
                                     [slots[r], other[r]]) for r in range(2)]
    gathered = torch.cat(packed)
    index = rows_cuda.read_header(gathered, 2, FP, n + 2, False)
    entries = entries or [(i, seg) for i, seg in enumerate([n, n, n, n + 1])]
    layouts = [x for c, _ in entries for x in encode_layout(LAYOUTS[c])]
    labels = "\n".join(f"site{c} writing cache{c}" for c, _ in entries)
    decisions = []
    for r in range(2):
        monkeypatch.setattr(rows_cuda, "_group_rank", lambda _group, r=r: r)
        decision = rows_cuda.verdict(ranks[r]["caches"], gathered, index, 2, FP, n + 2, True, [c for c, _ in entries],
                                     [seg for _, seg in entries], layouts, labels, True, [snaps[r]],
                                     cache_slots(slots[r], other[r]), list(range(n)), ENCODED, [n], group_name)
        decisions.append(int(decision[0]))
        rows_cuda.scatter_rows_all(ranks[r]["caches"], gathered, index, list(range(n)), [n, n, n, n + 1], ENCODED,
                                   group_name, SITES, True, decision)
    return ranks, before, decisions


def assert_as_before(ranks, before):
    for r in range(2):
        for i, lay in enumerate(LAYOUTS):
            got, want = ranks[r]["caches"][i].view(torch.uint8), before[r]["caches"][i].view(torch.uint8)
            assert torch.equal(got, want), (r, lay)


def test_verdict_lets_a_good_step_stand(group_name, monkeypatch):
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 5, -1, 22])]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    ranks, _, decisions = verdict_sync(slots, other, group_name, monkeypatch)
    assert decisions == [0, 0]
    expected = expected_replica(make_ranks(2, slots, other), slots, other, 0)
    assert_replicas(ranks, expected)
    device_checks.raise_pending("cpu")


def test_conflicting_slot_leaves_every_replica_as_before_the_step(group_name, monkeypatch):
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 9, -1, 22])]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    ranks, before, decisions = verdict_sync(slots, other, group_name, monkeypatch)
    assert decisions == [1, 1]
    assert_as_before(ranks, before)
    with pytest.raises(PcpSyncError, match=r"site\d writing cache\d: slot 9 was written by rank"):
        device_checks.raise_pending("cpu")


def test_one_cache_written_by_two_sites_is_one_cache(group_name, monkeypatch):
    """Rank 0 writes slot 1 of cache 0 at one site, rank 1 at another (its other slot mapping):
    two owners of one row, although no segment holds slot 1 twice."""
    n = len(LAYOUTS)
    slots = [torch.tensor([1, -1, 9, 0]), torch.tensor([17, 5, -1, 22])]
    other = [torch.tensor([11, 3, -1, 7]), torch.tensor([-1, 1, 20, 2])]
    entries = [(0, n), (0, n + 1), (1, n), (2, n), (3, n + 1)]
    ranks, before, decisions = verdict_sync(slots, other, group_name, monkeypatch, entries=entries)
    assert decisions == [1, 1]
    assert_as_before(ranks, before)
    with pytest.raises(PcpSyncError, match="slot 1 was written by rank"):
        device_checks.raise_pending("cpu")


def test_conflict_without_a_verdict_applies_nothing(group_name, monkeypatch):
    """The scatter op called without a verdict checks its own slots: a conflict applies nothing
    (each rank keeps its own rows: only a verdict with a snapshot can restore them)."""
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 9, -1, 22])]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    ranks = make_ranks(2, slots, other)
    written = [[c.clone() for c in r["caches"]] for r in ranks]
    all_gather_sync(ranks, slots, other, group_name, monkeypatch)
    for r in range(2):
        for got, want in zip(ranks[r]["caches"], written[r]):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
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


def test_remote_slot_out_of_range_refuses_the_step(group_name, monkeypatch):
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 5, -1, 5000])]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    ranks, before, decisions = verdict_sync(slots, other, group_name, monkeypatch)
    assert decisions == [1, 1]
    assert_as_before(ranks, before)
    with pytest.raises(PcpSyncError, match="wrote slot 5000, outside the cache"):
        device_checks.raise_pending("cpu")


def test_slot_inputs_checked_on_the_device_and_raised_before_the_next_step():
    checks = input_checks.DeviceSlotChecks(
        [input_checks.SlotRange(0, "op writing k_cache: slot mapping slots", -1, 24, rows=4),
         input_checks.SlotRange(1, "aten index_copy_ writing buf: slot mapping idx", 0, 8)],
        lambda expr, args: expr)
    calls = []
    step = input_checks.checking(lambda *args: calls.append(args), "cpu", checks)
    step(torch.tensor([3, -1, 9, 0]), torch.tensor([1, 7]))
    step(torch.tensor([3, -1, 24, 0]), torch.tensor([1, 7]))  # recorded on the device, raised next call
    with pytest.raises(PcpInputError, match="slot mapping slots holds slot 24"):
        step(torch.tensor([3, -1, 9, 0]), torch.tensor([1, 7]))
    assert len(calls) == 2
    step(torch.tensor([3, -1, 9, 0]), torch.tensor([-1, 7]))  # an aten write: -1 is the last row
    with pytest.raises(PcpInputError, match="slot mapping idx holds slot -1"):
        device_checks.raise_pending("cpu")
    for dtype in (torch.int32, torch.int16, torch.int8):  # any integer width, read as it is
        step(torch.tensor([3, -1, 9, 0], dtype=dtype), torch.tensor([1, 7], dtype=dtype))
        device_checks.raise_pending("cpu")
    step(torch.tensor([3, 23, 9, 0], dtype=torch.uint8), torch.tensor([1, 7], dtype=torch.uint8))
    device_checks.raise_pending("cpu")
    step(torch.tensor([3, -1, 9, 0], dtype=torch.int32), torch.tensor([1, 8], dtype=torch.int32))
    with pytest.raises(PcpInputError, match="slot mapping idx holds slot 8"):
        device_checks.raise_pending("cpu")
    with pytest.raises(PcpInputError, match="must be an integer tensor .*, got torch.float32"):
        step(torch.tensor([3, -1, 9, 0], dtype=torch.float32), torch.tensor([1, 7]))
    with pytest.raises(PcpInputError, match="has 3 slots for 4 rows"):
        step(torch.tensor([3, -1, 9]), torch.tensor([1, 7]))
