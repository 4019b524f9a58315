"""Direct peer stores: caches in symmetric memory, replica addresses, the mailbox and its epoch.

With every replica of a cache in symmetric memory (``torch.distributed._symmetric_memory``: each
rank's allocation mapped into every other rank's address space over NVLink, peer to peer; NVLink
multicast stays off), the owner of a row can store it straight into every peer's replica: no
all-gather buffer, no scatter on the receiving side (:mod:`pcppass.sync.peer_store`).

* :func:`symmetric_empty` / :func:`symmetric_zeros` allocate a tensor in symmetric memory (the
  engine's and the benchmark's cache allocator option); :func:`is_symmetric` says whether a tensor
  lives there (:func:`group_refusal` and :func:`cache_refusal` decide the transport).
* :class:`SymmetricReplicas` (one per process group and device) knows, for each cache, the byte
  distance from this rank's replica to every rank's (``rendezvous`` once per allocation; every
  rank must hold the cache at the same offset of its allocation, checked through the c10d store),
  and owns the *mailbox*: a small symmetric buffer with one epoch flag per rank and two halves of
  ``[world, capacity]`` bytes where every rank drops its sync header and payloads (slot mappings,
  re-run inputs). ``counters = [epoch, programs arrived]`` live in this rank's memory.

The barrier: each peer-store launch is one sync, numbered by the epoch (``counters[0] + 1``, so
it advances on the device and a replayed CUDA graph keeps counting). After its stores, a rank
raises its flag in every peer's mailbox to the epoch (release) and waits until every peer's flag
in its own mailbox reached it (acquire), at most ``timeout_s``; a timeout is recorded in the
device status and raised by :func:`pcppass.sync.device_checks.raise_pending`, never a hang.
Every rank must run the same sequence of peer-store syncs (the same graphs in the same order).
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pcppass.errors import PcpSyncError
from pcppass.sync.mailbox import MAILBOX_FLAGS
from pcppass.sync.row_kernels import MAX_WORLD

#: bytes of one rank's chunk (header + payloads) in a mailbox half
DEFAULT_MAILBOX_CAPACITY = 1 << 20
#: how long a rank waits for its peers at a peer-store barrier
DEFAULT_TIMEOUT_S = float(os.environ.get("PCPPASS_PEER_TIMEOUT_S", "30"))

_lock = threading.Lock()
#: (storage data_ptr, nbytes) of every allocation made by symmetric_empty
_ALLOCATIONS: dict[int, int] = {}


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def symmetric_empty(shape, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.empty`` in symmetric memory (allocate the same shapes in the same order on every
    rank of the group; the rendezvous happens at the first peer-store sync)."""
    t = _symm_mem().empty(tuple(shape), dtype=dtype, device=device)
    with _lock:
        _ALLOCATIONS[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return t


def symmetric_zeros(shape, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return symmetric_empty(shape, dtype, device).zero_()


def is_symmetric(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in symmetric memory (allocated by :func:`symmetric_empty`, or a tensor
    torch's symmetric memory reports as its own). Never collective."""
    if not t.is_cuda:
        return False
    if t.untyped_storage().data_ptr() in _ALLOCATIONS:
        return True
    check = getattr(_symm_mem(), "is_symm_mem_tensor", None)
    try:
        return bool(check(t)) if check is not None else False
    except Exception:  # noqa: BLE001 - an old torch without the query: not known to be symmetric
        return False


def group_refusal(group: dist.ProcessGroup | None) -> str | None:
    """Why peer stores cannot sync over ``group`` (None: they can): they need 2 to 8 NCCL ranks."""
    if group is None:
        return "no process group"
    if dist.get_backend(group) != "nccl":
        return f"process group backend {dist.get_backend(group)} (peer stores need NCCL GPUs)"
    if not 2 <= dist.get_world_size(group) <= MAX_WORLD:
        return f"{dist.get_world_size(group)} ranks (peer stores take 2 to {MAX_WORLD})"
    return None


def cache_refusal(cache: torch.Tensor) -> str | None:
    """Why peers cannot store into ``cache``'s replicas (None: they can): a CUDA tensor in
    symmetric memory."""
    if not is_symmetric(cache):
        where = "on the CPU" if not cache.is_cuda else "not in symmetric memory"
        return f"a cache {tuple(cache.shape)} {cache.dtype} is {where}"
    return None


@dataclass
class SymmetricReplicas:
    """Replica addresses and the mailbox of one process group on one device (see the module
    docstring). Created at the first peer-store sync; every rank creates it at the same point."""

    group_name: str
    device: torch.device
    capacity: int = DEFAULT_MAILBOX_CAPACITY
    timeout_s: float = DEFAULT_TIMEOUT_S
    me: int = field(init=False)
    world: int = field(init=False)
    mailbox: torch.Tensor = field(init=False)
    mailbox_deltas: torch.Tensor = field(init=False)
    #: the same distances on the host (a key of the launch tables, read with no device sync)
    mailbox_deltas_host: tuple[int, ...] = field(init=False)
    counters: torch.Tensor = field(init=False)
    _deltas: dict[int, tuple[int, ...]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(self.group_name)
        self.me, self.world = dist.get_rank(group), dist.get_world_size(group)
        enable = getattr(_symm_mem(), "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before a rendezvous on older torch; a no-op on newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        self.mailbox = symmetric_zeros((MAILBOX_FLAGS + 2 * self.world * self.capacity,), torch.uint8, self.device)
        self.mailbox_deltas_host = tuple(self._allocation_deltas(self.mailbox))
        self.mailbox_deltas = torch.tensor(self.mailbox_deltas_host, dtype=torch.int64, device=self.device)
        self.counters = torch.zeros(2, dtype=torch.int64, device=self.device)

    @property
    def limit(self) -> int:
        """The barrier's wait bound for the kernel (nanoseconds)."""
        return int(self.timeout_s * 1e9)

    def _allocation_deltas(self, t: torch.Tensor) -> tuple[int, ...]:
        storage = t.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
        handle = _symm_mem().rendezvous(whole, self.group_name)
        if handle is None:
            raise PcpSyncError(
                f"pcppass peer stores: a tensor {tuple(t.shape)} {t.dtype} given as a cache is not a symmetric-"
                "memory allocation (a copy of the cache? aot_eager hands mutating ops copies of their "
                "inputs); peer stores need the op to write the caches themselves: compile with Inductor "
                "or eager, or use PcpBackend(transport='allgather')")
        ptrs = [int(p) for p in handle.buffer_ptrs]
        return tuple(p - ptrs[self.me] for p in ptrs)

    def deltas(self, t: torch.Tensor) -> tuple[int, ...]:
        """Byte distance from ``t``'s address to every rank's replica of it (0 for this rank)."""
        key = t.untyped_storage().data_ptr()
        if key not in self._deltas:
            self._deltas[key] = self._allocation_deltas(t)
        return self._deltas[key]

    def agree(self, what: str, tensors: list[torch.Tensor]) -> None:
        """Every rank must hold ``tensors`` at the same offsets of their allocations, with the
        same shapes and dtypes (peers store at this rank's offset): compared through the store."""
        from pcppass.sync.fingerprint import exchange_fingerprint
        from torch.distributed.distributed_c10d import _resolve_process_group

        text = ";".join(f"{t.data_ptr() - t.untyped_storage().data_ptr()}:{tuple(t.shape)}:{t.stride()}:{t.dtype}"
                        for t in tensors)
        digest = hashlib.sha256(text.encode()).hexdigest()
        try:
            exchange_fingerprint(digest, _resolve_process_group(self.group_name), namespace=f"peer-store/{what}",
                                 timeout_s=max(self.timeout_s, 60.0))
        except PcpSyncError as exc:
            raise PcpSyncError(
                f"pcppass peer stores ({what}): the ranks' caches do not lie at the same offsets of their "
                "symmetric allocations (allocate the same caches in the same order on every rank): "
                f"{exc}") from exc


_REPLICAS: dict[tuple[str, torch.device], SymmetricReplicas] = {}


def replicas(group_name: str, device: torch.device) -> SymmetricReplicas:
    """The :class:`SymmetricReplicas` of ``group_name`` on ``device`` (created on first use:
    collective, every rank of the group must get here)."""
    key = (group_name, device)
    found = _REPLICAS.get(key)
    if found is None:
        found = _REPLICAS[key] = SymmetricReplicas(group_name, device)
    return found
