"""Request admission, chunked prefill, decode rows and batch compaction.

Each step (vLLM v1 order): running requests in batch order get their tokens first (a decode row:
the last sampled token plus draft tokens; a prefilling request: its next prompt chunk), then
waiting requests are admitted first-come-first-served while the token budget, ``max_num_seqs``
and the block reservation allow (no preemption: admission reserves a request's worst case).
The step's rows are ordered decode rows first, then prefill rows, each in batch order (MLA
backends and vLLM's PCP layout want decodes first). After the step, finished requests leave the
batch and the later ones move up (order-preserving compaction), so a request's ordinal among the
decode rows, and with round-robin ownership its rank, changes when an earlier request finishes.

Nothing here touches tensors: a :class:`GlobalStep` is plain data that every rank builds
identically from the same requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Sequence

from pcppass.engine.allocator import KVCacheManager
from pcppass.contract import CacheGroupSpec, StepKind
from pcppass.engine.workload import RequestSpec, ngram_draft

RowKind = Literal["prefill", "decode"]


@dataclass
class Request:
    spec: RequestSpec
    output: list[int] = field(default_factory=list)
    #: positions whose cache rows are written and final (a decode row's rejected drafts excluded)
    num_computed: int = 0
    #: prompt tokens found in the prefix cache at admission
    num_cached_prompt: int = 0
    #: rank fixed at admission for the "sticky" ownership policy
    sticky_owner: int = 0
    finished: bool = False
    #: prompt + output, kept as the output grows (rebuilding it per step costs O(prompt) a row)
    _tokens: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._tokens = list(self.spec.prompt) + self.output

    @property
    def req_id(self) -> int:
        return self.spec.req_id

    @property
    def tokens(self) -> list[int]:
        """Prompt then output tokens (the engine's own list: read it, do not change it)."""
        return self._tokens

    def add_output(self, tokens: Sequence[int]) -> None:
        self.output.extend(tokens)
        self._tokens.extend(tokens)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.spec.prompt)

    @property
    def max_positions(self) -> int:
        # The last decode row ends at prompt + max_new - 2 (its last token is never cached).
        return len(self.spec.prompt) + self.spec.max_new_tokens - 1


@dataclass(frozen=True)
class StepRow:
    """One request's scheduled tokens in a step (a prefill chunk or a decode row)."""

    req_id: int
    batch_index: int
    kind: RowKind
    token_ids: tuple[int, ...]
    start_position: int
    #: per group, the slot of each token (-1 where the group stores nothing, e.g. compressed)
    slots: dict[str, tuple[int, ...]]
    #: per group, the request's block table (unpadded)
    block_table: dict[str, tuple[int, ...]]
    #: logits of tokens ``[sample_from, num_tokens)`` are sampled (== num_tokens: none)
    sample_from: int
    sticky_owner: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start_position, self.start_position + len(self.token_ids))


@dataclass(frozen=True)
class GlobalStep:
    index: int
    rows: tuple[StepRow, ...]

    @property
    def step_kind(self) -> StepKind:
        return "decode" if all(r.kind == "decode" for r in self.rows) else "mixed"

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    def row_offsets(self) -> list[int]:
        """Global token offset of each row (tokens are concatenated in row order)."""
        out, off = [], 0
        for r in self.rows:
            out.append(off)
            off += r.num_tokens
        return out


@dataclass(frozen=True)
class StepUpdate:
    #: tokens each request gained (a verify row: accepted drafts' samples plus the bonus)
    gained: dict[int, list[int]]
    finished: list[int]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 16
    max_model_len: int = 256
    #: most prompt tokens one request gets in one step (vLLM's long_prefill_token_threshold)
    max_chunk_tokens: int | None = None
    world: int = 1

    @property
    def chunk_limit(self) -> int:
        return min(self.max_chunk_tokens or self.max_num_batched_tokens, self.max_num_batched_tokens)


