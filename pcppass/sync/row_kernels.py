"""Triton kernels that move cache rows by slot with no host reads (CUDA-graph capturable).

Launches, one each whatever the number of caches:

* :func:`pack`: header, every cache's rows at this rank's slots (zeros for slot -1) and every
  payload's bytes into one uint8 buffer (``sync_pack``);
* :func:`check`: every rank's sync header against this rank's, and every slot against the other
  ranks' slots of the same segment (two owners of one row), on the gathered buffer;
* :func:`scatter`: the rows every other rank sent, from the gathered buffer into MANY caches
  (``sync_scatter_rows_all``); rows in conflict are zeroed on every replica;
* :func:`peer_store`: this rank's rows straight into every peer's replica, header and payloads
  into every peer's mailbox, then one barrier on a device epoch (``sync_peer_store``);
* :func:`check_inputs`: slot-mapping inputs in range;
* :func:`store_rows`: dense source rows into one cache at slots (the cache-write ops' store).

Work is cut into tiles of :data:`BLOCK` words (:mod:`pcppass.sync.row_kernels_triton`): a
word is the widest of 16, 8, 4, 2, 1 bytes that every address of a table entry allows, so rows of
DeepSeek's 656-byte MLA cache move as 16-byte vectors, many rows per program.

A cache row is addressed by :class:`RowAddressing`, the byte form of a resolved layout::

    segment k of slot s lies at  data_ptr + (s // block_size) * block_stride + base_k + (s % block_size) * stride_k
                                 and holds length_k bytes, bytes [offset_k, offset_k + length_k) of the packed row

``paged_rows`` is one segment, ``block_split`` one per byte segment, ``indexed_dim`` one per index
of the dims before ``dim`` (block_size 1). Tables (int64 entries: addresses, layout, rows, offsets;
tiles) are built on the host from tensor metadata, once per configuration, and cached: a step
reuses the same device tables and a captured CUDA graph replays them. Tensors whose addresses
change from step to step (slot mappings, payloads) are kernel arguments (at most :data:`MAX_ARGS`).
Slots outside ``[0, num_slots)`` are never written; the kernels record them in the device status
(:mod:`pcppass.sync.device_checks`).

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
from typing import Callable, Sequence

import torch

from pcppass.sync import device_checks
from pcppass.sync.mailbox import MAILBOX_FLAGS
from pcppass.spec import ResolvedLayout

#: segments a row may have in a kernel-addressed cache (the rest use the plain-torch ops)
MAX_SEGMENTS = 4
#: tensor arguments of one launch (slot mappings and payloads); more take the plain-torch ops
MAX_ARGS = 8
#: ranks a peer-store table holds a replica distance for (and the check kernels compare)
MAX_WORLD = 8
#: words per tile (one program)
BLOCK = 512
#: rows of one rank one program of check_kernel compares (against CHECK_ROWS of another at a
#: time: a larger tile spills registers, ptxas -v: 64x256 took 255 registers + 3.3 KB of spills)
CHECK_ROWS = 32
#: int64 fields of a tile-table entry (see row_kernels_triton)
TILE_FIELDS = 17 + MAX_WORLD
#: entry kinds
ROWS, ARG_BYTES, ADDRESS_BYTES = 0, 1, 2

#: int64 fields of a store-table entry: cache pointer, rows, row offset, slot offset, bytes per
#: row, block size, block stride, number of slots, then (base, stride, length, offset) per segment
_HEAD_FIELDS = 8
ENTRY = _HEAD_FIELDS + 4 * MAX_SEGMENTS
_STORE_BLOCK = 1024


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
# Tile tables
# ---------------------------------------------------------------------------------------------


def word_width(*values: int) -> int:
    """The widest word (16, 8, 4, 2 or 1 bytes) that divides every address, stride and length."""
    for width in (16, 8, 4, 2):
        if all(v % width == 0 for v in values):
            return width
    return 1


@dataclass(frozen=True)
class Piece:
    """One byte segment of every row of one cache: what one table entry of kind ``ROWS`` moves."""

    address: int  # cache data_ptr + the segment's base
    block_size: int
    block_stride: int
    slot_stride: int
    num_slots: int
    length: int
    packed: int  # offset of the segment in a packed row
    bytes_per_row: int

    @property
    def alignment_terms(self) -> tuple[int, ...]:
        return (self.address, self.block_stride, self.slot_stride, self.length)


def pieces(cache: torch.Tensor, addr: RowAddressing) -> list[Piece]:
    base = cache.data_ptr()
    return [Piece(base + b, addr.block_size, addr.block_stride, stride, addr.num_slots, length, packed,
                  addr.bytes_per_row)
            for b, stride, length, packed in addr.segments]


def rows_entry(piece: Piece, *, rows: int, buf: int = 0, slot: int = 0, arg: int = 0, label: int = 0,
               check: int = -1, rank: int = 0, segment: int = -1, deltas: Sequence[int] = (),
               aligned_with: Sequence[int] = ()) -> list[int]:
    """A table entry moving ``piece`` for ``rows`` rows; ``aligned_with``: the other side's
    addresses and strides (the word width must divide them too)."""
    width = word_width(*piece.alignment_terms, *aligned_with, *deltas)
    return [ROWS, piece.address, rows, buf, slot, piece.bytes_per_row, piece.block_size, piece.block_stride,
            piece.slot_stride, piece.num_slots, piece.length // width, width, arg, label, check, rank,
            segment, *deltas, *[0] * (MAX_WORLD - len(deltas))]


def bytes_entry(*, kind: int, nbytes: int, buf: int, source: int = 0, offset: int = 0, arg: int = 0,
                deltas: Sequence[int] = (), aligned_with: Sequence[int] = ()) -> list[int]:
    """A table entry copying ``nbytes`` contiguous bytes: from argument ``arg`` at ``offset``
    (``ARG_BYTES``) or from address ``source`` (``ADDRESS_BYTES``) to ``buf`` in the buffer."""
    width = word_width(nbytes, buf, source, offset, *aligned_with, *deltas)
    return [kind, source, 1, buf, offset, nbytes, 1, 0, 0, 1, nbytes // width, width, arg, 0, -1, 0, -1,
            *deltas, *[0] * (MAX_WORLD - len(deltas))]


@dataclass
class TileTable:
    table: torch.Tensor  # [entries, TILE_FIELDS] int64
    tiles: torch.Tensor  # [tiles, 2] int64: (entry, first word)
    num_entries: int
    num_tiles: int
    extra: dict


def _tiles(entries: list[list[int]]) -> list[int]:
    out: list[int] = []
    for i, e in enumerate(entries):
        for first in range(0, e[2] * e[10], BLOCK):
            out += [i, first]
    return out


#: configuration key -> tile table on a device
_TABLES: dict[tuple, TileTable] = {}


def tile_table(key: tuple, device: torch.device, build: Callable[[], tuple[list[list[int]], dict]]) -> TileTable:
    """The cached table of ``key`` (``build() -> (entries, extra)`` runs on a miss; tensors in
    ``extra`` are moved to ``device``)."""
    found = _TABLES.get(key)
    if found is None:
        entries, extra = build()
        tiles = _tiles(entries)
        flat = [x for e in entries for x in e] or [0] * TILE_FIELDS
        table = torch.tensor(flat, dtype=torch.int64).to(device)
        extra = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
        found = _TABLES[key] = TileTable(table, torch.tensor(tiles or [0, 0], dtype=torch.int64).to(device),
                                         len(entries), len(tiles) // 2, extra)
    return found


class ArgTable:
    """The distinct tensors (by identity) one launch reads: slot mappings and payloads."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def add(self, t: torch.Tensor) -> int:
        """``t``'s argument number (the same tensor object is passed once)."""
        if id(t) not in self._index:
            self._index[id(t)] = len(self.tensors)
            self.tensors.append(t)
        return self._index[id(t)]


