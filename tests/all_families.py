"""A small model that writes through every write family pcppass covers, for property tests.

``AllFamiliesLM`` follows :mod:`pcppass.contract` (``forward(input_ids, positions, meta,
caches)``). Each step it writes, from per-row features of ``input_ids`` and ``positions`` (elementwise
only, so a row's bytes never depend on which other rows share its batch):

==================  =========================================  ================  =========================
family              op                                         cache(s)          group (addressing)
==================  =========================================  ================  =========================
GQA K/V, fp8        ``reshape_and_cache_flash`` ("fp8")         ``gqa_k/gqa_v``   ``kv`` (full, bs 4)
MLA latent          ``concat_and_cache_mla`` ("auto", bf16)     ``mla``           ``kv``
MLA fp8_ds_mla      ``concat_and_cache_mla`` ("fp8_ds_mla")     ``mla_ds``        ``kv``
indexer K           ``indexer_k_quant_and_cache`` (block-split) ``indexer``       ``idx`` (full, bs 8)
V3.2 fused          ``fused_norm_rope`` (Q returned)            ``v32_mla``,      ``kv`` and ``idx``
                                                                ``v32_indexer``
V4 sliding window   ``swa_qnorm_rope_kv_insert`` (Q returned)   ``swa``           ``swa`` (ring, window 4)
V4 compressor 4     ``compressor_save_state`` + ``compress_     ``c4_state``,     ``c4_state`` (ring) and
(overlap, "auto")   store`` (re-run)                            ``c4_kv``         ``c4`` (compressed)
V4 compressor 2     the same, "fp8_indexer" compressed rows     ``c2_state``,     ``c2_state`` / ``c2``
                                                                ``c2_indexer``
aten (HF Static-    ``static_k.index_copy_(2, index, k)``       ``static_k``      ``meta["aten_index"]``
Cache)
==================  =========================================  ================  =========================

The aten write follows Python indexing (slot -1 would be the last row), so it is addressed by its
own ``meta["aten_index"]``: a real row's ``kv`` slot, a padding row a scratch slot of its own rank
(:func:`aten_index`), past the slots real rows use; the replica sync copies scratch rows like any
other. The reference single-rank run writes other scratch rows: :func:`state_digests` digests the
scratch part of ``static_k`` separately.

The returned "hidden" rows are int64 checksums ``[T, checks]``: for every cache, a weighted sum of
the bytes of every row the step's row may read (positions ``<= p`` of its request in full groups,
the window in ring groups, the closed compressed rows), and of the fused ops' Q outputs. Integer
sums are exact and order-free, so a row's checksum equals the single-rank run's bit for bit when,
and only when, its replica held the right bytes when the row read them.
"""

from __future__ import annotations

import torch
from torch import nn

import pcppass.ops  # noqa: F401  (registers torch.ops.pcppass.*)
from pcppass.contract import CacheGroupSpec, slot_key, table_key
from pcppass.engine.runner import tensor_digest
from pcppass.ops.quant import ds_mla_row_bytes, indexer_token_bytes

VOCAB, FEATURES = 64, 256
#: most positions one request reaches in a scenario, and most one step adds to one request
MAX_POSITIONS, MAX_STEP_POSITIONS = 24, 8
#: most requests one scenario admits (blocks are never reused within a scenario)
MAX_REQUESTS = 6
#: largest local row count a scenario produces (per rank, padding included)
MAX_LOCAL_ROWS = 20
MAX_WORLD = 4
ROPE_POSITIONS = 32

H, D = 2, 8  # GQA heads and head dim (also the aten StaticCache-like cache)
L_DS, R_DS = 128, 16  # fp8_ds_mla latent (one 128-wide tile) and RoPE widths
L_AUTO, R_AUTO = 16, 8
INDEXER_D, QBS = 32, 16
SWA_HEADS, SWA_D, SWA_ROT = 2, 16, 8
C4_HD, C2_HD = 16, 32

GROUPS = (
    CacheGroupSpec("kv", 4),
    CacheGroupSpec("idx", 8),
    CacheGroupSpec("swa", 4, "ring", window=4),
    CacheGroupSpec("c4_state", 4, "ring", window=8),  # overlap: a compressed row reads 2 * 4 states
    CacheGroupSpec("c4", 4, "compressed", ratio=4),
    CacheGroupSpec("c2_state", 8, "ring", window=2),
    CacheGroupSpec("c2", 4, "compressed", ratio=2),
)
GROUP = {g.name: g for g in GROUPS}


