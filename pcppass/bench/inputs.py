"""Paged decode inputs for ``N * P`` requests of context ``C``, ownership, replica comparison."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pcppass.contract import slot_key, table_key


class DecodeSetup:
    """Caches and block tables for ``requests`` decode requests, each with ``context`` cached
    positions, plus room for ``extra`` more positions (smoke steps write past the context)."""

    def __init__(self, model: torch.nn.Module, requests: int, max_context: int, extra: int, seed: int,
                 device: str = "cuda"):
        self.model, self.requests, self.extra, self.device = model, requests, extra, device
        self.groups = {g.name: g for g in model.cache_groups()}
        self.columns_max = {n: g.blocks_for(max_context + extra, 1) for n, g in self.groups.items()}
        num_blocks = {n: 1 + requests * c for n, c in self.columns_max.items()}  # block 0: null block
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)  # the same bytes on every rank: replicas start identical
        self.caches = {s.name: random_cache((num_blocks[s.group], *s.block_shape), s.dtype, gen, device)
                       for s in model.cache_specs()}
        self.vocab = model.embed_tokens.num_embeddings

    def move_caches_to_symmetric_memory(self) -> str | None:
        """Copy every cache into symmetric memory (same bytes; every rank allocates the same caches
        in the same order), so the backend can sync them with peer stores. None, or why not (the
        caches then stay where they are)."""
        from pcppass.sync.peer import symmetric_empty

        try:
            for name, cache in list(self.caches.items()):
                moved = symmetric_empty(cache.shape, cache.dtype, self.device)
                moved.copy_(cache)
                self.caches[name] = moved
                del cache
                torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - recorded; the bench runs on with ordinary caches
            return f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        return None

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.caches.values())

    def columns(self, group: str, context: int) -> int:
        return self.groups[group].blocks_for(context + self.extra, 1)

    def table_row(self, group: str, req: int, context: int) -> list[int]:
        base = 1 + req * self.columns_max[group]
        return list(range(base, base + self.columns(group, context)))

    def step(self, reqs: list[int], context: int, position: int) -> tuple:
        """``(input_ids, positions, meta)`` of one decode row per request in ``reqs`` at ``position``."""
        dev = self.device
        t = len(reqs)

        def i64(x):
            return torch.tensor(x, dtype=torch.int64, device=dev)

        meta = {
            "token_to_req": torch.arange(t, device=dev),
            "seq_lens": torch.full((t,), position + 1, dtype=torch.int64, device=dev),
            "query_start_loc": torch.arange(t + 1, device=dev),
            "is_padding": torch.zeros(t, dtype=torch.bool, device=dev),
        }
        for name, group in self.groups.items():
            rows = [self.table_row(name, r, context) for r in reqs]
            meta[table_key(name)] = i64(rows)
            meta[slot_key(name)] = i64([group.slot(row, position) for row in rows])
        ids = i64([(r * 7919 + position) % self.vocab for r in reqs])
        positions = torch.full((t,), position, dtype=torch.int64, device=dev)
        # One graph for every row count and context (the ShardedRunner marks rows the same way).
        for x in (ids, positions, *meta.values()):
            torch._dynamo.maybe_mark_dynamic(x, 0)
        for name in self.groups:
            torch._dynamo.maybe_mark_dynamic(meta[table_key(name)], 1)
        return ids, positions, meta


def random_cache(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str) -> torch.Tensor:
    """Seeded random cache bytes; fp8 and packed bytes keep no NaN codes and no huge scales."""
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.randn(shape, dtype=dtype, device=device, generator=gen)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
    raw &= 0x77  # e4m3 / packed bytes: no NaN codes, no huge scales
    return raw.view(dtype) if dtype.itemsize == 1 else raw


def owned(requests: int, world: int, rank: int, step: int) -> list[int]:
    """Round-robin ownership, rotated every step so rows move between ranks."""
    return [i for i in range(requests) if (i + step) % world == rank]


def caches_equal_across_ranks(caches: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Per cache: bitwise equal to rank 0's copy on every rank."""
    out = {}
    for name, cache in caches.items():
        theirs = cache.clone()
        dist.broadcast(theirs, src=0)
        same = torch.tensor([int(torch.equal(theirs.view(torch.uint8), cache.view(torch.uint8)))],
                            device=cache.device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        out[name] = bool(same.item())
        del theirs
    return out
