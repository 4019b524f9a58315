"""Per-rank layouts of a global step (vLLM PCP): ownership, DualChunkSwap, padding, restore, validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pcppass.contract import (
    IS_PADDING,
    QUERY_START_LOC,
    SEQ_LENS,
    TOKEN_TO_REQ,
    CacheGroupSpec,
    slot_key,
    table_key,
)
from pcppass.engine.layout import (
    ALL_RANKS,
    PlanError,
    build_local_step,
    dual_chunk_swap,
    plan_layout,
    validate_plan,
)
from pcppass.engine.scheduler import GlobalStep, Scheduler, SchedulerConfig, StepRow
from pcppass.engine.workload import RequestSpec

BS = 4
GROUPS = [CacheGroupSpec("kv", BS)]
NUM_BLOCKS = 64
COLS = 8


def make_row(req_id, kind, n, start, table, *, sticky=0, batch_index=0):
    slots = tuple(table[p // BS] * BS + p % BS for p in range(start, start + n))
    return StepRow(
        req_id=req_id,
        batch_index=batch_index,
        kind=kind,
        token_ids=tuple(100 + req_id * 10 + j for j in range(n)),
        start_position=start,
        slots={"kv": slots},
        block_table={"kv": tuple(table)},
        sample_from=0 if kind == "decode" else n - 1,
        sticky_owner=sticky,
    )


def local_steps(step, plan):
    return [build_local_step(step, plan, r, GROUPS, lambda g: COLS) for r in range(plan.world)]


def validate(step, plan, locs, is_shared=None):
    validate_plan(step, plan, locs, GROUPS, lambda g: NUM_BLOCKS, is_shared)


def gathered_restore(plan, locs):
    """Simulate the all-gather: each rank contributes its rows' global indices (padding -1)."""
    gathered = torch.cat([torch.tensor(ls.global_index, dtype=torch.int64) for ls in locs])
    return gathered[torch.tensor(plan.restore_index)]


def test_dual_chunk_swap_p2_q7_matches_vllm():
    # vLLM's _build_batch_layout comment: [A B C D E F G] -> rank0 [A B G], rank1 [C D E F]
    assert dual_chunk_swap(7, 0, 2) == [(0, 2), (6, 7)]
    assert dual_chunk_swap(7, 1, 2) == [(2, 4), (4, 6)]
    step = GlobalStep(0, (make_row(0, "prefill", 7, 0, [1, 2]),))
    plan = plan_layout(step, 2, "round_robin", partition_prefill=True)
    locs = local_steps(step, plan)
    assert plan.padded_tokens == 4
    assert locs[0].global_index == (0, 1, 6, -1)
    assert locs[1].global_index == (2, 3, 4, 5)
    assert plan.restore_index == (0, 1, 4, 5, 6, 7, 2)
    assert torch.equal(gathered_restore(plan, locs), torch.arange(7))
    # rank 0 runs two segments (chunks 0 and 3): each a local request attending up to its own end
    assert locs[0].meta[SEQ_LENS].tolist()[:2] == [2, 7]
    assert locs[0].meta[QUERY_START_LOC].tolist()[:3] == [0, 2, 3]
    assert locs[0].meta[TOKEN_TO_REQ].tolist() == [0, 0, 1, 0]
    assert locs[1].meta[SEQ_LENS].tolist()[:2] == [4, 6]
    assert locs[0].positions.tolist() == [0, 1, 6, 0]
    validate(step, plan, locs)


def test_dual_chunk_swap_p4_drops_empty_chunks():
    # q=9, 2P=8 chunks of 2: chunks 5..7 are empty; rank r takes chunks r and 7-r
    got = [dual_chunk_swap(9, r, 4) for r in range(4)]
    assert got == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8), (8, 9)]]
    covered = sorted(x for segs in got for a, b in segs for x in range(a, b))
    assert covered == list(range(9))