class Scheduler:
    def __init__(
        self,
        groups: Sequence[CacheGroupSpec],
        num_blocks: int | dict[str, int],
        config: SchedulerConfig,
        *,
        enable_prefix_caching: bool = True,
        max_spec_width: int = 1,
    ) -> None:
        self.config = config
        self.max_spec_width = max_spec_width
        self.kv = KVCacheManager(
            groups,
            num_blocks,
            max_model_len=config.max_model_len,
            max_step_positions=max(config.chunk_limit, max_spec_width),
            enable_prefix_caching=enable_prefix_caching,
        )
        self.groups = list(groups)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self.step_index = 0
        self._sticky_load = [0] * config.world

    def add_request(self, spec: RequestSpec) -> None:
        req = Request(spec)
        if len(spec.prompt) < 1:
            raise ValueError(f"request {spec.req_id}: empty prompt")
        if spec.spec_width > self.max_spec_width:
            raise ValueError(
                f"request {spec.req_id}: spec_width {spec.spec_width} > engine max_spec_width {self.max_spec_width}"
            )
        if req.max_positions > self.config.max_model_len:
            raise ValueError(
                f"request {spec.req_id}: prompt {len(spec.prompt)} + {spec.max_new_tokens} new tokens "
                f"exceeds max_model_len {self.config.max_model_len}"
            )
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling --------------------------------------------------------------------------
    def schedule(self) -> GlobalStep:
        """Pick this step's rows and hand out their blocks; request progress is not changed."""
        budget = self.config.max_num_batched_tokens
        planned: list[tuple[Request, RowKind, list[int], int]] = []  # req, kind, tokens, sample_from
        for req in self.running:
            if budget == 0:
                break
            row = self._next_row(req, budget)
            if row is not None:
                planned.append(row)
                budget -= len(row[2])
        arrived = [r for r in self.waiting if r.spec.arrival_step <= self.step_index]
        for req in arrived:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            hit = self.kv.try_admit(req.req_id, req.tokens, req.max_positions)
            if hit is None:
                break  # first come, first served: later arrivals wait behind the head
            self.waiting.remove(req)
            req.num_computed = req.num_cached_prompt = hit
            req.sticky_owner = min(range(self.config.world), key=lambda r: (self._sticky_load[r], r))
            self._sticky_load[req.sticky_owner] += 1
            self.running.append(req)
            row = self._next_row(req, budget)
            assert row is not None
            planned.append(row)
            budget -= len(row[2])

        rows = []
        batch_index = {r.req_id: i for i, r in enumerate(self.running)}
        for kind in ("decode", "prefill"):
            for req, k, tokens, sample_from in planned:
                if k == kind:
                    rows.append(self._make_row(req, k, tokens, sample_from, batch_index[req.req_id]))
        return GlobalStep(self.step_index, tuple(rows))

    def _next_row(self, req: Request, budget: int) -> tuple[Request, RowKind, list[int], int] | None:
        if req.prefilling:
            n = min(len(req.spec.prompt) - req.num_computed, budget, self.config.chunk_limit)
            tokens = list(req.spec.prompt[req.num_computed : req.num_computed + n])
            completes = req.num_computed + n == len(req.spec.prompt)
            return req, "prefill", tokens, (n - 1 if completes else n)
        remaining = req.spec.max_new_tokens - len(req.output)
        width = min(req.spec.spec_width, remaining, budget)
        if width <= 0:
            return None
        history = req.tokens
        tokens = [history[-1]] + ngram_draft(history, width - 1)
        return req, "decode", tokens, 0

    def _make_row(self, req: Request, kind: RowKind, tokens: list[int], sample_from: int, bidx: int) -> StepRow:
        start = req.num_computed
        self.kv.ensure_blocks(req.req_id, start + len(tokens))
        slots, tables = {}, {}
        for g in self.groups:
            table = self.kv.table(req.req_id, g.name)
            tables[g.name] = tuple(table)
            slots[g.name] = tuple(g.slot(table, p) for p in range(start, start + len(tokens)))
        return StepRow(
            req_id=req.req_id,
            batch_index=bidx,
            kind=kind,
            token_ids=tuple(tokens),
            start_position=start,
            slots=slots,
            block_table=tables,
            sample_from=sample_from,
            sticky_owner=req.sticky_owner,
        )

    # -- after the step ----------------------------------------------------------------------
    def update(self, step: GlobalStep, sampled: dict[int, list[int]]) -> StepUpdate:
        """Apply a step's sampled tokens (``sampled[req_id]``: one per sampled row, in order).

        Greedy verification of a decode row ``[last, d1 .. dk]`` with samples ``s0 .. sk``:
        accept ``d(i+1)`` while it equals ``s(i)``; the request gains the accepted samples plus
        one bonus sample and ``accepted + 1`` computed positions. Finished requests leave the
        batch and later ones move up.
        """
        by_id = {r.req_id: r for r in self.running}
        gained: dict[int, list[int]] = {}
        for row in step.rows:
            req = by_id[row.req_id]
            if row.kind == "prefill":
                req.num_computed += row.num_tokens
                if row.sample_from < row.num_tokens:
                    gained[row.req_id] = [sampled[row.req_id][0]]
            else:
                s = sampled[row.req_id]
                drafts = row.token_ids[1:]
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == s[accepted]:
                    accepted += 1
                gained[row.req_id] = s[: accepted + 1]
                req.num_computed += accepted + 1
            req.add_output(gained.get(row.req_id, ()))
            self.kv.register_computed(req.req_id, req.tokens, req.num_computed)
        done = []
        for req in self.running:
            if len(req.output) >= req.spec.max_new_tokens:
                req.finished = True
                done.append(req.req_id)
                self.kv.free(req.req_id)
                self._sticky_load[req.sticky_owner] -= 1
                self.finished[req.req_id] = req
        self.running = [r for r in self.running if not r.finished]
        self.step_index += 1
        return StepUpdate(gained, done)
