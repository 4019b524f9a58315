"""Direct peer stores (pcppass.sync.peer_store) under TRITON_INTERPRET=1, several ranks in one
process: each simulated rank has its own caches and mailbox (CPU tensors); a rank's "peer
addresses" are the other ranks' tensors, so the kernel's stores land there as they would over
NVLink. The barrier runs as on the device except that ranks run one after the other: every rank
runs its stores and barrier (phase 1; a peer's flag is set beforehand where that peer has not run
yet), then every rank its checks (phase 2), as they would after the barrier.

Checked against the reference row primitives (pcppass.sync.rows): after one sync every rank's
replica equals "own rows + every other rank's rows at its slots", bitwise, for every layout kind;
a slot two ranks wrote is zeroed on every replica and reported; an out-of-range slot is dropped
and reported; a header that differs is reported; a peer that never arrives times out (bounded,
reported, raised by device_checks) instead of hanging; re-run payloads read back from the mailbox.
"""

import pytest
import torch

from pcppass.errors import PcpSyncError
from pcppass.sync import peer_store, row_kernels
from pcppass.sync.rows import read_rows
from pcppass.sync import device_checks
from sync_cases import (CAPACITY, ENCODED, FP, LAYOUTS, SITES, assert_replicas, cache_slots, expected_replica,
                        clean_status, interpret, make_ranks)  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("interpret", "clean_status")


class SimReplicas:
    """Rank ``me`` of ``world`` simulated ranks; ``ranks[q]`` holds rank q's caches and mailbox."""

    def __init__(self, me, ranks, limit=200):
        self.me, self.world, self.ranks = me, len(ranks), ranks
        self.capacity = CAPACITY
        self.mailbox = ranks[me]["mailbox"]
        self.counters = ranks[me]["counters"]
        self.mailbox_deltas_host = tuple(r["mailbox"].data_ptr() - self.mailbox.data_ptr() for r in ranks)
        self.mailbox_deltas = torch.tensor(self.mailbox_deltas_host)
        self.limit = limit
        self.agreed = []

    def deltas(self, t):
        (i,) = [k for k, c in enumerate(self.ranks[self.me]["caches"]) if c.data_ptr() == t.data_ptr()]
        return tuple(r["caches"][i].data_ptr() - t.data_ptr() for r in self.ranks)

    def agree(self, what, tensors):
        self.agreed.append(what)


def sync_all(ranks, slots_by_rank, other_by_rank, *, fingerprints=None, checks=True, payload_extra=None):
    """Every rank's sync: stores and barrier (in rank order), then every rank's checks."""
    world = len(ranks)
    results = []
    for phase in (1, 2):
        for r in range(world):
            reps = SimReplicas(r, ranks)
            if phase == 1:  # the peers that run after this rank have "signalled" already
                flags = reps.mailbox[:8 * world].view(torch.int64)
                epoch = int(reps.counters[0]) + 1
                for q in range(r + 1, world):
                    flags[q] = epoch
            slots, other = slots_by_rank[r], other_by_rank[r]
            payloads = [slots, other] + ([payload_extra[r]] if payload_extra else [])
            out = peer_store.store((fingerprints or [FP] * world)[r], ranks[r]["caches"],
                                   cache_slots(slots, other), ENCODED, payloads, [4, 4, 4, 5], SITES,
                                   checks, checks, payload_extra is not None, reps, phase=phase)

            if phase == 1:
                results.append(out)
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_peer_stores_give_every_rank_the_reference_rows(world):
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 5, -1, 22]), torch.tensor([1, 2, 13, -1])][:world]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2]), torch.tensor([4, 3, 14, 19])][:world]
    ranks = make_ranks(world, slots, other)
    expected = expected_replica(ranks, slots, other, 0)
    assert not torch.equal(expected[3], ranks[0]["caches"][3])  # the peers' rows do move
    sync_all(ranks, slots, other)
    assert_replicas(ranks, expected)
    device_checks.raise_pending("cpu")  # nothing recorded
    assert all(int(r["counters"][0]) == 1 and int(r["counters"][1]) == 0 for r in ranks)
    # a second sync (the other mailbox half) with new rows: still every replica equal
    slots2 = [s.flip(0) for s in slots]
    ranks2 = make_ranks(world, slots2, other)
    for r in range(world):
        for cache, fresh in zip(ranks[r]["caches"], ranks2[r]["caches"]):
            cache.copy_(fresh)
        ranks2[r]["mailbox"], ranks2[r]["counters"] = ranks[r]["mailbox"], ranks[r]["counters"]
    expected = expected_replica(ranks, slots2, other, 0)
    sync_all(ranks, slots2, other)
    assert_replicas(ranks, expected)
    assert all(int(r["counters"][0]) == 2 for r in ranks)


