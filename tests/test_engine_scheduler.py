"""Block pools, prefix cache, workload generator, drafter and scheduler (no model involved)."""

from __future__ import annotations

import pytest

from pcppass.engine.allocator import BlockPool, KVCacheManager, OutOfBlocks
from pcppass.contract import NULL_BLOCK, CacheGroupSpec
from pcppass.engine.scheduler import Scheduler, SchedulerConfig
from pcppass.engine.workload import RequestSpec, WorkloadConfig, generate_workload, ngram_draft

BS = 4
KV = CacheGroupSpec("kv", BS)


def test_block_pool_refcounts_null_block_and_eviction():
    pool = BlockPool(KV, 5)
    blocks = pool.allocate(4)
    assert NULL_BLOCK not in blocks and sorted(blocks) == [1, 2, 3, 4]
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.register(blocks[0], b"h0")
    pool.share(blocks[0])
    assert pool.refcount[blocks[0]] == 2 and pool.is_shared(blocks[0])
    pool.free(blocks)
    assert pool.num_free == 3 and pool.refcount[blocks[0]] == 1
    pool.free([blocks[0]])
    assert pool.num_free == 4
    assert pool.lookup(b"h0") == blocks[0]  # a free block keeps its cached prefix ...
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([blocks[0]])
    pool.allocate(4)
    assert pool.lookup(b"h0") is None  # ... until it is handed out again


def test_prefix_cache_shares_blocks_with_refcounts():
    kv = KVCacheManager([KV], 32, max_model_len=64, max_step_positions=8)
    prompt_a = list(range(1, 12))  # 11 tokens: 2 full blocks + 3
    assert kv.try_admit("a", prompt_a, 16) == 0
    kv.ensure_blocks("a", 11)
    kv.register_computed("a", prompt_a, 11)
    prompt_b = prompt_a[:8] + [50, 51, 52]
    assert kv.try_admit("b", prompt_b, 16) == 8
    shared = kv.table("a", "kv")[:2]
    assert kv.table("b", "kv") == shared
    assert all(kv.pools["kv"].refcount[b] == 2 and kv.is_shared("kv", b) for b in shared)
    # a prompt that is entirely cached still computes its last token: the hit stops one block short
    assert kv.try_admit("c", prompt_a[:8], 16) == 4
    kv.free("a")
    assert [kv.pools["kv"].refcount[b] for b in shared] == [3 - 1, 2 - 1]


def test_prefix_cache_off_with_ring_groups():
    ring = CacheGroupSpec("swa", BS, addressing="ring", window=8)
    kv = KVCacheManager([KV, ring], 32, max_model_len=64, max_step_positions=4)
    assert not kv.prefix_caching
    assert kv.table_columns("swa") == ring.ring_blocks(4) == 3
    assert kv.table_columns("kv") == 16


def test_admission_waits_for_reserved_blocks():
    # 7 usable blocks; each request reserves ceil((8 + 8 - 1) / 4) = 4 blocks
    s = Scheduler([KV], 8, SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), enable_prefix_caching=False)
    for i in range(2):
        s.add_request(RequestSpec(i, tuple(range(1, 9)), max_new_tokens=8))
    step = s.schedule()
    assert [r.req_id for r in step.rows] == [0]
    while 0 not in s.finished:
        step = s.schedule()
        assert [r.req_id for r in step.rows] == [0]
        s.update(step, {0: [3] * (step.rows[0].num_tokens - step.rows[0].sample_from)})
    assert [r.req_id for r in s.schedule().rows] == [1]


