"""Paged-attention cases shared by the interpreter tests (CPU) and the CUDA tests.

A case is a step over random paged caches: local requests with their own block tables (shuffled
blocks, so the table really is followed), rows of one request at consecutive positions (a prefill
chunk) or alone (decode), padding rows at the end. ``reference_*`` compute what the models' CPU
paths compute (:mod:`pcppass.models.common`: gather every visible row, attend in plain torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pcppass.engine.attention.launch import StepRows
from pcppass.ops.quant import decode_ds_mla_rows, dequant_fp8, encode_ds_mla_rows, encode_indexer_rows
from pcppass.models.common import (
    attend,
    causal_full_rows,
    gather_rows,
    indexer_scores,
    read_indexer_keys,
    select_topk,
)


@dataclass
class Step:
    rows: StepRows
    block_size: int
    num_blocks: int

    @property
    def live(self) -> torch.Tensor:
        return ~self.rows.is_padding

    def gathered(self, cache: torch.Tensor, index: torch.Tensor | None = None):
        """Rows of ``cache`` each query row sees, and which are visible: every position up to the
        row's own (``index`` None) or the given positions (-1: none)."""
        tables = self.rows.tables[self.rows.token_to_req]
        if index is None:
            index, valid = causal_full_rows(tables, self.rows.positions, self.block_size)
        else:
            valid = index >= 0
        return gather_rows(cache, tables, index.clamp_min(0), self.block_size), valid


def make_step(segments: list[tuple[int, int]], padding: int, block_size: int, columns: int, device="cpu",
              seed: int = 0) -> Step:
    """``segments``: (rows, first position) per local request; ``padding`` rows at the end."""
    g = torch.Generator().manual_seed(seed)
    positions, token_to_req, starts = [], [], [0]
    for k, (n, first) in enumerate(segments):
        positions += range(first, first + n)
        token_to_req += [k] * n
        starts.append(starts[-1] + n)
    t = len(positions) + padding
    positions += [0] * padding
    token_to_req += [0] * padding
    starts += [starts[-1]] * (t + 1 - len(starts))
    num_blocks = 1 + columns * len(segments)
    tables = torch.zeros(t, columns, dtype=torch.int64)
    for k in range(len(segments)):
        tables[k] = torch.randperm(num_blocks - 1, generator=g)[:columns] + 1
    is_padding = torch.zeros(t, dtype=torch.bool)
    is_padding[t - padding:] = True

    def dev(x):
        return torch.as_tensor(x, dtype=torch.int64).to(device)

    rows = StepRows(tables.to(device), dev(positions), dev(token_to_req), dev(starts), is_padding.to(device))
    return Step(rows, block_size, num_blocks)


def reference_gqa(step: Step, q, k_cache, v_cache, scale, k_scale=None, v_scale=None):
    k_rows, valid = step.gathered(k_cache)
    v_rows, _ = step.gathered(v_cache)
    if k_scale is not None:
        k_rows = dequant_fp8(k_rows, k_scale).to(q.dtype)
        v_rows = dequant_fp8(v_rows, v_scale).to(q.dtype)
    return attend(q, k_rows, v_rows, valid, scale)


def reference_mla(step: Step, q_lat, q_pe, cache, scale, latent: int, ds_mla: bool, index=None):
    """``softmax(q_lat . kv_c + q_pe . k_pe) @ kv_c`` over the visible (or selected) rows, float32."""
    rows, valid = step.gathered(cache, index)
    if ds_mla:
        kv_c, k_pe = decode_ds_mla_rows(rows, latent, q_pe.shape[-1])
    else:
        kv_c, k_pe = rows[..., :latent], rows[..., latent:]
    kv_c, k_pe = kv_c.to(q_lat.dtype).float(), k_pe.to(q_lat.dtype).float()
    scores = torch.einsum("thl,tsl->ths", q_lat.float(), kv_c) + torch.einsum("thr,tsr->ths", q_pe.float(), k_pe)
    scores = scores.mul(scale).masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("ths,tsl->thl", torch.softmax(scores, -1).nan_to_num(), kv_c)


def reference_indexer(step: Step, q, weights, cache, head_dim: int, quant_block_size: int, k: int):
    tables = step.rows.tables[step.rows.token_to_req]
    index, valid = causal_full_rows(tables, step.rows.positions, step.block_size)
    keys = read_indexer_keys(cache, tables, index, step.block_size, head_dim, quant_block_size)
    scores = indexer_scores(q, weights, keys, valid)
    return scores, select_topk(scores, k)


def mla_cache(step: Step, latent: int, rope: int, ds_mla: bool, dtype=torch.float32, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(step.num_blocks * step.block_size, latent + rope, generator=g)
    if ds_mla:
        rows = encode_ds_mla_rows(kv[:, :latent], kv[:, latent:])
    else:
        rows = kv.to(dtype)
    return rows.view(step.num_blocks, step.block_size, -1).to(device)


def indexer_cache(step: Step, head_dim: int, quant_block_size: int, device="cpu", seed=2, zero_every: int = 0):
    """Block-split fp8 indexer cache; ``zero_every``: every such key is all zeros (its score is
    exactly 0 for every query: ties that the top-k must break by position)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(step.num_blocks * step.block_size, head_dim, generator=g)
    if zero_every:
        keys[::zero_every] = 0
    codes, scales = encode_indexer_rows(keys, quant_block_size, "ue8m0")
    nb, bs = step.num_blocks, step.block_size
    return torch.cat((codes.view(nb, bs * head_dim), scales.view(nb, -1)), 1).to(device)


def kernel_vs_reference_run(model, engine_config: dict, workload_config) -> list[float]:
    """Serve a workload through the engine; every step runs the model's reference path on a copy of
    the caches and its kernel path on the caches, and records the largest difference of the hidden
    rows relative to the reference's largest value. The reference's writes are kept, so every step
    starts from the same caches. Returns the per-step errors."""
    from pcppass.engine import Engine, generate_workload
    from pcppass.models.common import force_paged_kernels

    errors = []

    def runner(ids, positions, meta, caches, step_kind):
        reference_caches = {k: v.clone() for k, v in caches.items()}
        with force_paged_kernels(False):
            reference = model(ids, positions, meta, reference_caches)
        with force_paged_kernels(True):
            out = model(ids, positions, meta, caches)
        live = ~meta["is_padding"]
        errors.append(float((out[live].float() - reference[live].float()).abs().max()
                            / reference[live].float().abs().max()))
        for k, v in caches.items():
            v.copy_(reference_caches[k])
        return reference

    engine = Engine(model, runner=runner, **engine_config)
    engine.add_requests(generate_workload(workload_config))
    engine.run()
    return errors
