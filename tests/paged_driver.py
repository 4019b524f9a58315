"""A minimal single-rank paged driver for model tests: caches from ``cache_specs()``, blocks per
group, slots from ``CacheGroupSpec.slot``, and the step meta of :mod:`pcppass.contract`.

Blocks are handed out in a seeded random order, so a model that confuses logical and physical
block numbers (or one group's table with another's) reads the wrong rows and fails its test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pcppass.contract import CacheGroupSpec, slot_key, table_key


@dataclass(eq=False)  # identity: two requests with the same tokens are still two requests
class Request:
    tokens: list[int]  # prompt followed by generated tokens
    prompt_len: int
    cached: int = 0  # positions already written to the caches
    tables: dict[str, list[int]] = field(default_factory=dict)


class PagedDriver:
    def __init__(self, model: torch.nn.Module, num_blocks: int, max_step_positions: int, seed: int = 0) -> None:
        self.model = model
        self.groups: dict[str, CacheGroupSpec] = {g.name: g for g in model.cache_groups()}
        self.max_step_positions = max_step_positions
        self.caches = {
            s.name: torch.zeros((num_blocks, *s.block_shape), dtype=s.dtype) for s in model.cache_specs()
        }
        gen = torch.Generator().manual_seed(seed)
        self.free = {name: torch.randperm(num_blocks, generator=gen).tolist() for name in self.groups}

    def _grow_tables(self, req: Request, num_positions: int) -> None:
        for name, group in self.groups.items():
            table = req.tables.setdefault(name, [])
            need = group.blocks_for(num_positions, self.max_step_positions)
            while len(table) < need:
                if not self.free[name]:
                    raise RuntimeError(f"paged driver: out of blocks in group {name!r}")
                table.append(self.free[name].pop())

    def build_step(self, work: list[tuple[Request, int]], padding_rows: int = 0):
        """Rows for ``work`` = [(request, number of new positions)], plus padding rows.

        Returns ``(input_ids, positions, meta)``; the caller runs the model and then calls
        :meth:`commit`.
        """
        ids: list[int] = []
        pos: list[int] = []
        token_to_req: list[int] = []
        slots: dict[str, list[int]] = {name: [] for name in self.groups}
        seq_lens: list[int] = []
        query_start = [0]
        for r, (req, n) in enumerate(work):
            self._grow_tables(req, req.cached + n)
            for p in range(req.cached, req.cached + n):
                ids.append(req.tokens[p])
                pos.append(p)
                token_to_req.append(r)
                for name, group in self.groups.items():
                    slots[name].append(group.slot(req.tables[name], p))
            seq_lens.append(req.cached + n)
            query_start.append(len(ids))
        for _ in range(padding_rows):
            ids.append(0)
            pos.append(0)
            token_to_req.append(0)
            for name in self.groups:
                slots[name].append(-1)
        meta = {
            "token_to_req": torch.tensor(token_to_req, dtype=torch.int64),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int64),
            "query_start_loc": torch.tensor(query_start, dtype=torch.int64),
            "is_padding": torch.tensor([False] * (len(ids) - padding_rows) + [True] * padding_rows),
        }
        for name in self.groups:
            meta[slot_key(name)] = torch.tensor(slots[name], dtype=torch.int64)
            width = max(1, max(len(req.tables[name]) for req, _ in work))
            table = torch.zeros((len(work), width), dtype=torch.int64)
            for r, (req, _) in enumerate(work):
                table[r, : len(req.tables[name])] = torch.tensor(req.tables[name], dtype=torch.int64)
            meta[table_key(name)] = table
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta

    @staticmethod
    def commit(work: list[tuple[Request, int]]) -> None:
        for req, n in work:
            req.cached += n


def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    chunk_sizes: list[int],
    decode_steps: int,
    num_blocks: int = 64,
    padding_rows: int = 1,
    forward=None,
):
    """Greedy generation with chunked prefill and concurrent requests, all through the caches.

    Every step schedules each unfinished request: its next prompt chunk (``chunk_sizes[i]``
    positions) while prefilling, else one decode position. Returns, per request, the full token
    list and the logits of every row the request ran (``[positions, vocab]``, position order).
    """
    forward = forward if forward is not None else model
    driver = PagedDriver(model, num_blocks, max_step_positions=max(max(chunk_sizes), 1))
    reqs = [Request(tokens=list(p), prompt_len=len(p)) for p in prompts]
    row_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    target = [len(p) + decode_steps for p in prompts]
    with torch.no_grad():
        while any(len(req.tokens) < t for req, t in zip(reqs, target)):
            work = []
            for i, req in enumerate(reqs):
                if len(req.tokens) >= target[i]:
                    continue
                n = min(chunk_sizes[i], req.prompt_len - req.cached) if req.cached < req.prompt_len else 1
                work.append((req, n))
            input_ids, positions, meta = driver.build_step(work, padding_rows)
            hidden = forward(input_ids, positions, meta, driver.caches)
            logits = model.compute_logits(hidden)
            row = 0
            for req, n in work:
                i = reqs.index(req)
                row_logits[i].append(logits[row : row + n])
                row += n
            driver.commit(work)
            for req, n in work:
                i = reqs.index(req)
                if req.cached >= req.prompt_len:  # the last row predicts the next token
                    req.tokens.append(int(row_logits[i][-1][-1].argmax()))
    return [req.tokens for req in reqs], [torch.cat(rl) for rl in row_logits], driver
