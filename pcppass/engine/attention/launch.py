"""Launchers of the paged attention kernels: shapes, program tiles, splits, kernel choice.

Each launcher takes the step's meta tensors as the model contract defines them
(:mod:`pcppass.contract`: per-row ``positions``, ``token_to_req``, ``is_padding``,
``query_start_loc``, one block-table row per local request) and reads the caches through the block
table; nothing is gathered into a contiguous copy and nothing is read back to the host, so a step
that calls them can be captured in a CUDA graph.

Program tiles (:func:`tile_schedule`): a step of at most :data:`ROW_MODE_MAX_ROWS` rows (decode) runs
one program per row, its keys split into fixed ranges (flash-decoding); a larger step (prefill
chunks) runs tiles of consecutive rows of one request, all heads of a KV head stacked into the
tile, each tile over all its keys. Split sizes are constants, so a row's arithmetic does not depend
on the other rows of the step.

Sparse MLA (DeepSeek-V3.2) is the exception that proves the rule: its rows are short (``topk``
picks) and wide (128 heads), so at 1024 picks per split a step of fewer than about 33 rows leaves
SMs idle and takes as long as one of 32 rows. Its split is therefore chosen from the *deployment's*
decode rows per rank (:func:`decode_rows_per_rank`, set once per engine, the same on every rank),
never from the rows of the step at hand: a row's result still does not depend on its step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

#: steps with at most this many rows run one program per row (decode shapes)
ROW_MODE_MAX_ROWS = 256
#: keys per split in per-row mode (a multiple of every key tile)
GQA_SPLIT = 2048
MLA_SPLIT = 1024
#: keys per split of a decode row in the Gluon dense fp8_ds_mla kernel, and its heads per program
DENSE_GLUON_SPLIT = 2048
DENSE_GLUON_HEADS = 16
#: one split covering every key (tile mode; a single-split row)
NO_SPLIT = 1 << 30
#: query rows x heads stacked into one tile in tile mode
TILE_M = 64
MIN_DOT = 16


@dataclass(frozen=True)
class GqaTiles:
    """Launch shape of :func:`gqa_attention`: ``bn`` keys per tile; ``f16_dots``: with fp8 caches
    and a 16-bit query, the dots run on float16 (codes converted exactly, each query lane scaled
    by a power of two into float16's range) instead of the query's dtype."""

    bn: int = 64
    warps: int = 4
    stages: int = 2
    f16_dots: bool = False
    table_in_registers: bool = True  # per-row splits: see triton_kernels.split_blocks


@dataclass(frozen=True)
class IndexerTiles:
    """Launch shape of :func:`indexer_scores`: ``chunk`` positions per program, ``bn`` keys per tile."""

    bn: int = 256
    chunk: int = 2048
    warps: int = 4
    stages: int = 3
    table_in_registers: bool = True  # see triton_kernels.split_blocks


@dataclass(frozen=True)
class MlaTiles:
    """Launch shape of :func:`mla_attention`: up to ``heads`` heads stacked per program, ``bn``
    keys per tile, ``sparse_split`` picks per split of a sparse row."""

    heads: int = 32
    bn: int = 32
    warps: int | None = None  # None: 8 for tiles of at least 32 lanes, else 4
    stages: int = 2
    sparse_split: int = 1024  # sparse rows only
    table_in_registers: bool = True  # per-row splits: see triton_kernels.split_blocks
    separate_loads: bool = False  # dense fp8_ds_mla rows: see triton_kernels.latent_scores
    dequant_tile: bool = False  # fp8_ds_mla rows: see triton_kernels.dequantized_latent
    gluon: bool = False  # fp8_ds_mla rows on Hopper: gluon_kernels.{sparse,dense}_mla_kernel (gluon_*_fits)


#: decode launch shapes measured on the H200 (launch-shape sweeps, docs/KERNELS.md): GQA and dense
#: MLA at 32 rows, 32k (bf16 and fp8 caches apart); the indexer at 32 / 64 rows, 32k; sparse MLA
#: with DeepSeek-V3.2's 128 heads and 2048 picks (two programs of 64 heads per row). Block ids in
#: registers (every shape's default) measured faster for every kernel but fp8_ds_mla dense MLA,
#: which gains from separate loads instead. Sparse MLA dequantises each key tile whole (146 against
#: 173 µs at 32 rows, 47 against 54 at 8 with 256 picks per split; dense fp8_ds_mla MLA 625 against
#: 526, so it keeps separate loads). Prefill tiles (several rows per program, which load their
#: block ids) keep the shapes they were written with.
GQA_TILES = GqaTiles(bn=64, stages=2)
GQA_FP8_TILES = GqaTiles(bn=128, stages=3, f16_dots=True)
GQA_PREFILL_TILES = GqaTiles()
INDEXER_TILES = IndexerTiles()
MLA_TILES = MlaTiles(bn=64, stages=2)
MLA_FP8_TILES = MlaTiles(bn=32, stages=3, separate_loads=True, gluon=True)
#: the same launches with the Triton kernel only (what runs off Hopper)
MLA_FP8_TRITON_TILES = dataclasses.replace(MLA_FP8_TILES, gluon=False)
MLA_PREFILL_TILES = MlaTiles()
SPARSE_MLA_TILES = MlaTiles(heads=64, bn=32, warps=8, stages=3, dequant_tile=True, gluon=True)
#: the same launches with the Triton kernel only (what runs off Hopper)
SPARSE_MLA_TRITON_TILES = dataclasses.replace(SPARSE_MLA_TILES, gluon=False)


#: picks per split of a sparse MLA row that :func:`sparse_split_for` chooses from, largest first
SPARSE_SPLITS = (1024, 512, 256, 128)
#: the SM count assumed off CUDA (interpreter tests): an H200's
DEFAULT_SMS = 132
#: decode rows per rank the sparse MLA split is chosen for (None: ``SPARSE_MLA_TILES`` as measured)
_decode_rows: int | None = None


@contextlib.contextmanager
def decode_rows_per_rank(rows: int | None) -> Iterator[None]:
    """Launch sparse MLA for decode steps of about ``rows`` rows per rank while inside (None: the
    fixed :data:`SPARSE_MLA_TILES`). A deployment constant, like ``max_num_seqs``: every rank (and
    any reference run meant to match it bitwise) must use the same value, since the split changes
    the rounding of a row's result; the rows a step actually has never do."""
    global _decode_rows
    if rows is not None and rows < 1:
        raise ValueError(f"decode_rows_per_rank: {rows} rows")
    saved, _decode_rows = _decode_rows, rows
    try:
        yield
    finally:
        _decode_rows = saved


def sparse_split_for(rows: int, head_blocks: int, picks: int, sms: int) -> int:
    """Picks per split of a sparse MLA row: the largest of :data:`SPARSE_SPLITS` with which
    ``rows`` rows fill nine tenths of ``sms`` SMs (one program per row, head block and split: a
    program of 64 heads holds a whole SM), else the smallest. Measured on the H200 at 32k context,
    2048 picks, 128 heads (bench/results/decode_rows_h200.*): 1024 picks per split take 168 µs from
    4 to 32 rows; 512 at 16 rows 94 µs, 256 at 8 rows 54 µs, 128 at 4 rows 33 µs."""
    for split in SPARSE_SPLITS:
        if rows * head_blocks * -(-picks // split) >= 0.9 * sms:
            return split
    return SPARSE_SPLITS[-1]


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SMS


def sparse_tiles(heads: int, picks: int, device: torch.device) -> MlaTiles:
    """:data:`SPARSE_MLA_TILES`, its split chosen for :func:`decode_rows_per_rank` if set."""
    if _decode_rows is None:
        return SPARSE_MLA_TILES
    blocks = heads // mla_heads_per_program(heads, SPARSE_MLA_TILES)
    return dataclasses.replace(SPARSE_MLA_TILES,
                               sparse_split=sparse_split_for(_decode_rows, blocks, picks, _sms(device)))


def gqa_tiles(row_mode: bool, fp8: bool) -> GqaTiles:
    return (GQA_FP8_TILES if fp8 else GQA_TILES) if row_mode else GQA_PREFILL_TILES


def mla_tiles(row_mode: bool, ds_mla: bool, sparse: bool) -> MlaTiles:
    if sparse:
        return SPARSE_MLA_TILES
    return (MLA_FP8_TILES if ds_mla else MLA_TILES) if row_mode else MLA_PREFILL_TILES


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _hopper(device_index: int | None) -> bool:
    """Whether CUDA device ``device_index`` is sm_90 (asked once per device: the check runs on
    every sparse MLA call)."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def gluon_sparse_fits(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, ds_mla: bool) -> bool:
    """Whether sparse MLA runs :func:`pcppass.engine.attention.gluon_kernels.sparse_mla_kernel`:
    compiled Triton (not the interpreter) on a Hopper GPU (sm_90: warp-group MMA and 227 KB of
    shared memory per program), fp8_ds_mla rows of DeepSeek's widths (512 latent + 64 RoPE dims)
    starting at multiples of 16 bytes (16-byte copies), bf16 queries, heads in blocks of 64."""
    return q_lat.shape[1] % 64 == 0 and _gluon_ds_mla_rows(q_lat, q_pe, cache, ds_mla)


def _gluon_ds_mla_rows(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, ds_mla: bool) -> bool:
    """What both Gluon MLA kernels need: compiled Triton on sm_90, bf16 queries of 512 + 64 dims,
    656-byte fp8_ds_mla rows starting at multiples of 16 bytes."""
    from triton import knobs

    size = cache.element_size()
    return (ds_mla and q_lat.is_cuda and not knobs.runtime.interpret and _hopper(q_lat.device.index)
            and q_lat.dtype == q_pe.dtype == torch.bfloat16 and q_lat.shape[2] == 512 and q_pe.shape[2] == 64
            and cache.shape[-1] * size == 656 and cache.data_ptr() % 16 == 0
            and cache.stride(0) * size % 16 == 0 and cache.stride(1) * size % 16 == 0)


def gluon_dense_fits(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, ds_mla: bool,
                     tiles: Tiles) -> bool:
    """Whether dense MLA runs :func:`pcppass.engine.attention.gluon_kernels.dense_mla_kernel`: as
    :func:`gluon_sparse_fits` (sm_90, compiled Triton, fp8_ds_mla rows of DeepSeek's widths at
    16-byte multiples, bf16 queries), for decode rows (one program per row) of at most
    :data:`DENSE_GLUON_HEADS` heads or blocks of them, over a cache whose blocks are contiguous, of a
    power-of-two size, under 2^31 rows (its TMA copies address the rows as one 2-D tensor by int32
    row)."""
    heads = q_lat.shape[1]
    nb, bs = cache.shape[0], cache.shape[1]
    return (tiles.row_mode and (heads <= DENSE_GLUON_HEADS or heads % DENSE_GLUON_HEADS == 0)
            and bs & (bs - 1) == 0 and cache.stride(0) == bs * cache.stride(1) and nb * bs < 1 << 31
            and _gluon_ds_mla_rows(q_lat, q_pe, cache, ds_mla))


def kernels(name: str = "triton_kernels") -> ModuleType:
    """The Triton kernel module ``name`` of this package for the Triton mode in force
    (``TRITON_INTERPRET=1``: interpreted)."""
    from triton import knobs

    return _kernel_module(name, bool(knobs.runtime.interpret))


@functools.cache
def _kernel_module(name: str, interpret: bool) -> ModuleType:
    """A second copy of the module is imported when interpreting, so compiled and interpreted
    kernels never mix (``triton.jit`` picks its mode when it decorates)."""
    if not interpret:
        return importlib.import_module(f"pcppass.engine.attention.{name}")
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"pcppass.engine.attention.{name}_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Tiles:
    """Program tiles of a step: per tile its request, first row and number of rows (0: idle)."""

    row_mode: bool
    rows_per_tile: int
    count: int
    req: torch.Tensor | None = None
    row0: torch.Tensor | None = None
    nrows: torch.Tensor | None = None


def tile_schedule(query_start_loc: torch.Tensor, num_rows: int, rows_per_tile: int) -> Tiles:
    """Tiles of ``rows_per_tile`` consecutive rows of one local request, computed on the device.

    ``query_start_loc [R + 1]`` gives each request's rows; the number of tiles is at most
    ``ceil(T / rows_per_tile) + R`` (every request adds at most one partial tile), so the grid has a
    size known from the shapes; tiles past the last one have 0 rows.
    """
    if num_rows <= ROW_MODE_MAX_ROWS or rows_per_tile == 1:
        return Tiles(True, 1, num_rows)
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    per_req = (ends - starts + rows_per_tile - 1) // rows_per_tile
    last = torch.cumsum(per_req, 0)
    count = -(-num_rows // rows_per_tile) + starts.shape[0]
    tile = torch.arange(count, device=query_start_loc.device)
    req = torch.searchsorted(last, tile, right=True).clamp_max(starts.shape[0] - 1)
    row0 = starts[req] + (tile - (last[req] - per_req[req])) * rows_per_tile
    nrows = torch.where(tile < last[-1], torch.minimum(ends[req] - row0, torch.full_like(row0, rows_per_tile)), 0)
    return Tiles(False, rows_per_tile, count, req, row0, nrows)


@dataclass(frozen=True)
class StepRows:
    """The step meta the kernels read (contract names)."""

    tables: torch.Tensor
    positions: torch.Tensor
    token_to_req: torch.Tensor
    query_start_loc: torch.Tensor
    is_padding: torch.Tensor

    def tile_args(self, tiles: Tiles) -> tuple:
        dummy = self.positions
        return (self.positions, self.token_to_req, self.is_padding,
                tiles.req if tiles.req is not None else dummy,
                tiles.row0 if tiles.row0 is not None else dummy,
                tiles.nrows if tiles.nrows is not None else dummy)


def _splits(tiles: Tiles, span: int, split: int) -> tuple[int, int]:
    """(number of splits, keys per split): fixed ranges in row mode, one split in tile mode."""
    if tiles.row_mode and span > split:
        return -(-span // split), split
    return 1, NO_SPLIT


def _outputs(t: int, heads: int, dv: int, splits: int, dtype: torch.dtype, device) -> tuple:
    """(out, partial outputs, partial max/sum); the output is zeroed when written directly
    (padding rows are never visited)."""
    if splits == 1:
        dummy = torch.empty(1, dtype=torch.float32, device=device)
        return torch.zeros(t, heads, dv, dtype=dtype, device=device), dummy, dummy
    part_o = torch.empty(t * heads * splits * dv, dtype=torch.float32, device=device)
    part_ml = torch.empty(t * heads * splits * 2, dtype=torch.float32, device=device)
    return torch.empty(t, heads, dv, dtype=dtype, device=device), part_o, part_ml


def _combine(out, part_o, part_ml, is_padding, splits: int) -> None:
    t, heads, dv = out.shape
    if splits > 1 and t > 0:
        kernels().combine_kernel[(t, heads)](part_o, part_ml, is_padding, out, splits, heads, out.stride(0),
                                             out.stride(1), DV=dv, SP=_pow2(splits))


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit stride in its last dim (the kernels index the other dims by stride)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _ieee(dtype: torch.dtype) -> bool:
    return dtype == torch.float32


#: the most block-table entries a program holds in registers
MAX_BLOCKS_IN_REGISTERS = 4096


def _split_blocks(per_row: bool, split: int, block_size: int) -> int:
    """Table entries a per-row split of ``split`` keys spans, a power of two (0: tiles of rows, a
    single split, or too many to hold in registers: the kernel loads each key tile's block ids)."""
    n = _pow2(-(-split // block_size) + 1)
    return n if per_row and split != NO_SPLIT and n <= MAX_BLOCKS_IN_REGISTERS else 0


def _table_row_in_registers(tables: torch.Tensor, tiles: Tiles, split: int) -> int:
    """Entries of a whole block-table row, a power of two, for sparse rows whose split of picks
    (a power of two) is held in registers too (0: one split per row, or too many entries)."""
    n = _pow2(tables.shape[1])
    fits = n <= MAX_BLOCKS_IN_REGISTERS and split <= MAX_BLOCKS_IN_REGISTERS and split == _pow2(split)
    return n if tiles.row_mode and split != NO_SPLIT and fits else 0


def _half(dtype: torch.dtype) -> bool:
    """A 16-bit query, whose values float16 holds once scaled per lane (float32 queries keep their
    exact float32 dots)."""
    return dtype in (torch.bfloat16, torch.float16)


def gqa_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: StepRows, scale: float,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  tiles: GqaTiles | None = None) -> torch.Tensor:
    """Causal paged GQA attention: ``q [T, H, D]``, caches ``[nb, bs, Hk, D]`` (fp8 caches with
    per-tensor ``k_scale`` / ``v_scale``) -> ``[T, H, Dv]`` in ``q``'s dtype."""
    q = _rows_of(q)
    t, heads, d = q.shape
    _, bs, kv_heads, dv = v_cache.shape
    group = heads // kv_heads
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.uint8)
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    rows_per_tile = max(1, TILE_M // group)
    schedule = tile_schedule(rows.query_start_loc, t, rows_per_tile)
    launch_shape = tiles or gqa_tiles(schedule.row_mode, fp8)
    span = rows.tables.shape[1] * bs
    splits, split = _splits(schedule, span, GQA_SPLIT)
    out, part_o, part_ml = _outputs(t, heads, dv, splits, q.dtype, q.device)
    bm = schedule.rows_per_tile
    if schedule.count:
        dummy = part_ml
        kernels().gqa_kernel[(schedule.count, kv_heads, splits)](
            q, k_cache, v_cache, rows.tables, *rows.tile_args(schedule), out, part_o, part_ml,
            k_scale if fp8 else dummy, v_scale if fp8 else dummy, scale * 1.4426950408889634, splits, heads,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), rows.tables.stride(0),
            out.stride(0), out.stride(1),
            BLOCK_SIZE=bs, GROUP=group, BM=bm, M=max(MIN_DOT, _pow2(bm * group)), BN=launch_shape.bn, D=d, DV=dv,
            SPLIT=split, ROW_MODE=schedule.row_mode, FP8=fp8, DIRECT=splits == 1, IEEE=_ieee(q.dtype),
            F16_DOTS=fp8 and launch_shape.f16_dots and _half(q.dtype),
            NBLK=_split_blocks(schedule.row_mode, split, bs) if launch_shape.table_in_registers else 0,
            num_warps=launch_shape.warps, num_stages=launch_shape.stages,
        )
    _combine(out, part_o, part_ml, rows.is_padding, splits)
    return out


def mla_heads_per_program(heads: int, tiles: MlaTiles | None = None) -> int:
    """Heads stacked in one MLA program: all of them up to ``tiles.heads`` (accumulator
    ``[heads, 512]`` in registers), else blocks of ``tiles.heads``."""
    most = (tiles or MLA_TILES).heads
    return heads if heads <= most else most


def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, rows: StepRows, scale: float,
                  ds_mla: bool, index: torch.Tensor | None = None, tiles: MlaTiles | None = None) -> torch.Tensor:
    """MLA attention in the latent space over a paged latent cache -> ``[T, H, L]`` in ``q_lat``'s dtype.

    ``cache``: ``[nb, bs, L + R]`` (model dtype) or, ``ds_mla``, uint8 ``[nb, bs, L + 4L/128 + 2R]``.
    ``index [T, K]`` (sparse): each row attends to those logical positions only (``-1``: unused).
    """
    q_lat, q_pe = _rows_of(q_lat), _rows_of(q_pe)
    sparse = index is not None
    t, heads, lat = q_lat.shape
    if lat > 128 and lat % 128 or lat // 128 not in (0, 1, 2, 4) or lat < 128 and lat & (lat - 1):
        raise ValueError(f"mla_attention: latent width {lat}: a power of two up to 128, or 256 or 512")
    rope = q_pe.shape[2]
    nb, bs = cache.shape[0], cache.shape[1]
    group = mla_heads_per_program(heads, tiles or mla_tiles(True, ds_mla, sparse))
    if heads % group:
        raise ValueError(f"mla_attention: {heads} heads are not a multiple of {group}")
    schedule = tile_schedule(rows.query_start_loc, t, 1 if sparse else max(1, TILE_M // group))
    if tiles is None:
        tiles = sparse_tiles(heads, index.shape[1], q_lat.device) if sparse else mla_tiles(schedule.row_mode,
                                                                                             ds_mla, False)
    if mla_heads_per_program(heads, tiles) != group:
        raise ValueError(f"mla_attention: launch shape {tiles} stacks a different number of heads")
    span = index.shape[1] if sparse else rows.tables.shape[1] * bs
    if not sparse and tiles.gluon and gluon_dense_fits(q_lat, q_pe, cache, ds_mla, schedule):
        return dense_mla_gluon(q_lat, q_pe, cache, rows, scale)
    splits, split = _splits(schedule, span, tiles.sparse_split if sparse else MLA_SPLIT)
    out, part_o, part_ml = _outputs(t, heads, lat, splits, q_lat.dtype, q_lat.device)
    if ds_mla:
        flat = cache.view(torch.uint8).reshape(nb, bs, -1)
        scales, rope_bytes = flat.view(torch.float32), flat.view(torch.bfloat16)
    else:
        flat = scales = rope_bytes = cache
    bm = schedule.rows_per_tile
    if sparse and tiles.gluon and gluon_sparse_fits(q_lat, q_pe, cache, ds_mla):
        sparse_mla_gluon(q_lat, q_pe, cache, rows, index, out, part_o, part_ml, scale, splits,
                         tiles.sparse_split if splits == 1 else split)
    elif schedule.count:
        kernels().mla_kernel[(schedule.count, heads // group, splits)](
            q_lat, q_pe, flat, scales, rope_bytes, rows.tables, *rows.tile_args(schedule),
            index if sparse else rows.positions, out, part_o, part_ml, scale * 1.4426950408889634, splits, heads,
            span if sparse else 0, rows.tables.shape[1],
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), flat.stride(0), flat.stride(1),
            rows.tables.stride(0), index.stride(0) if sparse else 0, out.stride(0), out.stride(1),
            BLOCK_SIZE=bs, GROUP=group, BM=bm, M=max(MIN_DOT, _pow2(bm * group)), BN=tiles.bn, L=lat, R=rope,
            RP=max(MIN_DOT, _pow2(rope)), SPLIT=split, ROW_MODE=schedule.row_mode, DS_MLA=ds_mla, SPARSE=sparse,
            DIRECT=splits == 1, IEEE=_ieee(q_lat.dtype),
            NBLK=(_table_row_in_registers(rows.tables, schedule, split) if sparse
                  else _split_blocks(schedule.row_mode, split, bs))
            if tiles.table_in_registers else 0,
            SEPARATE_LOADS=ds_mla and not sparse and tiles.separate_loads and not tiles.dequant_tile,
            DEQUANT=ds_mla and tiles.dequant_tile,
            num_warps=tiles.warps or (8 if bm * group >= 32 else 4), num_stages=tiles.stages,
        )
    _combine(out, part_o, part_ml, rows.is_padding, splits)
    return out


def sparse_mla_gluon(q_lat, q_pe, cache, rows: StepRows, index, out, part_o, part_ml, scale: float, splits: int,
                     split: int) -> None:
    """:func:`~pcppass.engine.attention.gluon_kernels.sparse_mla_kernel` over fp8_ds_mla rows
    ``cache [nb, bs, 656]``: one program per (row, 64 heads, split of ``split`` picks), into ``out``
    (one split) or the partial outputs that :func:`_combine` merges (the caller's)."""
    t, heads, _ = q_lat.shape
    flat = cache.view(torch.uint8).reshape(cache.shape[0], cache.shape[1], -1)
    if t:
        kernels("gluon_kernels").sparse_mla_kernel[(t, heads // 64, splits)](
            q_lat, q_pe, flat.view(torch.float32), flat.view(torch.bfloat16), rows.tables, rows.token_to_req,
            rows.is_padding, index, out, part_o, part_ml, scale * 1.4426950408889634, splits, heads, index.shape[1],
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), flat.stride(0), flat.stride(1),
            rows.tables.stride(0), index.stride(0), out.stride(0), out.stride(1),
            BLOCK_SIZE=flat.shape[1], SPLIT=split, DIRECT=splits == 1, num_warps=4,
        )


def dense_mla_gluon(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, rows: StepRows, scale: float,
                    split: int | None = None, **shape) -> torch.Tensor:
    """:func:`~pcppass.engine.attention.gluon_kernels.dense_mla_kernel` over fp8_ds_mla rows
    ``cache [nb, bs, 656]``, decode rows: one program per (row, block of up to
    :data:`DENSE_GLUON_HEADS` heads, split of ``split`` keys, default :data:`DENSE_GLUON_SPLIT`),
    merged by :func:`_combine` -> ``[T, H, 512]``. ``shape``: the kernel's launch constants
    (``DEQUANT_WARP_REGS``, ...) for benchmarks; the defaults are the measured ones."""
    t, heads, lat = q_lat.shape
    split = split or DENSE_GLUON_SPLIT
    flat = cache.view(torch.uint8).reshape(cache.shape[0], cache.shape[1], -1)
    splits = max(1, -(-rows.tables.shape[1] * cache.shape[1] // split))
    out, part_o, part_ml = _outputs(t, heads, lat, splits, q_lat.dtype, q_lat.device)
    group = min(heads, DENSE_GLUON_HEADS)
    if t:
        gluon = kernels("gluon_kernels")
        box = min(flat.shape[1], gluon.DENSE_BN)
        gluon.dense_mla_kernel[(t, heads // group, splits)](
            q_lat, q_pe, *gluon.dense_descriptors(flat, box), rows.tables, rows.positions, rows.token_to_req,
            rows.is_padding, out, part_o, part_ml, scale * 1.4426950408889634, splits, heads,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), rows.tables.stride(0), out.stride(0),
            out.stride(1),
            BLOCK_SIZE=flat.shape[1], SPLIT=split, GROUP=group, R=box, H=DENSE_GLUON_HEADS, DIRECT=splits == 1,
            num_warps=4, **shape,
        )
    _combine(out, part_o, part_ml, rows.is_padding, splits)
    return out


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, rows: StepRows,
                   quant_block_size: int, tiles: IndexerTiles | None = None) -> torch.Tensor:
    """Lightning-indexer scores ``[T, span]`` (float32, -inf where not visible) from the fp8
    block-split indexer cache ``[nb, bs * (D + 4D/qbs)]``; ``q [T, Hi, D]``, ``weights [T, Hi]``.
    An e4m3 ``q`` (its scales folded into ``weights``, :func:`pcppass.ops.quant.quantize_indexer_query`)
    meets the key codes in an fp8 dot where a token has one key scale (``D == qbs``)."""
    q, weights = _rows_of(q), _rows_of(weights)
    if q.dtype == torch.float8_e4m3fn and (q.shape[2] != quant_block_size or q.shape[2] < 32):
        # several key scales per token, or a head narrower than an fp8 MMA's K (32): the float32
        # path over the same values
        q = q.float()
    q_fp8 = q.dtype == torch.float8_e4m3fn
    tiles = tiles or INDEXER_TILES
    t, heads, d = q.shape
    nb = cache.shape[0]
    per_token = d + 4 * (d // quant_block_size)
    bs = cache.shape[1] // per_token
    flat = cache.view(torch.uint8).reshape(nb, bs * per_token)
    span = rows.tables.shape[1] * bs
    scores = torch.full((t, span), float("-inf"), dtype=torch.float32, device=q.device)
    if t:
        kernels().indexer_kernel[(t, -(-span // tiles.chunk))](
            q.view(torch.uint8) if q_fp8 else q, weights, flat, flat.view(torch.float32), rows.tables,
            rows.positions, rows.token_to_req, rows.is_padding, scores, span, q.stride(0), q.stride(1),
            weights.stride(0), flat.stride(0), rows.tables.stride(0), scores.stride(0),
            BLOCK_SIZE=bs, HI=heads, HP=max(MIN_DOT, _pow2(heads)), D=d, QBS=quant_block_size, BN=tiles.bn,
            CHUNK=tiles.chunk, IEEE=_ieee(q.dtype), Q_FP8=q_fp8,
            NBLK=_split_blocks(True, tiles.chunk, bs) if tiles.table_in_registers else 0,  # programs per (row, chunk)
            num_warps=tiles.warps, num_stages=tiles.stages,
        )
    return scores


def _monotonic(x: float) -> int:
    bits = struct.unpack("<i", struct.pack("<f", x))[0]
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


#: the high half of :func:`ordered_keys` for a -inf score (a position nothing may pick)
_NEG_INF_MONOTONIC = _monotonic(float("-inf"))


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered like ``(score, -position)``: the float32 bits made monotonic (negative
    values' magnitude bits flipped) in the high half, ``span - 1 - position`` in the low half, so
    the largest keys are the largest scores, the lowest position first among exact ties."""
    bits = scores.contiguous().view(torch.int32)
    monotonic = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)
    span = scores.shape[1]
    tiebreak = span - 1 - torch.arange(span, device=scores.device, dtype=torch.int64)
    return (monotonic << 32) | tiebreak


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Logical positions of the ``k`` largest scores per row, ascending, ``-1`` for picks with no
    visible candidate (score -inf): the set the reference's stable sort picks (the lowest positions
    among equal scores), chosen by ``torch.topk`` over :func:`ordered_keys` (a radix select: the
    context is never sorted); only the ``k`` picks are sorted, so their order depends on the set
    alone. No host reads, fixed shapes. (Measured on the H200 against a k-th-score threshold with a
    running count over the row: faster at every shape of docs/BENCH.md.)"""
    if scores.shape[1] < k:
        scores = torch.cat((scores, scores.new_full((scores.shape[0], k - scores.shape[1]), float("-inf"))), 1)
    span = scores.shape[1]
    keys = torch.topk(ordered_keys(scores), k, dim=1, sorted=False).values
    position = span - 1 - (keys & 0xFFFFFFFF)
    return torch.sort(torch.where((keys >> 32) > _NEG_INF_MONOTONIC, position, -1), dim=1).values