def table_columns(group: str) -> int:
    """Blocks one request holds in ``group`` (fixed: the block table's width)."""
    g = GROUP[group]
    if g.addressing == "ring":
        return g.ring_blocks(MAX_STEP_POSITIONS)
    return g.blocks_for(MAX_POSITIONS, MAX_STEP_POSITIONS)


def num_blocks(group: str) -> int:
    """Block 0 is the null block; every request of a scenario gets blocks of its own."""
    return 1 + MAX_REQUESTS * table_columns(group)


#: slots of ``static_k`` real rows use (the ``kv`` group's); scratch slots follow, one per
#: (rank, local row)
ATEN_REAL_SLOTS = num_blocks("kv") * GROUP["kv"].block_size
ATEN_SLOTS = ATEN_REAL_SLOTS + MAX_WORLD * MAX_LOCAL_ROWS


def aten_index(kv_slots: list[int], rank: int) -> list[int]:
    """``static_k`` index of each local row: its ``kv`` slot, or for a padding row (slot -1) a
    scratch slot no other row of any rank writes."""
    return [s if s >= 0 else ATEN_REAL_SLOTS + rank * MAX_LOCAL_ROWS + t for t, s in enumerate(kv_slots)]


def _indexer_block_bytes(bs: int, head_dim: int) -> int:
    return bs * indexer_token_bytes(head_dim, QBS)


