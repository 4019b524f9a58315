"""Decode steps replayed from CUDA graphs, the parts that run on the host (CPU): the capture sizes,
the layout's padding of decode steps to them, the refusals of a replay whose inputs or caches are
not the captured ones, and the state digest forced on the steps a graph runner runs un-captured.
The captures and replays themselves: tests/test_engine_cuda_graphs.py (GPU)."""

from __future__ import annotations

import pytest
import torch

from pcppass.checks import SyncChecks
from pcppass.contract import CacheGroupSpec
from pcppass.engine.graphs import CapturedStep, cache_identity, decode_graph_sizes, refuse_other_inputs
from pcppass.engine.layout import padding_step, plan_layout
from pcppass.engine.scheduler import GlobalStep, StepRow
from pcppass.runtime.state_checks import StateDigestCheck, digest_forced

GROUPS = [CacheGroupSpec("kv", 4)]


def decode_row(req_id: int, position: int = 9) -> StepRow:
    return StepRow(req_id=req_id, batch_index=req_id, kind="decode", token_ids=(5,), start_position=position,
                   slots={"kv": (position,)}, block_table={"kv": (0, 1, 2)}, sample_from=0)


def prefill_row(req_id: int, tokens: int) -> StepRow:
    return StepRow(req_id=req_id, batch_index=req_id, kind="prefill", token_ids=(5,) * tokens, start_position=0,
                   slots={"kv": tuple(range(tokens))}, block_table={"kv": (0, 1, 2)}, sample_from=tokens - 1)


@pytest.mark.parametrize("max_tokens, sizes", [
    (1, (2,)), (2, (2,)), (3, (2, 4)), (8, (2, 4, 8)), (9, (2, 4, 8, 16)), (16, (2, 4, 8, 16)),
    (17, (2, 4, 8, 16, 24)), (32, (2, 4, 8, 16, 24, 32)),
])
def test_decode_graph_sizes(max_tokens, sizes):
    assert decode_graph_sizes(max_tokens) == sizes


def test_layout_pads_decode_steps_to_graph_sizes():
    """A decode step goes up to the smallest captured size that holds its largest rank's rows;
    a step past the largest size, and every mixed step, is padded as without graphs."""
    sizes = (2, 4, 8, 16, 24)

    def padded(rows, world=1, policy="replicated"):
        return plan_layout(GlobalStep(0, tuple(rows)), world, policy, graph_sizes=sizes).padded_tokens

    assert padded([decode_row(i) for i in range(3)]) == 4
    assert padded([decode_row(i) for i in range(17)]) == 24
    assert padded([decode_row(i) for i in range(30)]) == 30  # past the largest: eager, unpadded
    assert padded([decode_row(i) for i in range(9)], world=2, policy="round_robin") == 8  # 5 on rank 0
    assert padded([decode_row(0), prefill_row(1, 5)]) == 6  # mixed: never a graph
    assert plan_layout(GlobalStep(0, (decode_row(0),) * 3), 1, "replicated").padded_tokens == 3


def test_padding_step_writes_nothing():
    step = padding_step(8, 1, 2, GROUPS, lambda g: 3)
    assert step.num_tokens == 8 and step.num_real_tokens == 0
    assert torch.equal(step.meta["slot_mapping.kv"], torch.full((8,), -1))
    assert bool(step.meta["is_padding"].all())


def test_graphs_need_cuda():
    from pcppass.engine.runner import Engine
    from pcppass.models import build_model

    engine = Engine(build_model("llama", "tiny"), num_blocks=16, max_num_batched_tokens=16, max_model_len=64)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        engine.capture_decode_graphs()
    assert engine.graph_sizes == ()


def test_graphs_need_the_plan_validation():
    """Replays skip the cache-write ops' own checks of their slots: the engine's must be on."""
    from pcppass.engine.runner import Engine
    from pcppass.models import build_model

    engine = Engine(build_model("llama", "tiny"), num_blocks=16, max_num_batched_tokens=16, max_model_len=64,
                    validate=False)
    with pytest.raises(ValueError, match="need the engine's plan validation"):
        engine.capture_decode_graphs()


