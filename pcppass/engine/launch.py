"""Run a function on P ranks: local processes (:func:`launch`) or under torchrun (:func:`run_from_env`).

``fn(rank, world, *args)`` runs after ``torch.distributed`` is initialised (gloo on CPU, NCCL on
CUDA, with a timeout so a mismatched collective fails instead of hanging) and its return value
comes back to the caller: through a result queue for local processes, through one
``torch.save`` file per rank under torchrun. ``fn`` must be importable by name (a module-level
function) because workers are started with ``spawn``.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device: str | None = None) -> str:
    """The process-group backend for tensors on ``device``: NCCL for ``cuda``, gloo for ``cpu``;
    without a device, NCCL where CUDA is available. A CPU run on a GPU host must say ``cpu``: NCCL
    has no CPU collectives ("No backend type associated with device type cpu")."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _init(rank: int, world: int, backend: str, timeout_s: float) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def _worker(rank, world, port, backend, timeout_s, fn, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # One thread per rank: ranks share the cores, and oversubscribed OpenMP only slows collectives.
    torch.set_num_threads(1)
    try:
        _init(rank, world, backend, timeout_s)
        try:
            results.put((rank, True, fn(rank, world, *args)))
        finally:
            if dist.is_initialized():  # a failure may have aborted the group already (fail-stop)
                dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def launch(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` local processes; return the results by rank.

    Raises ``RuntimeError`` with the worker's traceback if a rank fails, ``TimeoutError`` if the
    ranks do not all finish within ``timeout_s`` (the workers it started are then terminated).
    """
    backend = backend or default_backend()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world, port, backend, timeout_s, fn, args, results),
            daemon=True,
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{world - len(out)} of {world} ranks did not finish within {timeout_s} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} exited with codes {[procs[i].exitcode for i in dead]}")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        # After a failure the other ranks may wait in a collective for the failed one: stop them
        # now instead of waiting for the process-group timeout.
        grace = 10.0 if len(out) == world else 0.0
        for p in procs:
            p.join(timeout=max(0.0, min(grace, deadline - time.monotonic())))
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
    return [out[r] for r in range(world)]


def run_from_env(
    fn: Callable[..., Any], *args: Any, result_dir: str | os.PathLike | None = None, timeout_s: float = 600.0
) -> Any:
    """Run ``fn(rank, world, *args)`` in a process started by torchrun (RANK, WORLD_SIZE, ...).

    Returns this rank's result and, with ``result_dir``, also saves it to
    ``result_dir/rank{rank}.pt`` so the caller of torchrun can collect every rank's result.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if result_dir is not None:
        Path(result_dir).mkdir(parents=True, exist_ok=True)
        torch.save(result, Path(result_dir) / f"rank{rank}.pt")
    return result