def allocate_caches() -> dict[str, torch.Tensor]:
    def paged(group: str, *row: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros((num_blocks(group), GROUP[group].block_size, *row), dtype=dtype)

    def block_split(group: str, head_dim: int) -> torch.Tensor:
        return torch.zeros((num_blocks(group), _indexer_block_bytes(GROUP[group].block_size, head_dim)),
                           dtype=torch.uint8)

    return {
        "gqa_k": paged("kv", H, D, dtype=torch.float8_e4m3fn),
        "gqa_v": paged("kv", H, D, dtype=torch.float8_e4m3fn),
        "mla": paged("kv", L_AUTO + R_AUTO, dtype=torch.bfloat16),
        "mla_ds": paged("kv", ds_mla_row_bytes(L_DS, R_DS), dtype=torch.uint8),
        "indexer": block_split("idx", INDEXER_D),
        "v32_mla": paged("kv", ds_mla_row_bytes(L_DS, R_DS), dtype=torch.uint8),
        "v32_indexer": block_split("idx", INDEXER_D),
        "swa": paged("swa", SWA_D, dtype=torch.bfloat16),
        "c4_state": paged("c4_state", 2 * 2 * C4_HD, dtype=torch.float32),
        "c4_kv": paged("c4", C4_HD, dtype=torch.bfloat16),
        "c2_state": paged("c2_state", 2 * C2_HD, dtype=torch.float32),
        "c2_indexer": block_split("c2", C2_HD),
        "static_k": torch.zeros((1, H, ATEN_SLOTS, D), dtype=torch.bfloat16),
    }


def state_digests(caches: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of every cache; ``static_k`` as its real slots and its padding scratch slots."""
    out = {name: tensor_digest(t) for name, t in caches.items() if name != "static_k"}
    static = caches["static_k"]
    out["static_k"] = tensor_digest(static[:, :, :ATEN_REAL_SLOTS])
    out["static_k[scratch]"] = tensor_digest(static[:, :, ATEN_REAL_SLOTS:])
    return out


def _rope_table(rot_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    angles = torch.outer(torch.arange(ROPE_POSITIONS, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.float32)


# ------------------------------------------------------------------------------ the readout


def _row_bytes(rows: torch.Tensor) -> torch.Tensor:
    """``[T, S, ...]`` of any dtype -> ``[T, S, bytes]`` uint8."""
    return rows.reshape(rows.shape[0], rows.shape[1], -1).contiguous().view(torch.uint8)


def _checksum(row_bytes: torch.Tensor, logical: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Exact int64 checksum per row of ``row_bytes [T, S, B]`` at logical indices ``[T, S]``."""
    byte_weight = torch.arange(1, row_bytes.shape[2] + 1, device=row_bytes.device)
    weighted = (row_bytes.long() + 1) * byte_weight * (logical.unsqueeze(-1) + 1)
    return weighted.masked_fill(~valid.unsqueeze(-1), 0).sum(dim=(1, 2))


def _paged_rows(cache: torch.Tensor, tables: torch.Tensor, index: torch.Tensor, bs: int) -> torch.Tensor:
    blocks = tables.gather(1, torch.div(index, bs, rounding_mode="floor"))
    return cache[blocks, index % bs]


def _block_split_rows(cache: torch.Tensor, tables: torch.Tensor, index: torch.Tensor, bs: int,
                      head_dim: int) -> torch.Tensor:
    """Bytes of each token of a block-split cache: its ``head_dim`` codes, then its scale bytes."""
    codes = cache[:, : bs * head_dim].unflatten(1, (bs, head_dim))
    scales = cache[:, bs * head_dim:].unflatten(1, (bs, -1))
    blocks = tables.gather(1, torch.div(index, bs, rounding_mode="floor"))
    offsets = index % bs
    return torch.cat((codes[blocks, offsets], scales[blocks, offsets]), dim=-1)


def _full_index(meta, group: str, positions: torch.Tensor):
    """Every logical position of a full-addressed group a row may read: ``<= p``."""
    tables = meta[table_key(group)][meta["token_to_req"]]
    span = tables.shape[1] * GROUP[group].block_size
    index = torch.arange(span, device=positions.device).unsqueeze(0).expand(tables.shape[0], span)
    return tables, index, index, index <= positions.unsqueeze(1)


def _ring_index(meta, group: str, positions: torch.Tensor):
    """The window ``(p - window, p]`` through the request's ring."""
    g = GROUP[group]
    tables = meta[table_key(group)][meta["token_to_req"]]
    back = torch.arange(g.window, device=positions.device).unsqueeze(0)
    logical = positions.unsqueeze(1) - back
    ring = logical.clamp_min(0) % (tables.shape[1] * g.block_size)
    return tables, ring, logical, logical >= 0


def _compressed_index(meta, group: str, positions: torch.Tensor):
    """Compressed rows whose group closed at or before ``p``."""
    g = GROUP[group]
    tables = meta[table_key(group)][meta["token_to_req"]]
    span = tables.shape[1] * g.block_size
    index = torch.arange(span, device=positions.device).unsqueeze(0).expand(tables.shape[0], span)
    return tables, index, index, (index + 1) * g.ratio - 1 <= positions.unsqueeze(1)


# ------------------------------------------------------------------------------ the model


class AllFamiliesLM(nn.Module):
    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def param(*shape: int, scale: float = 1.0) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=gen) * scale, requires_grad=False)

        self.embed = param(VOCAB, FEATURES)
        self.freqs = param(FEATURES, scale=0.3)
        self.q_norm = param(32, scale=0.2)
        self.kv_norm = param(L_DS, scale=0.2)
        self.index_norm_weight = param(INDEXER_D, scale=0.2)
        self.index_norm_bias = param(INDEXER_D, scale=0.1)
        self.c4_ape = param(4, 2 * C4_HD)
        self.c4_norm = param(C4_HD, scale=0.2)
        self.c2_ape = param(2, C2_HD)
        self.c2_norm = param(C2_HD, scale=0.2)
        self.register_buffer("fp8_scale", torch.tensor(0.02))
        self.register_buffer("unit_scale", torch.tensor(1.0))
        self.register_buffer("rope16", _rope_table(16), persistent=False)
        self.register_buffer("rope8", _rope_table(8), persistent=False)

    def cache_groups(self) -> list[CacheGroupSpec]:
        return list(GROUPS)

    def forward(self, input_ids, positions, meta, caches):
        ops = torch.ops.pcppass
        t = input_ids.shape[0]
        x = self.embed[input_ids] + torch.sin(positions.unsqueeze(1).float() * self.freqs)
        kv_slots, idx_slots = meta[slot_key("kv")], meta[slot_key("idx")]

        ops.reshape_and_cache_flash(x[:, 0:16].reshape(t, H, D), x[:, 16:32].reshape(t, H, D) * 2,
                                    caches["gqa_k"], caches["gqa_v"], kv_slots, "fp8", self.fp8_scale,
                                    self.fp8_scale)
        ops.concat_and_cache_mla(x[:, 32:48], x[:, 48:56], caches["mla"], kv_slots, "auto", self.unit_scale)
        ops.concat_and_cache_mla(x[:, 64:192], x[:, 192:208], caches["mla_ds"], kv_slots, "fp8_ds_mla",
                                 self.unit_scale)
        ops.indexer_k_quant_and_cache(x[:, 208:240] * 3, caches["indexer"], idx_slots, QBS, "ue8m0")
        q32 = ops.fused_norm_rope(
            positions, x[:, 100:132], self.q_norm, 1e-6, x[:, 120:248], self.kv_norm, 1e-6, x[:, 0:16],
            self.rope16, x[:, 40:72], self.index_norm_weight, self.index_norm_bias, 1e-6, self.rope16,
            kv_slots, idx_slots, caches["v32_mla"], caches["v32_indexer"], "fp8_ds_mla", self.unit_scale, QBS,
        )
        q4 = ops.swa_qnorm_rope_kv_insert(x[:, 72:104].reshape(t, SWA_HEADS, SWA_D), x[:, 150:166],
                                          caches["swa"], meta[slot_key("swa")], positions, self.rope8, 1e-6)
        ops.compressor_save_state(x[:, 170:202], x[:, 202:234], self.c4_ape, positions, caches["c4_state"],
                                  meta[slot_key("c4_state")], 4)
        ops.compressor_compress_store(positions, caches["c4_state"], meta[table_key("c4_state")][meta["token_to_req"]],
                                      self.c4_norm, 1e-6, self.rope8, caches["c4_kv"], meta[slot_key("c4")], 4,
                                      True, "auto", QBS)
        ops.compressor_save_state(x[:, 10:42], x[:, 224:256], self.c2_ape, positions, caches["c2_state"],
                                  meta[slot_key("c2_state")], 2)
        ops.compressor_compress_store(positions, caches["c2_state"], meta[table_key("c2_state")][meta["token_to_req"]],
                                      self.c2_norm, 1e-6, self.rope8, caches["c2_indexer"], meta[slot_key("c2")], 2,
                                      False, "fp8_indexer", QBS)
        static_k = caches["static_k"]
        static_k.index_copy_(2, meta["aten_index"], x[:, 56:72].reshape(t, H, D).transpose(0, 1).unsqueeze(0).to(
            static_k.dtype))
        return self.readout(positions, meta, caches, q32, q4)

    def readout(self, positions, meta, caches, *q_outputs: torch.Tensor) -> torch.Tensor:
        sums = []
        for name, group, index_of, reader in (
            ("gqa_k", "kv", _full_index, None), ("gqa_v", "kv", _full_index, None),
            ("mla", "kv", _full_index, None), ("mla_ds", "kv", _full_index, None),
            ("v32_mla", "kv", _full_index, None),
            ("indexer", "idx", _full_index, INDEXER_D), ("v32_indexer", "idx", _full_index, INDEXER_D),
            ("swa", "swa", _ring_index, None), ("c4_state", "c4_state", _ring_index, None),
            ("c2_state", "c2_state", _ring_index, None),
            ("c4_kv", "c4", _compressed_index, None), ("c2_indexer", "c2", _compressed_index, C2_HD),
        ):
            tables, physical, logical, valid = index_of(meta, group, positions)
            bs = GROUP[group].block_size
            if reader is None:
                rows = _paged_rows(caches[name], tables, physical, bs)
            else:
                rows = _block_split_rows(caches[name], tables, physical, bs, reader)
            sums.append(_checksum(_row_bytes(rows), logical, valid))
        # the StaticCache-like cache is read at the kv group's slots
        tables, index, logical, valid = _full_index(meta, "kv", positions)
        bs = GROUP["kv"].block_size
        slots = tables.gather(1, torch.div(index, bs, rounding_mode="floor")) * bs + index % bs
        static_rows = caches["static_k"][0].transpose(0, 1)[slots]  # [T, S, H, D]
        sums.append(_checksum(_row_bytes(static_rows), logical, valid))
        for q in q_outputs:
            q_rows = q.reshape(q.shape[0], 1, -1)
            ones = torch.ones(q.shape[0], 1, dtype=torch.bool, device=q.device)
            sums.append(_checksum(_row_bytes(q_rows), torch.zeros_like(ones, dtype=torch.int64), ones))
        return torch.stack(sums, dim=1)