def test_vllm_worked_example_three_decodes_p2():
    # vLLM test: slots [123, 456, 789]; rank0 owns req 0 and 2, rank1 owns req 1 and pads.
    rows = tuple(
        dataclasses.replace(make_row(i, "decode", 1, 3, [30 + i]), slots={"kv": (s,)}, block_table={"kv": (s // BS,)})
        for i, s in enumerate([123, 456, 789])
    )
    step = GlobalStep(0, rows)
    plan = plan_layout(step, 2, "round_robin")
    assert plan.owners == (0, 1, 0)
    assert plan.restore_index == (0, 2, 1)
    locs = local_steps(step, plan)
    gathered_slots = torch.cat([ls.meta[slot_key("kv")] for ls in locs]).tolist()
    assert gathered_slots == [123, 789, 456, -1]
    # with graph padding to 4 rows per rank (vLLM: hidden_restore_idx = [0, 4, 1])
    plan4 = plan_layout(step, 2, "round_robin", buckets=(4, 8))
    assert plan4.padded_tokens == 4 and plan4.restore_index == (0, 4, 1)
    validate_plan(step, plan, locs, GROUPS, lambda g: 256)


@pytest.mark.parametrize("policy", ["round_robin", "sticky", "replicated"])
@pytest.mark.parametrize("world", [2, 3])
def test_restore_gives_global_order_mixed_steps(policy, world):
    rows = [
        make_row(0, "decode", 1, 9, [1, 2, 3], sticky=1 % world),
        make_row(1, "decode", 3, 5, [4, 5], sticky=0),  # multi-token (spec verify) row
        make_row(2, "decode", 1, 2, [6], sticky=world - 1),
        make_row(3, "prefill", 11, 4, [7, 8, 9, 10]),
        make_row(4, "prefill", 2, 0, [11]),
    ]
    step = GlobalStep(0, tuple(rows))
    plan = plan_layout(step, world, policy, partition_prefill=True)
    locs = local_steps(step, plan)
    assert torch.equal(gathered_restore(plan, locs), torch.arange(step.num_tokens))
    # every rank has the same padded shapes; decodes come first in every local step
    for ls in locs:
        assert ls.num_tokens == plan.padded_tokens >= 2
        assert ls.meta[table_key("kv")].shape == (plan.padded_tokens, COLS)
        kinds = [step.rows[s.row].kind for s in plan.segments[ls.rank]]
        assert kinds == sorted(kinds)  # "decode" < "prefill"
    # a multi-token decode row runs whole on one rank (or every rank when replicated)
    for r, segs in enumerate(plan.segments):
        for s in segs:
            if step.rows[s.row].kind == "decode":
                assert (s.start, s.stop) == (0, step.rows[s.row].num_tokens)
    if policy == "replicated":
        assert plan.owners[:3] == (ALL_RANKS,) * 3
    elif policy == "sticky":
        assert plan.owners[:3] == tuple(r.sticky_owner for r in rows[:3])
    else:
        assert plan.owners[:3] == (0, 1 % world, 2 % world)
    validate(step, plan, locs)


def test_zero_row_ranks_are_padded():
    step = GlobalStep(0, (make_row(0, "decode", 1, 5, [3, 4]),))
    plan = plan_layout(step, 4, "round_robin")
    assert plan.tokens_per_rank() == [1, 0, 0, 0]
    locs = local_steps(step, plan)
    for ls in locs[1:]:
        assert ls.num_tokens == 2 and ls.num_real_tokens == 0
        assert ls.input_ids.tolist() == [0, 0] and ls.positions.tolist() == [0, 0]
        assert ls.meta[slot_key("kv")].tolist() == [-1, -1]
        assert ls.meta[TOKEN_TO_REQ].tolist() == [0, 0]
        assert ls.meta[IS_PADDING].tolist() == [True, True]
        assert ls.meta[SEQ_LENS].tolist() == [0, 0]
        assert ls.meta[QUERY_START_LOC].tolist() == [0, 0, 0]
        assert not ls.meta[table_key("kv")].any()
    # rank 0: one real row, one padding row with slot -1
    assert locs[0].meta[slot_key("kv")].tolist() == [4 * BS + 1, -1]
    assert locs[0].meta[IS_PADDING].tolist() == [False, True]
    assert locs[0].meta[table_key("kv")][0, :2].tolist() == [3, 4]
    validate(step, plan, locs)


def _decode_scheduler(world, n_requests, max_new):
    s = Scheduler(GROUPS, NUM_BLOCKS, SchedulerConfig(max_num_batched_tokens=32, max_model_len=64, world=world))
    for i in range(n_requests):
        s.add_request(RequestSpec(i, tuple(range(1, 4)), max_new_tokens=max_new[i]))
    return s


def _run_owners(world, policy, n_requests, max_new):
    """Owner maps of the decode-only steps of a scheduler driven with constant samples."""
    s = _decode_scheduler(world, n_requests, max_new)
    history = []
    while s.has_unfinished():
        step = s.schedule()
        plan = plan_layout(step, world, policy)
        if step.step_kind == "decode":
            history.append({r.req_id: o for r, o in zip(step.rows, plan.owners)})
            validate(step, plan, local_steps(step, plan))
        s.update(step, {r.req_id: [7] * (r.num_tokens - r.sample_from) for r in step.rows})
    return history


def test_round_robin_owner_is_ordinal_and_moves_after_compaction():
    history = _run_owners(2, "round_robin", 5, [2, 6, 6, 6, 6])
    for owners in history:  # recomputed every step from the compacted batch
        assert list(owners.values()) == [i % 2 for i in range(len(owners))]
    before, after = history[0], history[-1]
    assert 0 in before and 0 not in after  # request 0 finished and left the batch
    moved = [r for r in after if before[r] != after[r]]
    assert moved == [1, 2, 3, 4]


def test_sticky_owner_stays_and_is_balanced():
    history = _run_owners(2, "sticky", 5, [2, 6, 6, 6, 6])
    first = history[0]
    assert first == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0}
    for owners in history:
        assert all(owners[r] == first[r] for r in owners)


def test_replicated_runs_every_decode_row_on_every_rank():
    step = GlobalStep(0, tuple(make_row(i, "decode", 1, 4, [i + 1, i + 20]) for i in range(3)))
    plan = plan_layout(step, 2, "replicated", partition_prefill=False)
    locs = local_steps(step, plan)
    assert plan.tokens_per_rank() == [3, 3]
    assert plan.restore_index == (0, 1, 2)  # rank 0's copy
    assert torch.equal(locs[0].meta[slot_key("kv")], locs[1].meta[slot_key("kv")])
    validate(step, plan, locs)


def test_buckets_pad_and_refuse_overflow():
    step = GlobalStep(0, tuple(make_row(i, "decode", 1, 3, [i + 1]) for i in range(5)))
    assert plan_layout(step, 1, buckets=(2, 4, 8)).padded_tokens == 8
    assert plan_layout(step, 2, buckets=(2, 4, 8)).padded_tokens == 4
    with pytest.raises(ValueError, match="exceed the largest bucket 4"):
        plan_layout(step, 1, buckets=(2, 4))


# -- validation --------------------------------------------------------------------------------


def _two_decodes():
    return GlobalStep(3, (make_row(0, "decode", 1, 4, [1, 2]), make_row(7, "decode", 1, 6, [3, 5])))


def test_validate_rejects_out_of_range_slot():
    step = _two_decodes()
    bad = dataclasses.replace(step.rows[1], slots={"kv": (NUM_BLOCKS * BS + 1,)}, block_table={"kv": (3, NUM_BLOCKS)})
    step = GlobalStep(3, (step.rows[0], bad))
    plan = plan_layout(step, 2, "round_robin")
    with pytest.raises(PlanError, match=rf"step 3: request 7 \(decode, position 6\) group 'kv' slot {NUM_BLOCKS * BS + 1}: out of range"):
        validate(step, plan, local_steps(step, plan))


def test_validate_rejects_slot_written_by_two_requests():
    step = _two_decodes()
    clash = dataclasses.replace(step.rows[1], slots=step.rows[0].slots, block_table=step.rows[0].block_table)
    step = GlobalStep(3, (step.rows[0], clash))
    plan = plan_layout(step, 2, "round_robin")
    with pytest.raises(PlanError, match=r"request 7 .* also written by step 3: request 0"):
        validate(step, plan, local_steps(step, plan))


def test_validate_rejects_block_outside_table_and_shared_block():
    step = _two_decodes()
    foreign = dataclasses.replace(step.rows[1], slots={"kv": (9 * BS,)})
    bad = GlobalStep(3, (step.rows[0], foreign))
    plan = plan_layout(bad, 1)
    with pytest.raises(PlanError, match="block 9 is not in the request's block table"):
        validate(bad, plan, local_steps(bad, plan))
    plan = plan_layout(step, 1)
    with pytest.raises(PlanError, match=r"request 0 .* block 2 is shared through the prefix cache"):
        validate(step, plan, local_steps(step, plan), is_shared=lambda g, b: b == 2)


def test_validate_rejects_sharded_row_written_by_two_ranks():
    step = _two_decodes()
    sharded = plan_layout(step, 2, "round_robin")
    replicated_locals = local_steps(step, plan_layout(step, 2, "replicated"))
    with pytest.raises(PlanError, match=r"request 0 .* written by ranks \[0, 1\], expected exactly one rank"):
        validate(step, sharded, replicated_locals)


def test_validate_rejects_int32_slots_and_padding_slots():
    step = _two_decodes()
    plan = plan_layout(step, 2, "round_robin")
    locs = local_steps(step, plan)
    locs[1].meta[slot_key("kv")] = locs[1].meta[slot_key("kv")].to(torch.int32)
    with pytest.raises(PlanError, match="rank 1 group 'kv': slot mapping is torch.int32, not int64"):
        validate(step, plan, locs)
    locs = local_steps(step, plan)
    locs[0].meta[slot_key("kv")][1] = 5
    with pytest.raises(PlanError, match="rank 0 group 'kv': padding row 1 has slot 5, not -1"):
        validate(step, plan, locs)