def captured_step(meta: dict[str, torch.Tensor], caches: dict[str, torch.Tensor]) -> CapturedStep:
    # the refusal reads only the static tensors' metadata and the caches' addresses
    return CapturedStep(graph=None, input_ids=torch.zeros(4, dtype=torch.int64),
                        positions=torch.zeros(4, dtype=torch.int64), meta=meta,
                        caches={k: cache_identity(v) for k, v in caches.items()}, hidden=torch.zeros(4, 2), sync=None)


def test_replay_refuses_inputs_and_caches_it_was_not_captured_on():
    meta = {"slot_mapping.kv": torch.full((4,), -1), "is_padding": torch.ones(4, dtype=torch.bool)}
    caches = {"k": torch.zeros(3, 4), "v": torch.zeros(3, 4)}
    captured = captured_step(meta, caches)
    ids = torch.zeros(4, dtype=torch.int64)
    refuse_other_inputs(captured, ids, ids, {k: v.clone() for k, v in meta.items()}, caches)  # fits

    with pytest.raises(ValueError, match="slot_mapping.kv.*torch.int32"):
        refuse_other_inputs(captured, ids, ids, {**meta, "slot_mapping.kv": meta["slot_mapping.kv"].int()}, caches)
    with pytest.raises(ValueError, match="positions"):
        refuse_other_inputs(captured, ids, torch.zeros(5, dtype=torch.int64), meta, caches)
    with pytest.raises(ValueError, match="differs from the captured"):
        refuse_other_inputs(captured, ids, ids, {"is_padding": meta["is_padding"]}, caches)
    with pytest.raises(ValueError, match=r"caches \['v'\] are not the tensors"):
        refuse_other_inputs(captured, ids, ids, meta, {"k": caches["k"], "v": caches["v"].clone()})
    with pytest.raises(ValueError, match=r"caches \['w'\]"):
        refuse_other_inputs(captured, ids, ids, meta, {**caches, "w": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"caches \['k'\]"):  # the same memory seen with another shape
        refuse_other_inputs(captured, ids, ids, meta, {"k": caches["k"].view(4, 3), "v": caches["v"]})


def test_digest_is_due_on_every_forced_step():
    """A graph runner's un-captured steps are digest-checked whatever the cadence; the cadence
    itself is unchanged, and a digest turned off stays off."""
    def due_calls(checks, forced_calls, calls=12):
        digest = StateDigestCheck([], None, checks, 0)
        out = []
        for call in range(calls):
            if call in forced_calls:
                with digest_forced():
                    out.append(digest.due())
            else:
                out.append(digest.due())
        return [i for i, d in enumerate(out) if d]

    cadence = SyncChecks(digest_first_steps=2, digest_every=5)
    assert due_calls(cadence, ()) == [0, 1, 5, 10]
    assert due_calls(cadence, (3, 7)) == [0, 1, 3, 5, 7, 10]
    assert due_calls(SyncChecks(state_digest=False), (3, 7)) == []


def digest_across_two_ranks(rank: int, world: int) -> dict:
    """State that already differs across ranks before a checked step: named by a forced check
    (replays since the last check wrote it), left to the step's own change by a regular one."""
    from pcppass.errors import PcpSyncError

    checks = SyncChecks(digest_first_steps=8)
    out = {}
    for forced in (False, True):
        digest = StateDigestCheck(["L['caches']['kv']"], None, checks, rank)
        cache = torch.full((4,), float(rank))  # differs across ranks before the step
        try:
            if forced:
                with digest_forced():
                    assert digest.due()
                    digest.before([cache])
                    digest.after([cache])
            else:
                assert digest.due()
                digest.before([cache])
                digest.after([cache])
            out[forced] = "passed"
        except PcpSyncError as exc:
            out[forced] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_forced_digest_names_state_that_diverged_before_the_step():
    from pcppass.engine.launch import launch

    for result in launch(digest_across_two_ranks, 2, backend="gloo", timeout_s=60):
        assert result[False] == "passed"
        assert "differed across ranks before this step" in result[True] and "L['caches']['kv']" in result[True]
