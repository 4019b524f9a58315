"""The sparse MLA split chosen for a deployment's decode rows per rank
(pcppass.kernels.attention.launch.decode_rows_per_rank): the rule, and that the setting is scoped."""

import pytest
import torch

from pcppass.kernels.attention import launch


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