def test_a_peer_with_new_replicas_gets_the_rows_not_its_old_addresses():
    """Rank 0 keeps its caches and mailbox (same addresses, so the same launch-table key as far as
    this rank's own tensors go); rank 1 comes back with new ones. The stores must land in rank 1's
    new replicas: a table reused from the first sync would store into its old ones."""
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 5, -1, 22])]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    first = make_ranks(2, slots, other)
    sync_all(first, slots, other)
    fresh = make_ranks(2, slots, other)
    for mine, new in zip(first[0]["caches"], fresh[0]["caches"]):
        mine.copy_(new)  # rank 0: its old tensors, new contents
    first[0]["mailbox"].zero_()
    first[0]["counters"].zero_()
    ranks = [first[0], fresh[1]]  # rank 1: new tensors, while its old ones stay alive
    old_rank1 = [c.clone() for c in first[1]["caches"]]
    sync_all(ranks, slots, other)
    assert_replicas(ranks[1:], expected_replica(ranks, slots, other, 1))
    assert all(torch.equal(a, b) for a, b in zip(first[1]["caches"], old_rank1))


def test_slot_written_by_two_ranks_is_zeroed_on_every_replica_and_reported():
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 9, -1, 22])]  # slot 9: both ranks
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    ranks = make_ranks(2, slots, other)
    sync_all(ranks, slots, other)
    for i in range(3):  # the caches addressed by the conflicting slot segment
        rows = [read_rows(r["caches"][i], torch.tensor([9]), LAYOUTS[i]) for r in ranks]
        assert torch.equal(rows[0], rows[1]) and not rows[0].any()
    for i, lay in enumerate(LAYOUTS):
        assert torch.equal(ranks[0]["caches"][i].view(torch.uint8), ranks[1]["caches"][i].view(torch.uint8)), lay
    with pytest.raises(PcpSyncError, match="slot 9 was written by rank .* and another rank"):
        device_checks.raise_pending("cpu")


def test_out_of_range_slot_is_dropped_and_reported():
    slots = [torch.tensor([3, -1, 9, 1000]), torch.tensor([17, 5, -1, 22])]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    ranks = make_ranks(2, slots, other)
    sync_all(ranks, slots, other)
    for i, lay in enumerate(LAYOUTS):
        assert torch.equal(ranks[0]["caches"][i].view(torch.uint8), ranks[1]["caches"][i].view(torch.uint8)), lay
    with pytest.raises(PcpSyncError, match=r"site\d writing cache\d: rank 0 wrote slot 1000, outside the cache"):
        device_checks.raise_pending("cpu")


def test_header_that_differs_is_reported():
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 5, -1, 22])]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    ranks = make_ranks(2, slots, other)
    sync_all(ranks, slots, other, fingerprints=[FP, "ff" * 16])
    with pytest.raises(PcpSyncError, match="sync header differs"):
        device_checks.raise_pending("cpu")


def test_barrier_times_out_instead_of_hanging():
    """Rank 0 syncs alone: its peer never raises its flag. The wait is bounded (200 spins under
    the interpreter, ``timeout_s`` on the device), recorded, and raised on the host."""
    slots, other = [torch.tensor([3, -1, 9, 0])] * 2, [torch.tensor([11, 1, -1, 7])] * 2
    ranks = make_ranks(2, slots, other)
    peer_store.store(FP, ranks[0]["caches"], cache_slots(slots[0], other[0]), ENCODED, [slots[0], other[0]],
                     [4, 4, 4, 5], SITES, True, True, False, SimReplicas(0, ranks, limit=200))
    assert int(ranks[0]["counters"][0]) == 1  # the epoch advanced: the next sync waits for #2
    with pytest.raises(PcpSyncError, match="rank 1 did not reach peer-store sync #1 in time"):
        device_checks.raise_pending("cpu")
    device_checks.raise_pending("cpu")  # reported once


def test_rerun_payloads_come_back_from_the_mailbox():
    slots = [torch.tensor([3, -1, 9, 0]), torch.tensor([17, 5, -1, 22])]
    other = [torch.tensor([11, 1, -1, 7]), torch.tensor([-1, -1, 20, 2])]
    extra = [torch.arange(8, dtype=torch.float32).view(4, 2) + 10 * r for r in range(2)]
    ranks = make_ranks(2, slots, other)
    chunks = sync_all(ranks, slots, other, payload_extra=extra)
    nseg = len(LAYOUTS) + 3
    sizes = peer_store.mailbox_sizes(len(LAYOUTS), [slots[0], other[0], extra[0]])
    head = 32 + 8 * nseg
    chunk = head + sum(sizes)
    assert chunks[1].numel() == 2 * chunk  # what the op returns (rank 1 ran last: both chunks are in)
    for r in range(2):  # what every rank reads once both ran
        every = peer_store.every_chunk(SimReplicas(r, ranks), chunk)
        assert torch.equal(every, chunks[1]) if r == 1 else every.numel() == 2 * chunk
        for q in range(2):
            got = every[q * chunk + head + 64:q * chunk + chunk].view(torch.float32).view(4, 2)
            assert torch.equal(got, extra[q])
