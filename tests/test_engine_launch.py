"""The local multi-process launcher: worker errors and timeouts (results by rank: test_engine_run)."""

from __future__ import annotations

import time

import pytest
import torch

from pcppass.engine.launch import default_backend, launch
from pcppass.runtime.collectives import all_gather_single


def _gather_ranks(rank: int, world: int, failing_rank: int):
    out = torch.zeros(world, dtype=torch.int64)
    all_gather_single(out, torch.tensor([rank * 10]))
    if rank == failing_rank:
        raise ValueError(f"rank {rank} refuses")
    return out.tolist()


def _sleep(rank: int, world: int):
    if rank == 0:
        time.sleep(120)
    return rank


@pytest.mark.timeout(120)
def test_launch_reports_a_failing_rank_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*ValueError: rank 1 refuses"):
        launch(_gather_ranks, 2, 1, backend="gloo", timeout_s=60)


@pytest.mark.timeout(90)
def test_launch_times_out_and_stops_workers():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="of 2 ranks did not finish within 10"):
        launch(_sleep, 2, backend="gloo", timeout_s=10)
    assert time.monotonic() - start < 60  # the sleeping rank was terminated, not waited for


def test_the_backend_follows_the_device_of_the_tensors():
    # imported before conftest's session fixture pins launch()'s default to gloo: the real function
    assert default_backend("cpu") == "gloo"
    assert default_backend("cuda") == default_backend("cuda:1") == "nccl"
    assert default_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
