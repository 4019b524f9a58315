"""Shared cases of the sync-kernel tests: caches of every layout kind, ranks simulated in one
process (each with its own replicas and mailbox), the reference result of one sync, and the
fixtures (``interpret``: Triton's interpreter on for the module; ``group_name``: a one-rank gloo
group, whose rank the scatter ops ask for; ``clean_status``: an empty device status)."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from pcppass.engine.launch import free_port
from pcppass.sync import row_kernels
from pcppass.sync.rows import encode_layout, read_rows, write_rows
from pcppass.sync import device_checks
from pcppass.spec import ResolvedLayout



@pytest.fixture(scope="module")
def interpret():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old


@pytest.fixture
def clean_status():
    """The CPU device status is empty before and after the test (errors it expects are raised)."""
    device_checks.status("cpu").zero_()
    yield
    device_checks.status("cpu").zero_()


@pytest.fixture(scope="module")
def group_name():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


FP = "0123456789abcdef0123456789abcdef"
BS, NB, CAPACITY = 4, 6, 512
PAGED = ResolvedLayout("paged_rows", BS, 2 * 3 * 2)  # bf16 [nb, bs, 2, 3]
SPLIT = ResolvedLayout("block_split", BS, 8 + 4, segments=((0, 8, 8), (BS * 8, 4, 4)))  # uint8 [nb, bs*12]
INDEXED = ResolvedLayout("indexed_dim", 1, 2 * 5 * 4, dim=1)  # fp32 [2, nb*bs, 5]
MLA = ResolvedLayout("paged_rows", BS, 656)  # uint8 [nb, bs, 656]: 16-byte words
LAYOUTS = [PAGED, SPLIT, INDEXED, MLA]
ENCODED = [x for lay in LAYOUTS for x in encode_layout(lay)]
SITES = "\n".join(f"site{i} writing cache{i}" for i in range(len(LAYOUTS)))


def caches(seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(NB, BS, 2, 3, generator=g).to(torch.bfloat16),
        torch.randint(0, 256, (NB, BS * 12), generator=g, dtype=torch.uint8),
        torch.randn(2, NB * BS, 5, generator=g),
        torch.randint(0, 256, (NB, BS, 656), generator=g, dtype=torch.uint8),
    ]


def make_ranks(world, slots_by_rank, other_by_rank):
    """Replicas start identical (seed 0); each rank then writes its own rows (seeded by rank)."""
    ranks = []
    for r in range(world):
        cs = caches(0)
        for cache, lay, slots in zip(cs, LAYOUTS, cache_slots(slots_by_rank[r], other_by_rank[r])):
            live = slots[slots >= 0]
            live = live[live < row_kernels.addressing(cache, lay).num_slots]
            g = torch.Generator().manual_seed(100 + r)
            write_rows(cache, live, torch.randint(0, 256, (live.numel(), lay.bytes_per_row), generator=g,
                                                  dtype=torch.uint8), lay)
        ranks.append({"caches": cs, "mailbox": torch.zeros(row_kernels.MAILBOX_FLAGS + 2 * world * CAPACITY,
                                                           dtype=torch.uint8),
                      "counters": torch.zeros(2, dtype=torch.int64)})
    return ranks


def cache_slots(slots, other):
    return [slots, slots, slots, other]


def expected_replica(ranks, slots_by_rank, other_by_rank, me):
    """Rank ``me``'s caches with every other rank's rows at that rank's slots (reference ops)."""
    out = [c.clone() for c in ranks[me]["caches"]]
    for q in range(len(ranks)):
        if q == me:
            continue
        for i, (lay, slots) in enumerate(zip(LAYOUTS, cache_slots(slots_by_rank[q], other_by_rank[q]))):
            live = slots[slots >= 0]
            write_rows(out[i], live, read_rows(ranks[q]["caches"][i], live, lay), lay)
    return out


def assert_replicas(ranks, expected):
    for r in range(len(ranks)):
        for i, lay in enumerate(LAYOUTS):
            got, want = ranks[r]["caches"][i].view(torch.uint8), expected[i].view(torch.uint8)
            assert torch.equal(got, want), (r, lay)


