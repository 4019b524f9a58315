"""Both sync transports on 2 GPUs (skipped without them): captured in CUDA graphs and replayed.

* peer stores and the checked all-gather, each captured once and replayed with fresh rows in
  every rank's own slots: every cache bitwise equal on both ranks after every replay, and the two
  transports leave the same bytes;
* a slot both ranks write: zeroed on both replicas, reported by the device status;
* a rank that never reaches the barrier: its peer's wait times out (bounded) and raises.
"""

import hashlib

import pytest
import torch
import torch.distributed as dist

from pcppass.engine.launch import launch
from pcppass.runtime.collectives import all_gather_single

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

FP = "ab" * 16
BS, NB = 16, 40


def _setup(rank):
    import pcppass.sync.peer_store  # noqa: F401
    import pcppass.sync.rows_cuda  # noqa: F401
    from pcppass.sync.rows import encode_layout
    from pcppass.sync.peer import symmetric_empty
    from pcppass.spec import ResolvedLayout

    layouts = [ResolvedLayout("paged_rows", BS, 656),
               ResolvedLayout("block_split", BS, 132, segments=((0, 128, 128), (BS * 128, 4, 4)))]
    caches = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(3):
        for shape in ((NB, BS, 656), (NB, BS * 132)):
            c = symmetric_empty(shape, torch.uint8, "cuda")
            c.copy_(torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=gen))
            caches.append(c)
    encoded = [x for _ in range(3) for lay in layouts for x in encode_layout(lay)]
    return caches, [layouts[i % 2] for i in range(6)], encoded


def _fresh_rows(caches, layouts, slots, seed, rank):
    from pcppass.sync.rows import write_rows

    own = slots[slots >= 0]
    gen = torch.Generator(device="cuda").manual_seed(seed * 10 + rank)
    for cache, lay in zip(caches, layouts):
        write_rows(cache, own, torch.randint(0, 256, (own.numel(), lay.bytes_per_row), dtype=torch.uint8,
                                             device="cuda", generator=gen), lay)


def _equal_across_ranks(caches):
    ok = True
    for c in caches:
        theirs = c.clone()
        dist.broadcast(theirs, 0)
        ok &= torch.equal(theirs, c)
    flag = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _digest(caches):
    return hashlib.sha256(b"".join(c.cpu().numpy().tobytes() for c in caches)).hexdigest()


def _replays(rank, world):
    from pcppass.sync import device_checks

    caches, layouts, encoded = _setup(rank)
    ops, group = torch.ops.pcppass, dist.group.WORLD.group_name
    slots = torch.tensor([5 + 100 * rank, 17 + 100 * rank, -1, 250 + 100 * rank], device="cuda")
    idx_slots = slots.flip(0).clone()
    cache_slots = [slots if i % 2 == 0 else idx_slots for i in range(6)]
    sites = "\n".join(f"site {i}" for i in range(6))
    segments = [6 + i % 2 for i in range(6)]

    def peer():
        ops.sync_peer_store(FP, caches, cache_slots, encoded, [slots, idx_slots], segments, group, sites,
                            True, True, False)

    def allgather():
        packed = ops.sync_pack(FP, caches, cache_slots, encoded, [slots, idx_slots])
        gathered = packed.new_empty(packed.numel() * world)
        all_gather_single(gathered, packed)
        index = ops.sync_read_header(gathered, world, FP, 8, True)
        ops.sync_scatter_rows_all(caches, gathered, index, list(range(6)), segments, encoded, group, sites, True)

    out = {}
    for name, fn in (("peer", peer), ("allgather", allgather)):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        digests = []
        for seed in range(1, 4):
            _fresh_rows(caches, layouts, slots, seed, rank)
            assert not _equal_across_ranks(caches)
            graph.replay()
            torch.cuda.synchronize()
            assert _equal_across_ranks(caches), (name, seed)
            device_checks.raise_pending("cuda")
            digests.append(_digest(caches))
        out[name] = digests
    return out


def test_transports_replay_from_cuda_graphs_and_agree():
    results = launch(_replays, 2, backend="nccl", timeout_s=300)
    assert results[0]["peer"] == results[0]["allgather"] == results[1]["peer"]


def _conflict_and_timeout(rank, world):
    from pcppass.sync.rows import read_rows
    from pcppass.sync import device_checks, peer

    caches, layouts, encoded = _setup(rank)
    ops, group = torch.ops.pcppass, dist.group.WORLD.group_name
    slots = torch.tensor([5 + 100 * rank, 77, -1], device="cuda")  # slot 77: both ranks
    cache_slots = [slots] * 6
    sites = "\n".join(f"site {i}" for i in range(6))
    _fresh_rows(caches, layouts, slots, 1, rank)
    ops.sync_peer_store(FP, caches, cache_slots, encoded, [slots], [6] * 6, group, sites, True, True, False)
    torch.cuda.synchronize()
    assert _equal_across_ranks(caches)
    assert all(not read_rows(c, torch.tensor([77], device="cuda"), lay).any() for c, lay in zip(caches, layouts))
    with pytest.raises(Exception, match="slot 77 was written by rank"):
        device_checks.raise_pending("cuda")
    # rank 1 skips the next sync: rank 0's barrier gives up after its timeout and says so
    peer.replicas(group, torch.device("cuda", torch.cuda.current_device())).timeout_s = 0.5
    dist.barrier()
    if rank == 0:
        ops.sync_peer_store(FP, caches, cache_slots, encoded, [slots], [6] * 6, group, sites, True, False, False)
        with pytest.raises(Exception, match="rank 1 did not reach peer-store sync #2 in time"):
            device_checks.synchronize_and_raise("cuda")
    return True


def test_conflicts_zeroed_and_barrier_times_out_on_gpus():
    assert launch(_conflict_and_timeout, 2, backend="nccl", timeout_s=300) == [True, True]