def byte_args(tensors: Sequence[torch.Tensor], filler: torch.Tensor) -> list[torch.Tensor]:
    """:data:`MAX_ARGS` uint8 views for a launch (``filler`` in the unused places)."""
    views = [t.contiguous().view(torch.uint8).reshape(-1) if t.numel() else filler for t in tensors]
    return views + [filler] * (MAX_ARGS - len(views))


def alignment_key(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t.data_ptr() % 16 for t in tensors)


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
        return importlib.import_module("pcppass.sync.row_kernels_triton")
    path = Path(__file__).with_name("row_kernels_triton.py")
    spec = importlib.util.spec_from_file_location("pcppass.sync.row_kernels_triton_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernels() -> ModuleType:
    return _kernels(_interpreting())


def cache_key(caches: list[torch.Tensor]) -> tuple:
    """What a table depends on in the caches: addresses, shapes, strides, dtypes."""
    return tuple((c.data_ptr(), c.shape, c.stride(), c.dtype) for c in caches)


# ---------------------------------------------------------------------------------------------
# Host entry points
# ---------------------------------------------------------------------------------------------


def pack(out: torch.Tensor, tiles: TileTable, args: list[torch.Tensor], me: int) -> None:
    """Run a pack table (header, rows, payloads) into ``out``."""
    kernels().pack_kernel[(tiles.num_tiles,)](out, tiles.table, tiles.tiles, *args,
                                              device_checks.status(out.device), me,
                                              ENTRY=TILE_FIELDS, BLOCK=BLOCK)


@dataclass(frozen=True)
class Chunks:
    """Where every rank's chunk (header, segments) of an exchange lies on this rank: rank r's at
    ``anchor + offset + r * stride``, in the mailbox half of the last sync when ``half`` > 0."""

    anchor: torch.Tensor
    offset: int
    stride: int
    half: int = 0
    counters: torch.Tensor | None = None


def check(chunks: Chunks, tiles: TileTable, me: int, world: int, head_len: int, conflicts: bool,
          zero: bool = False) -> None:
    """Every rank's header against this rank's, every slot of the segments ``tiles.extra["segs"]``
    against its cache's slot count where given and, with ``conflicts``, against the other ranks'
    slots of the segments of its group (see ``check_kernel``): row flags in
    ``tiles.extra["flags"]``, ``tiles.extra["verdict"][0]`` 1 when anything was found. With
    ``zero`` (peer stores), rows two ranks wrote are zeroed in the caches of ``tiles``' entries."""
    segs = tiles.extra["segs"]
    verdict = tiles.extra["verdict"]
    verdict.zero_()
    per_rank = max(1, -(-int(tiles.extra["max_rows"]) // CHECK_ROWS))
    kernels().check_kernel[(segs.shape[0], world * per_rank)](
        chunks.anchor, chunks.offset, chunks.stride, chunks.half,
        chunks.counters if chunks.counters is not None else segs, segs, segs.shape[0], tiles.extra["flags"],
        verdict, tiles.table, tiles.num_entries, device_checks.status(chunks.anchor.device), me,
        world, head_len, int(conflicts), int(zero), per_rank, ENTRY=TILE_FIELDS, BLOCK_N=CHECK_ROWS,
        BLOCK_K=CHECK_ROWS, BLOCK_H=256)


def check_tables(segments: Sequence[tuple[int, ...]], world: int) -> dict:
    """``extra`` of a table checked by :func:`check`: ``segments`` = (rows, label, byte offset of
    the slots in a chunk, alignment of those slots[, group, slots of its cache]) per slot segment;
    segments of one group (one cache) are compared with each other (by default each is its own
    group); a slot count of -1 (the default) leaves ranges unchecked."""
    rows, at = [], 0
    for k, (n, label, offset, align, *rest) in enumerate(segments):
        group, limit = rest if rest else (k, -1)
        rows.append([n, label, at, offset, align, group, limit])
        at += world * n
    return {"segs": torch.tensor(rows or [[0, 0, 0, 0, 8, 0, -1]], dtype=torch.int64),
            "flags": torch.zeros(max(at, 1), dtype=torch.uint8), "verdict": torch.zeros(1, dtype=torch.int32),
            "max_rows": max((seg[0] for seg in segments), default=0)}


def scatter(buf: torch.Tensor, tiles: TileTable, verdict: torch.Tensor | None = None,
            when_refused: bool = False) -> None:
    """Run a scatter table: rows from ``buf`` into the caches (flags from :func:`check`), if the
    step's ``verdict`` (none: the step stands) is a refusal exactly when ``when_refused`` (the
    write-back of a snapshot)."""
    if tiles.num_tiles:
        flags = tiles.extra.get("flags", buf)
        if verdict is None:
            verdict = tiles.extra.setdefault("stands", torch.zeros(1, dtype=torch.int32, device=buf.device))
        kernels().scatter_kernel[(tiles.num_tiles,)](buf, tiles.table, tiles.tiles, flags, verdict,
                                                     int(when_refused), device_checks.status(buf.device),
                                                     ENTRY=TILE_FIELDS, BLOCK=BLOCK)


def peer_store(tiles: TileTable, args: list[torch.Tensor], mailbox: torch.Tensor, mailbox_deltas: torch.Tensor,
               counters: torch.Tensor, me: int, world: int, capacity: int, limit: int) -> None:
    """Run a peer-store table, then the epoch barrier (bounded by ``limit``: ns on the device,
    spins when interpreting)."""
    kernels().peer_kernel[(tiles.num_tiles,)](
        tiles.table, tiles.tiles, *args, mailbox, mailbox_deltas, counters, device_checks.status(mailbox.device),
        me, world, capacity, limit, ENTRY=TILE_FIELDS, BLOCK=BLOCK, USE_TIMER=not _interpreting())


#: (device, checks) -> device table of input_kernel
_INPUT_TABLES: dict[tuple, torch.Tensor] = {}


def check_inputs(checks: Sequence[tuple[torch.Tensor, int, int, int]]) -> None:
    """``(slots, lowest, limit, label)``: every slot (an integer tensor of any width in
    ``device_checks.SLOT_DTYPE_CODES``) must lie in ``[lowest, limit)``; one launch per
    :data:`MAX_ARGS` inputs, nothing read back."""
    for start in range(0, len(checks), MAX_ARGS):
        part = checks[start:start + MAX_ARGS]
        device = part[0][0].device
        rows = tuple((k, s.numel(), low, high, lab, device_checks.SLOT_DTYPE_CODES[s.dtype])
                     for k, (s, low, high, lab) in enumerate(part))
        table = _INPUT_TABLES.get((device, rows))
        if table is None:  # built once per configuration: a captured step replays it
            table = _INPUT_TABLES[(device, rows)] = torch.tensor(rows, dtype=torch.int64).to(device)
        args = byte_args([s for s, _, _, _ in part], part[0][0].view(torch.uint8))
        kernels().input_kernel[(len(part),)](table, *args, device_checks.status(device), BLOCK=1024)


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
    kernels().store_kernel[(t,)](rows, slots.contiguous(), cache.data_ptr(), entry, ENTRY=ENTRY,
                                 MAXSEG=MAX_SEGMENTS, HEAD=_HEAD_FIELDS, BLOCK=_STORE_BLOCK)
    return True
