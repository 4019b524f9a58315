"""Paged block allocation: one :class:`BlockPool` per cache group, a prefix cache for "full" groups.

Every group has its own pool of ``num_blocks`` blocks; block 0 is the null block (never handed
out). A block is free when its refcount is 0. Free blocks that hold a registered prefix stay
findable in the prefix cache until they are handed out again (then their hash is evicted), like
vLLM's evictable cached blocks; the free list is ordered oldest-freed first, so recently freed
prefixes live longest.

Prefix sharing is exact only when every position of the shared prefix is fully described by the
shared blocks. That holds for "full" groups (a position's row depends only on the tokens up to it)
but not for ring groups (a ring holds a request's last positions, overwritten as it advances) or
for compressor state read through a ring: :class:`KVCacheManager` therefore turns prefix caching
off when a model has any group that is not "full".
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from pcppass.contract import NULL_BLOCK, CacheGroupSpec


class OutOfBlocks(RuntimeError):
    """The pool cannot hand out the blocks asked for (admission should have prevented this)."""


class BlockPool:
    """Free list + refcounts + prefix-hash index for one cache group."""

    def __init__(self, group: CacheGroupSpec, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"group {group.name!r}: need >= 2 blocks (block 0 is the null block)")
        self.group = group
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        # Free blocks in hand-out order; values unused (OrderedDict gives O(1) removal by key).
        self._free: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(num_blocks) if b != NULL_BLOCK
        )
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self.total_allocated = 0  # blocks handed out so far (prefix hits not counted)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"group {self.group.name!r}: asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            old = self._hash_of_block.pop(block, None)
            if old is not None:  # evict the cached prefix this free block still held
                del self._block_of_hash[old]
            self.refcount[block] = 1
            out.append(block)
        self.total_allocated += n
        return out

    def share(self, block: int) -> None:
        """Take one more reference to a cached block (a prefix hit)."""
        if self.refcount[block] == 0:
            del self._free[block]
        self.refcount[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        # Reverse order: a request's tail blocks are handed out again before its head blocks,
        # so the longest common prefixes stay cached longest (vLLM does the same).
        for block in reversed(blocks):
            if self.refcount[block] <= 0:
                raise RuntimeError(f"group {self.group.name!r}: double free of block {block}")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self._free[block] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of_hash.get(block_hash)

    def register(self, block: int, block_hash: bytes) -> None:
        """Index a block whose positions are all computed under ``block_hash``.

        If another block already holds the same prefix (two requests computed it in the same
        window), the first one stays the cached copy.
        """
        if block_hash in self._block_of_hash or block in self._hash_of_block:
            return
        self._block_of_hash[block_hash] = block
        self._hash_of_block[block] = block_hash

    def is_shared(self, block: int) -> bool:
        return self.refcount[block] > 1


def block_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int,
                 known: Sequence[bytes] = ()) -> list[bytes]:
    """Chained hashes of the first ``num_blocks`` full blocks of ``token_ids``.

    Hash ``i`` covers tokens ``[0, (i + 1) * block_size)``: equal hashes mean equal prefixes.
    ``known``: the chain's first hashes, already computed for these tokens (only the blocks after
    them are hashed).
    """
    out = list(known[:num_blocks])
    parent = out[-1] if out else b""
    for i in range(len(out), num_blocks):
        h = hashlib.sha256(parent)
        h.update(",".join(map(str, token_ids[i * block_size : (i + 1) * block_size])).encode())
        parent = h.digest()
        out.append(parent)
    return out


@dataclass
class _RequestBlocks:
    tables: dict[str, list[int]]
    reserved: dict[str, int]  # worst-case blocks per group over the request's lifetime
    num_registered: dict[str, int] = field(default_factory=dict)  # full blocks indexed so far
    #: per group, the chained hashes of the request's blocks computed so far
    hashes: dict[str, list[bytes]] = field(default_factory=dict)


class KVCacheManager:
    """Block tables of every running request across all cache groups.

    Admission reserves a request's worst case (``max_positions`` cached positions) so a running
    request never runs out of blocks and nothing is ever preempted; blocks are handed out as the
    request advances.
    """

    def __init__(
        self,
        groups: Sequence[CacheGroupSpec],
        num_blocks: int | dict[str, int],
        *,
        max_model_len: int,
        max_step_positions: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.groups = {g.name: g for g in groups}
        if len(self.groups) != len(groups):
            raise ValueError("duplicate cache group names")
        self.max_model_len = max_model_len
        self.max_step_positions = max_step_positions
        self.pools = {
            name: BlockPool(g, num_blocks[name] if isinstance(num_blocks, dict) else num_blocks)
            for name, g in self.groups.items()
        }
        self.prefix_caching = enable_prefix_caching and all(
            g.addressing == "full" for g in groups
        )
        self._requests: dict[object, _RequestBlocks] = {}

    # -- sizes -------------------------------------------------------------------------------
    def table_columns(self, group: str) -> int:
        """Fixed column count of ``block_table.<group>``: the most blocks a request can hold.

        For a ring group this is exactly the ring's block count, since the ring length is read
        from the table width (contract.py).
        """
        return max(1, self.groups[group].blocks_for(self.max_model_len, self.max_step_positions))

    def _blocks_for(self, group: str, num_positions: int) -> int:
        return self.groups[group].blocks_for(num_positions, self.max_step_positions)

    def _outstanding(self) -> dict[str, int]:
        """Blocks promised to running requests but not yet handed out, per group."""
        out = dict.fromkeys(self.groups, 0)
        for rb in self._requests.values():
            for g in self.groups:
                out[g] += rb.reserved[g] - len(rb.tables[g])
        return out

    # -- admission ---------------------------------------------------------------------------
    def _prefix_hits(self, token_ids: Sequence[int]) -> tuple[int, dict[str, list[int]], dict[str, list[bytes]]]:
        """Longest cached prefix (in tokens) common to all groups, its blocks per group, and the
        hashes of the prompt's full blocks per group (kept for the request's own blocks)."""
        if not self.prefix_caching:
            return 0, {g: [] for g in self.groups}, {g: [] for g in self.groups}
        # At least one prompt token is always computed: its logits give the first output token.
        max_hit = len(token_ids) - 1
        hit_tokens = max_hit
        per_group: dict[str, list[int]] = {}
        hashes: dict[str, list[bytes]] = {}
        for name, g in self.groups.items():
            blocks = []
            hashes[name] = block_hashes(token_ids, g.block_size, max_hit // g.block_size)
            for h in hashes[name]:
                b = self.pools[name].lookup(h)
                if b is None:
                    break
                blocks.append(b)
            per_group[name] = blocks
            hit_tokens = min(hit_tokens, len(blocks) * g.block_size)
        # Round down to a position every group's blocks end at.
        while any(hit_tokens % g.block_size for g in self.groups.values()):
            hit_tokens -= 1
        return (hit_tokens, {n: b[: hit_tokens // self.groups[n].block_size] for n, b in per_group.items()},
                hashes)

    def try_admit(self, req_id: object, token_ids: Sequence[int], max_positions: int) -> int | None:
        """Admit a request whose cached positions never exceed ``max_positions``.

        Returns the number of prompt tokens already cached (prefix hit), or None when the worst
        case does not fit next to the running requests' reservations.
        """
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already admitted")
        hit_tokens, hits, hashes = self._prefix_hits(token_ids)
        outstanding = self._outstanding()
        need = {g: self._blocks_for(g, max_positions) for g in self.groups}
        for g, pool in self.pools.items():
            hits_now_free = sum(1 for b in hits[g] if pool.refcount[b] == 0)
            if pool.num_free - hits_now_free - outstanding[g] < need[g] - len(hits[g]):
                return None
        for g, blocks in hits.items():
            for b in blocks:
                self.pools[g].share(b)
        self._requests[req_id] = _RequestBlocks(
            tables={g: list(hits[g]) for g in self.groups},
            reserved=need,
            num_registered={g: len(hits[g]) for g in self.groups},
            hashes=hashes,
        )
        return hit_tokens

    def ensure_blocks(self, req_id: object, num_positions: int) -> None:
        """Hand out blocks so positions ``[0, num_positions)`` have slots in every group."""
        rb = self._requests[req_id]
        for g, table in rb.tables.items():
            missing = self._blocks_for(g, num_positions) - len(table)
            if missing > 0:
                if len(table) + missing > rb.reserved[g]:
                    raise OutOfBlocks(
                        f"request {req_id!r} group {g!r}: {num_positions} positions exceed its reservation"
                    )
                table.extend(self.pools[g].allocate(missing))

    def register_computed(self, req_id: object, token_ids: Sequence[int], num_computed: int) -> None:
        """Index the request's blocks whose positions are now all computed (prefix cache).

        ``token_ids`` are the request's tokens, which only ever grow at the end (its prompt, then
        its accepted outputs): the hashes of blocks computed before are kept and not recomputed."""
        if not self.prefix_caching:
            return
        rb = self._requests[req_id]
        for g, table in rb.tables.items():
            bs = self.groups[g].block_size
            full = min(num_computed // bs, len(table))
            done = rb.num_registered[g]
            if full > done:
                # Hashes already computed (the prompt's, earlier blocks') cover the same tokens:
                # a request's tokens only ever grow at the end.
                known = rb.hashes.get(g, [])
                hashes = block_hashes(token_ids, bs, full, known)
                if len(hashes) > len(known):  # the prompt's chain may reach past this chunk: keep it
                    rb.hashes[g] = hashes
                for i in range(done, full):
                    self.pools[g].register(table[i], hashes[i])
                rb.num_registered[g] = full

    def free(self, req_id: object) -> None:
        rb = self._requests.pop(req_id)
        for g, table in rb.tables.items():
            self.pools[g].free(table)

    # -- queries -----------------------------------------------------------------------------
    def table(self, req_id: object, group: str) -> list[int]:
        return self._requests[req_id].tables[group]

    def is_shared(self, group: str, block: int) -> bool:
        return self.pools[group].is_shared(block)

    def num_allocated(self, group: str) -> int:
        """Blocks currently referenced by at least one request."""
        pool = self.pools[group]
        return pool.num_blocks - 1 - pool.num_free
