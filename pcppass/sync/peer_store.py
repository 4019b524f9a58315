"""Direct peer stores (``pcppass::sync_peer_store``): the owner's rows straight into every replica.

The peer-store transport (:class:`pcppass.rewrite.peer_store.PeerStoreTransport`) replaces
pack + all-gather + scatter with ONE launch when every replica of every cache lives in symmetric
memory (:mod:`pcppass.sync.peer`)::

    mailbox = pcppass.sync_peer_store(fp, caches, slots, layouts, payloads, slots_segments, group,
                                      sites, verify, check_conflicts, return_payloads)
    index   = pcppass.sync_read_header(mailbox, world, fp, n_segments, False)  # re-runs only
    arg_all = pcppass.sync_unpack(mailbox, index, seg, like, group, mask)      # re-runs only

The launch (``row_kernels.peer_store``, one program per tile):

1. every program copies its tile of this rank's rows (read from this rank's cache at its slots,
   16-byte words where the layout allows) to the same address in every peer's replica; the header
   and payloads (slot mappings, re-run inputs) go to this rank's chunk of every rank's mailbox;
2. the last program to finish raises this sync's epoch in every peer's mailbox and waits (bounded)
   for every peer's.

Then, with checks on, one more launch (``check_kernel``, as for the all-gather transport but on
the mailbox) compares every rank's header with this rank's (fingerprint, segment sizes) and every
slot with the other ranks' slots of the same segment: a slot two ranks wrote is zeroed in this
rank's replica (every rank does the same, so the replicas stay identical); errors go to the
device status (:mod:`pcppass.sync.device_checks`).

No all-gather buffer, no receive-side scatter: a replica's rows arrive with the same bytes the
all-gather transport's scatter writes (the rows of the cache at the owner's slots). A peer's rows
land in this rank's replica while this rank may still run its step; they are rows only their owner
reads in this step, so nothing reads them before the barrier.

The mailbox chunk has the all-gather buffer's layout (header, segments) with cache-row segments of
size 0, so ``sync_read_header`` / ``sync_unpack`` read re-run payloads from it unchanged.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from pcppass.errors import PcpSyncError
from pcppass.sync import row_kernels
from pcppass.sync.rows import decode_pack_layouts, header_bytes, site_labels
from pcppass.sync.rows_cuda import cached_header
from pcppass.sync import device_checks
from pcppass.sync.stats import SYNC_COUNTERS


class Replicas(Protocol):
    """Where every rank's replica and mailbox are (:class:`pcppass.sync.peer.SymmetricReplicas`;
    tests simulate it with tensors of one process)."""

    me: int
    world: int
    capacity: int
    mailbox: torch.Tensor
    mailbox_deltas: torch.Tensor
    #: ``mailbox_deltas`` on the host
    mailbox_deltas_host: tuple[int, ...]
    counters: torch.Tensor

    @property
    def limit(self) -> int: ...

    def deltas(self, t: torch.Tensor) -> tuple[int, ...]: ...

    def agree(self, what: str, tensors: list[torch.Tensor]) -> None: ...


def mailbox_sizes(cache_count: int, payloads: list[torch.Tensor]) -> list[int]:
    """Segment sizes of a mailbox chunk: cache rows travel directly (size 0), then the payloads."""
    return [0] * cache_count + [p.numel() * p.element_size() for p in payloads]


def store(
    fingerprint: str,
    caches: list[torch.Tensor],
    cache_slots: list[torch.Tensor],
    layouts: list[int],
    payloads: list[torch.Tensor],
    slots_segments: list[int],
    sites: str,
    verify: bool,
    check_conflicts: bool,
    return_payloads: bool,
    reps: Replicas,
    phase: int = 3,
) -> torch.Tensor:
    """One peer-store sync (see the module docstring); returns every rank's mailbox chunk when
    ``return_payloads`` (``[world * chunk]`` bytes), else an empty tensor. ``phase``: 3 runs the
    stores with the barrier (1), then the checks (2); a simulation of several ranks in one
    process runs every rank's phase 1, then every rank's phase 2."""
    decoded = decode_pack_layouts(caches, cache_slots, layouts)
    labels = site_labels(sites, len(caches))
    addressings = [row_kernels.addressing(c, lay) for c, lay in zip(caches, decoded)]
    if any(a is None for a in addressings):
        raise PcpSyncError("pcppass peer stores: a cache's rows are not contiguous per segment; "
                           "use the all-gather transport for it")
    args = row_kernels.ArgTable()
    slot_args = [args.add(s) for s in cache_slots]
    payload_args = [args.add(p) for p in payloads]
    if len(args.tensors) > row_kernels.MAX_ARGS or any(s.dtype != torch.int64 for s in cache_slots):
        raise PcpSyncError(f"pcppass peer stores: {len(args.tensors)} slot and payload tensors (at most "
                           f"{row_kernels.MAX_ARGS}, slot mappings int64); use the all-gather transport")
    if len(slots_segments) != len(caches):
        raise ValueError("sync_peer_store: one slots segment per cache")
    device = caches[0].device
    n = len(caches)
    sizes = mailbox_sizes(n, payloads)
    head = cached_header(fingerprint, sizes, device)
    offsets, chunk = [], head.numel()
    for size in sizes:
        offsets.append(chunk)
        chunk += size
    if chunk > reps.capacity:
        raise PcpSyncError(f"pcppass peer stores: {chunk} bytes of header and payloads per rank exceed the "
                           f"mailbox capacity {reps.capacity}")
    counts = [s.numel() for s in cache_slots]
    segs = list(dict.fromkeys(slots_segments))
    launch_args = row_kernels.byte_args(args.tensors, reps.mailbox)
    # The table holds absolute addresses of every replica: the peers' addresses are part of the
    # key, or caches reallocated at this rank's old addresses would reuse a table that stores
    # into where the peers' old caches were.
    peers = (tuple(reps.deltas(c) for c in caches), reps.mailbox_deltas_host)
    key = ("peer", row_kernels.cache_key(caches), tuple(layouts), tuple(counts), tuple(slot_args),
           tuple(payload_args), tuple(sizes), tuple(slots_segments), row_kernels.alignment_key(launch_args),
           head.data_ptr(), reps.mailbox.data_ptr(), sites, peers)

    def build():
        reps.agree("caches", caches)
        box = peers[1]
        box_terms = (reps.mailbox.data_ptr(), reps.capacity, row_kernels.MAILBOX_FLAGS)
        entries = [row_kernels.bytes_entry(kind=row_kernels.ADDRESS_BYTES, source=head.data_ptr(),
                                           nbytes=head.numel(), buf=0, deltas=box, aligned_with=box_terms)]
        for i, (cache, addr) in enumerate(zip(caches, addressings)):
            deltas = peers[0][i]
            what = device_checks.label(labels[i])
            for piece in row_kernels.pieces(cache, addr):
                entries.append(row_kernels.rows_entry(piece, rows=counts[i], arg=slot_args[i], label=what,
                                                      segment=segs.index(slots_segments[i]), deltas=deltas))
        for k, arg in enumerate(payload_args):
            if sizes[n + k]:
                entries.append(row_kernels.bytes_entry(
                    kind=row_kernels.ARG_BYTES, arg=arg, nbytes=sizes[n + k], buf=offsets[n + k], deltas=box,
                    aligned_with=(*box_terms, launch_args[arg].data_ptr())))
        extra = row_kernels.check_tables(
            [(payloads[seg - n].numel(), device_checks.label(labels[slots_segments.index(seg)]), offsets[seg],
              row_kernels.word_width(*box_terms, offsets[seg], 8)) for seg in segs], reps.world)
        return entries, extra

    tiles = row_kernels.tile_table(key, device, build)
    if phase & 1:
        row_kernels.peer_store(tiles, launch_args, reps.mailbox, reps.mailbox_deltas, reps.counters, reps.me,
                               reps.world, reps.capacity, reps.limit)
    if phase & 2 and (verify or check_conflicts):
        chunks = row_kernels.Chunks(reps.mailbox, row_kernels.MAILBOX_FLAGS, reps.capacity,
                                    reps.world * reps.capacity, reps.counters)
        row_kernels.check(chunks, tiles, reps.me, reps.world, head.numel(), check_conflicts, zero=True)
    rows_bytes = sum(c * lay.bytes_per_row for c, lay in zip(counts, decoded))
    if phase & 1:
        SYNC_COUNTERS.record(rows_bytes + chunk, reps.world)
    if not return_payloads:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return every_chunk(reps, chunk)


def every_chunk(reps: Replicas, chunk: int) -> torch.Tensor:
    """Every rank's chunk of the mailbox half the last sync used, ``[world * chunk]`` bytes (the
    half is chosen on the device: nothing is read back)."""
    halves = reps.mailbox[row_kernels.MAILBOX_FLAGS:].view(2, reps.world, reps.capacity)
    last = halves.index_select(0, reps.counters[:1] % 2)
    return last[0, :, :chunk].reshape(-1).contiguous()


@torch.library.custom_op("pcppass::sync_peer_store", mutates_args=("caches",))
def sync_peer_store(
    fingerprint: str,
    caches: list[torch.Tensor],
    cache_slots: list[torch.Tensor],
    layouts: list[int],
    payloads: list[torch.Tensor],
    slots_segments: list[int],
    group_name: str,
    sites: str,
    verify: bool,
    check_conflicts: bool,
    return_payloads: bool,
) -> torch.Tensor:
    """Store this rank's rows of ``caches`` (at ``cache_slots``) into every peer's replica and
    this rank's header and ``payloads`` into every rank's mailbox, then wait for every peer's
    (see the module docstring). ``caches`` are mutated: the peers' rows land in them.
    ``slots_segments[i]``: the payload segment holding cache i's slots; ``sites``: cache i's site
    label on line i. Returns every rank's mailbox chunk with ``return_payloads`` (re-runs)."""
    from pcppass.sync import peer

    device = caches[0].device if caches else None
    if device is None or device.type != "cuda":
        raise PcpSyncError("pcppass::sync_peer_store needs CUDA caches in symmetric memory "
                           "(pcppass.sync.peer.symmetric_empty); use the all-gather transport")
    return store(fingerprint, caches, cache_slots, layouts, payloads, slots_segments, sites, verify,
                 check_conflicts, return_payloads, peer.replicas(group_name, device))


@sync_peer_store.register_fake
def _sync_peer_store_fake(fingerprint, caches, cache_slots, layouts, payloads, slots_segments, group_name, sites,
                          verify, check_conflicts, return_payloads):
    from torch.distributed.distributed_c10d import _resolve_process_group

    anchor = caches[0]
    if not return_payloads:
        return anchor.new_empty((0,), dtype=torch.uint8)
    world = dist.get_world_size(_resolve_process_group(group_name))
    chunk = header_bytes(len(caches) + len(payloads))
    for p in payloads:
        chunk = chunk + p.numel() * p.element_size()
    return anchor.new_empty((world * chunk,), dtype=torch.uint8)
