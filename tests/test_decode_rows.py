"""The sparse MLA split chosen for a deployment's decode rows per rank
(pcppass.engine.attention.launch.decode_rows_per_rank): the rule, and that the setting is scoped."""

import pytest
import torch

from pcppass.engine.attention import launch


def test_split_fills_the_sms_for_the_rows():
    """On an H200 (132 SMs, two programs of 64 heads per row of 128 heads, 2048 picks): 1024 picks
    per split from 30 rows (32 rows: 128 programs for 132 SMs), halved per halving of the rows
    down to 128 picks at 4 rows and fewer; in between, the largest split that gives at least 119
    programs (24 rows: 96 programs at 1024 picks, 192 at 512)."""
    chosen = {rows: launch.sparse_split_for(rows, 2, 2048, 132) for rows in (1, 2, 4, 8, 12, 16, 24, 32, 64, 256)}
    assert chosen == {1: 128, 2: 128, 4: 128, 8: 256, 12: 256, 16: 512, 24: 512, 32: 1024, 64: 1024, 256: 1024}
    assert launch.sparse_split_for(16, 2, 2048, 66) == 1024  # half the SMs: half the programs do
    assert launch.sparse_split_for(8, 2, 512, 132) == 128  # short rows: down to the smallest split


def test_setting_is_scoped_and_checked():
    cpu = torch.device("cpu")
    assert launch.sparse_tiles(128, 2048, cpu) == launch.SPARSE_MLA_TILES
    with launch.decode_rows_per_rank(8):
        assert launch.sparse_tiles(128, 2048, cpu).sparse_split == 256
        with launch.decode_rows_per_rank(None):
            assert launch.sparse_tiles(128, 2048, cpu) == launch.SPARSE_MLA_TILES
        with launch.decode_rows_per_rank(64):
            assert launch.sparse_tiles(128, 2048, cpu).sparse_split == 1024
        assert launch.sparse_tiles(128, 2048, cpu).sparse_split == 256
    assert launch.sparse_tiles(128, 2048, cpu) == launch.SPARSE_MLA_TILES
    with pytest.raises(ValueError, match="0 rows"):
        with launch.decode_rows_per_rank(0):
            pass
    with pytest.raises(RuntimeError):
        with launch.decode_rows_per_rank(4):
            raise RuntimeError("a failed step")
    assert launch.sparse_tiles(128, 2048, cpu) == launch.SPARSE_MLA_TILES


@pytest.mark.parametrize(("policy", "world", "expected"), [("replicated", 1, 12), ("replicated", 2, 12),
                                                           ("round_robin", 2, 6), ("round_robin", 4, 3),
                                                           ("sticky", 5, 3)])
def test_engine_launches_kernels_for_its_full_decode_batch(policy, world, expected):
    """An engine's steps run inside ``decode_rows_per_rank`` of its full decode batch: every one of
    ``max_num_seqs`` rows replicated, a ``1 / world`` share (rounded up) sharded, whatever the step."""
    from pcppass.engine.runner import Engine
    from pcppass.engine.workload import RequestSpec
    from pcppass.models import build_model

    model = build_model("llama", "tiny")
    seen = []

    def runner(input_ids, positions, meta, caches, step_kind):
        seen.append(launch._decode_rows)
        return model(input_ids, positions, meta, caches)

    engine = Engine(model, world=world, rank=0, policy=policy, partition_prefill=False, runner=runner,
                    num_blocks=32, max_num_seqs=12, max_num_batched_tokens=64, max_model_len=64, validate=False)
    assert engine.decode_rows_per_rank == expected
    if world == 1:  # (more ranks need a process group)
        engine.add_request(RequestSpec(req_id=0, prompt=[1, 2, 3], max_new_tokens=3))
        engine.run()
        assert seen and set(seen) == {expected}
        assert launch._decode_rows is None