def test_chunked_prefill_splits_mid_block():
    s = Scheduler([KV], 32, SchedulerConfig(max_num_batched_tokens=6, max_model_len=64), enable_prefix_caching=False)
    s.add_request(RequestSpec(0, tuple(range(1, 11)), max_new_tokens=2))
    first = s.schedule()
    (row,) = first.rows
    table = row.block_table["kv"]
    assert row.kind == "prefill" and row.num_tokens == 6 and row.sample_from == 6  # nothing sampled
    assert row.slots["kv"] == tuple(table[p // BS] * BS + p % BS for p in range(6))
    s.update(first, {})
    (row,) = s.schedule().rows
    assert row.start_position == 6 and row.num_tokens == 4 and row.sample_from == 3
    assert row.slots["kv"][0] == row.block_table["kv"][1] * BS + 2  # resumes inside block 1


def test_decode_first_order_and_spec_acceptance():
    s = Scheduler([KV], 32, SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), max_spec_width=3)
    s.add_request(RequestSpec(0, (5, 6, 5, 6, 5), max_new_tokens=6, spec_width=3))
    step = s.schedule()
    s.update(step, {0: [6]})
    s.add_request(RequestSpec(1, (9, 9, 9), max_new_tokens=2))
    step = s.schedule()
    assert [(r.req_id, r.kind) for r in step.rows] == [(0, "decode"), (1, "prefill")]
    dec = step.rows[0]
    assert dec.token_ids == (6, 5, 6)  # last sampled + 2 drafts continuing the "5 6" n-gram
    assert dec.positions == range(5, 8)
    # samples [5, 7, x]: draft 5 accepted (== s0), draft 6 rejected (!= s1): gain s0, s1
    s.update(step, {0: [5, 7, 1], 1: [2]})
    req = s.running[0]
    assert req.output == [6, 5, 7] and req.num_computed == 7 == len(req.tokens) - 1


def test_finished_requests_leave_and_later_ones_move_up():
    s = Scheduler([KV], 64, SchedulerConfig(max_num_batched_tokens=64, max_model_len=64))
    for i, n in enumerate([1, 3, 3]):
        s.add_request(RequestSpec(i, (1, 2, 3), max_new_tokens=n))
    step = s.schedule()
    assert [r.batch_index for r in step.rows] == [0, 1, 2]
    update = s.update(step, {i: [4] for i in range(3)})
    assert update.finished == [0] and update.gained == {0: [4], 1: [4], 2: [4]} and [r.req_id for r in s.running] == [1, 2]
    assert [(r.req_id, r.batch_index) for r in s.schedule().rows] == [(1, 0), (2, 1)]


def test_workload_is_deterministic_and_prefix_aligned():
    cfg = WorkloadConfig(num_requests=6, prompt_len=(10, 30), prefix_hit_rate=0.9, block_size=4, seed=3,
                         mean_arrival_gap=1.5)
    a, b = generate_workload(cfg), generate_workload(cfg)
    assert a == b
    assert a != generate_workload(WorkloadConfig(**{**cfg.__dict__, "seed": 4}))
    common = max(a, key=lambda r: len(r.prompt)).prompt
    for r in a:
        shared = int(0.9 * len(r.prompt)) // 4 * 4
        assert r.prompt[:shared] == common[:shared]
        assert 0 not in r.prompt
    assert [r.arrival_step for r in a] == sorted(r.arrival_step for r in a)
    with pytest.raises(ValueError, match="prefix_hit_rate"):
        WorkloadConfig(prefix_hit_rate=1.5)


def test_ngram_draft():
    assert ngram_draft([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]  # continues the earlier "1 2"
    assert ngram_draft([4, 7, 8, 4], 4) == [7, 8, 4, 4]  # short continuation padded
    assert ngram_draft([1, 2, 3], 2) == [3, 3]  # no match: repeat the last token
    assert ngram_draft([1, 2], 0) == []


def test_block_hashes_extend_a_known_chain():
    """The chain grown from hashes already computed is the chain computed from scratch, and a
    different token anywhere before a block changes that block's hash."""
    from pcppass.engine.allocator import block_hashes

    tokens = list(range(100, 140))
    full = block_hashes(tokens, BS, 10)
    assert block_hashes(tokens, BS, 10, full[:3]) == full
    assert block_hashes(tokens, BS, 4, full) == full[:4]
    changed = block_hashes(tokens[:5] + [7] + tokens[6:], BS, 10)
    assert changed[:1] == full[:1] and all(a != b for a, b in zip(changed[1:], full[1:]))


def test_prefix_hits_after_decoded_blocks_are_registered():
    """A request's decoded tokens fill blocks that a later request with the same tokens finds:
    the hashes grown step by step from the prompt's match those of the whole token list."""
    kv = KVCacheManager([KV], 32, max_model_len=64, max_step_positions=8)
    first = list(range(1, 11))  # 10 prompt tokens
    assert kv.try_admit("a", first, 30) == 0
    tokens = list(first)
    for step, new in enumerate(range(50, 60)):
        kv.ensure_blocks("a", len(tokens) + 1)
        tokens.append(new)
        kv.register_computed("a", tokens, len(tokens) - 1)
    # 19 computed positions: 4 full blocks; a second request with those 16 tokens + more hits them
    assert kv.try_admit("b", tokens[:16] + [99, 98], 30) == 16


def test_request_tokens_follow_its_output():
    from pcppass.engine.scheduler import Request

    req = Request(RequestSpec(req_id=1, prompt=(5, 6, 7), max_new_tokens=4))
    req.add_output([8])
    req.add_output([9, 10])
    assert req.tokens == [5, 6, 7, 8, 9, 10] and req.output == [8, 9, 10]
