"""Triton kernels that move cache rows by slot with no host reads (CUDA-graph capturable).

Three movements, one launch each, whatever the number of caches:

* :func:`store_rows`: dense source rows ``[T, bytes_per_row]`` into one cache at ``slots[t]``,
  rows with a negative slot skipped by a mask (the cache-write ops' store, without ``nonzero``);
* :func:`pack_rows`: the rows of MANY caches at their slots into one uint8 buffer (``sync_pack``),
  zeros for slot -1;
* :func:`scatter_rows`: the rows every other rank sent, from the gathered buffer into MANY caches
  (``sync_scatter_rows_all``).

A cache row is addressed by :class:`RowAddressing`, the byte form of a resolved layout::

    segment k of slot s lies at  data_ptr + (s // block_size) * block_stride + base_k + (s % block_size) * stride_k
                                 and holds length_k bytes, bytes [offset_k, offset_k + length_k) of the packed row

``paged_rows`` is one segment, ``block_split`` one per byte segment, ``indexed_dim`` one per index
of the dims before ``dim`` (block_size 1). Many caches are described by one int64 table (cache
``data_ptr`` cast to a pointer inside the kernel, layout, rows and offsets), built on the host from
tensor metadata and cached per configuration, so a step reuses the same device table (and a
captured CUDA graph replays it). Slots outside ``[0, num_slots)`` are never written (the reference
ops raise on them; a kernel cannot, so it drops them rather than write out of bounds).

Triton's ``jit`` decides between compiling and interpreting when it decorates, so the kernels are
built on first use, once per mode: ``TRITON_INTERPRET=1`` runs them on CPU tensors (tests).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from pcppass.spec import ResolvedLayout

#: segments a row may have in a kernel-addressed cache (the rest use the plain-torch ops)
MAX_SEGMENTS = 4
#: int64 fields of one table entry: cache pointer, rows, row offset, slot offset, bytes per row,
#: block size, block stride, number of slots, then (base, stride, length, offset) per segment
_HEAD_FIELDS = 8
ENTRY = _HEAD_FIELDS + 4 * MAX_SEGMENTS
_BLOCK = 1024


@dataclass(frozen=True)
class RowAddressing:
    block_size: int
    block_stride: int
    num_slots: int
    bytes_per_row: int
    #: (base, stride, length, offset in the packed row), bytes
    segments: tuple[tuple[int, int, int, int], ...]

    def fields(self) -> list[int]:
        out = [self.bytes_per_row, self.block_size, self.block_stride, self.num_slots]
        for seg in self.segments:
            out.extend(seg)
        out.extend([0, 0, 0, 0] * (MAX_SEGMENTS - len(self.segments)))
        return out


def _dense(sizes, strides) -> bool:
    """Row-major contiguous (size-1 dims ignored)."""
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@functools.lru_cache(maxsize=4096)
def _addressing(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
                layout: ResolvedLayout) -> RowAddressing | None:
    if layout.kind == "paged_rows":
        if len(shape) < 2 or not _dense(shape[2:], strides[2:]):
            return None
        inner = math.prod(shape[2:]) * itemsize
        if inner != layout.bytes_per_row:
            return None
        return RowAddressing(shape[1], strides[0] * itemsize, shape[0] * shape[1], inner,
                             ((0, strides[1] * itemsize, inner, 0),))
    if layout.kind == "block_split":
        if len(shape) < 2 or not _dense(shape[1:], strides[1:]) or len(layout.segments) > MAX_SEGMENTS:
            return None
        segments, offset = [], 0
        for base, stride, length in layout.segments:
            segments.append((base, stride, length, offset))
            offset += length
        return RowAddressing(layout.block_size, strides[0] * itemsize, shape[0] * layout.block_size,
                             layout.bytes_per_row, tuple(segments))
    if layout.kind == "indexed_dim":
        d = layout.dim
        outer, inner = shape[:d], shape[d + 1:]
        if not _dense(inner, strides[d + 1:]) or math.prod(outer) > MAX_SEGMENTS:
            return None
        length = math.prod(inner) * itemsize
        segments = []
        for k, idx in enumerate(itertools.product(*(range(n) for n in outer))):
            base = sum(i * s for i, s in zip(idx, strides[:d])) * itemsize
            segments.append((base, 0, length, k * length))
        if length * len(segments) != layout.bytes_per_row:
            return None
        return RowAddressing(1, strides[d] * itemsize, shape[d], layout.bytes_per_row, tuple(segments))
    return None


def addressing(cache: torch.Tensor, layout: ResolvedLayout) -> RowAddressing | None:
    """Kernel addressing of ``cache``'s rows under ``layout``; None when the kernels cannot
    address it (row bytes not contiguous per segment, too many segments)."""
    return _addressing(tuple(cache.shape), tuple(cache.stride()), cache.element_size(), layout)


# ---------------------------------------------------------------------------------------------
# Kernels (built on first use)
# ---------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


@functools.cache
def _kernels(interpret: bool) -> ModuleType:
    """The kernel module, imported for the Triton mode in force (a second copy when interpreting,
    so compiled and interpreted kernels never mix)."""
    if not interpret:
        return importlib.import_module("pcppass.kernels.row_kernels_triton")
    path = Path(__file__).with_name("row_kernels_triton.py")
    spec = importlib.util.spec_from_file_location("pcppass.kernels.row_kernels_triton_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch_args() -> dict:
    return {"ENTRY": ENTRY, "MAXSEG": MAX_SEGMENTS, "HEAD": _HEAD_FIELDS, "BLOCK": _BLOCK}


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

#: configuration key -> (device table, max rows per entry)
_TABLES: dict[tuple, tuple[torch.Tensor, int]] = {}


def cache_key(caches: list[torch.Tensor]) -> tuple:
    """What a table depends on in the caches: addresses, shapes, strides, dtypes."""
    return tuple((c.data_ptr(), c.shape, c.stride(), c.dtype) for c in caches)


def _table(key: tuple, device: torch.device, build) -> tuple[torch.Tensor, int]:
    found = _TABLES.get(key)
    if found is None:
        entries = build()
        flat = [x for e in entries for x in e]
        table = torch.tensor(flat, dtype=torch.int64).to(device)
        found = _TABLES[key] = (table, max((e[1] for e in entries), default=0))
    return found


# ---------------------------------------------------------------------------------------------
# Host entry points
# ---------------------------------------------------------------------------------------------


def pack_rows(out: torch.Tensor, caches: list[torch.Tensor], addressings: list[RowAddressing],
              slots: torch.Tensor, slot_starts: list[int], counts: list[int], out_offsets: list[int],
              key: tuple) -> None:
    """``out[out_offsets[i] + j*bpr_i ...]`` = cache i's row at ``slots[slot_starts[i] + j]``,
    ``j < counts[i]`` (zeros for padding). ``slots``: int64, contiguous."""
    def build():
        return [[c.data_ptr(), n, o, s, *a.fields()]
                for c, a, n, o, s in zip(caches, addressings, counts, out_offsets, slot_starts)]

    table, rows = _table(("pack", key), out.device, build)
    if rows:
        _kernels(_interpreting()).pack_kernel[(len(caches), rows)](out, slots, table, **_launch_args())


def scatter_rows(buf: torch.Tensor, caches: list[torch.Tensor], addressings: list[RowAddressing],
                 sources: Callable[[], list[list[tuple[int, int, int]]]], key: tuple) -> None:
    """For cache i and each ``(rows_offset, slots_offset, n)`` in ``sources()[i]``: the ``n`` rows
    at ``buf[rows_offset:]`` go to the slots held (int64, little-endian) at ``buf[slots_offset:]``.
    ``sources`` is called only when no table is cached for ``key``."""
    def build():
        return [[c.data_ptr(), n, rows_off, slots_off, *a.fields()]
                for c, a, src in zip(caches, addressings, sources()) for rows_off, slots_off, n in src]

    table, rows = _table(("scatter", key), buf.device, build)
    if rows:
        _kernels(_interpreting()).scatter_kernel[(table.numel() // ENTRY, rows)](buf, table, **_launch_args())


#: (device, addressing) -> one-entry table (no cache pointer: the cache is a kernel argument)
_STORE_TABLES: dict[tuple, torch.Tensor] = {}


def store_rows(cache: torch.Tensor, layout: ResolvedLayout, slots: torch.Tensor, rows: torch.Tensor) -> bool:
    """Store ``rows`` (``[T, bytes_per_row]`` bytes, any dtype of that width) at ``slots[t]`` of
    ``cache`` (slot < 0: skipped). False when the kernel cannot address the cache (nothing done)."""
    addr = addressing(cache, layout)
    if addr is None:
        return False
    t = slots.shape[0]
    rows = rows.contiguous().view(torch.uint8).reshape(t, -1)
    if rows.shape[1] != addr.bytes_per_row:
        raise ValueError(f"store_rows: rows of {rows.shape[1]} bytes for a layout of {addr.bytes_per_row}")
    if t == 0:
        return True
    key = (cache.device, addr)
    entry = _STORE_TABLES.get(key)
    if entry is None:
        entry = _STORE_TABLES[key] = torch.tensor([0, 0, 0, 0, *addr.fields()], dtype=torch.int64).to(cache.device)
    _kernels(_interpreting()).store_kernel[(t,)](rows, slots.contiguous(), cache.data_ptr(), entry, **_launch_args())
    return True
