"""P long-lived gloo ranks on 127.0.0.1 that run commands, so many test examples share one spawn.

Starting P processes (Python, torch, pcppass, a process group, a compile) costs seconds; running one
small example on them costs milliseconds. :class:`RankPool` starts the ranks once and sends each
rank one command per example; ``handler(rank, world, state, command)`` runs in the rank (a
module-level function, importable by name: the ranks are spawned) with ``state``, a dict the rank
keeps between commands (a compiled model, caches).

A command that fails on any rank, or does not finish within its timeout, stops every rank: a failed
rank may have aborted the process group (fail-stop), so the pool restarts on the next command.
Nothing waits without a timeout.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from pcppass.engine.launch import free_port

#: process-group timeout of the ranks: the longest any collective waits for a missing peer
PG_TIMEOUT_S = 60.0
#: after one rank fails, how long the others get to report their own errors
FAILURE_GRACE_S = 15.0


class RankFailure(RuntimeError):
    """A command failed on some rank (the message carries every failing rank's traceback)."""


def _serve(rank: int, world: int, port: int, handler: Callable, commands, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    state: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    except BaseException:
        results.put((rank, -1, False, traceback.format_exc()))
        return
    while True:
        item = commands.get()
        if item is None:
            break
        seq, command = item
        try:
            results.put((rank, seq, True, handler(rank, world, state, command)))
        except BaseException:
            results.put((rank, seq, False, traceback.format_exc()))
            break  # the group may be aborted: this rank is done
    if dist.is_initialized():
        dist.destroy_process_group()


class RankPool:
    """``world`` ranks running ``handler``; see the module docstring."""

    def __init__(self, world: int, handler: Callable, start_timeout_s: float = 120.0) -> None:
        self.world = world
        self.handler = handler
        self.start_timeout_s = start_timeout_s
        self._procs: list = []
        self._seq = 0
        self.starts = 0

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(self.world)]
        port = free_port()
        self._procs = [
            ctx.Process(target=_serve, args=(r, self.world, port, self.handler, self._commands[r], self._results),
                        daemon=True)
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()
        self.starts += 1

    def run(self, per_rank: list[Any], timeout_s: float) -> list[Any]:
        """Send ``per_rank[r]`` to rank ``r``; their results by rank, or :class:`RankFailure` /
        ``TimeoutError`` (the pool is stopped then, and restarts on the next call)."""
        if len(per_rank) != self.world:
            raise ValueError(f"{len(per_rank)} commands for {self.world} ranks")
        if not self.alive:
            self.close()
            self._start()
            timeout_s += self.start_timeout_s
        self._seq += 1
        for r, command in enumerate(per_rank):
            self._commands[r].put((self._seq, command))
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) + len(failures) < self.world:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world)) - set(out) - set(failures))
                    detail = "".join(f"\n--- rank {r} failed:\n{tb}" for r, tb in sorted(failures.items()))
                    raise TimeoutError(f"ranks {missing} of {self.world} did not answer within {timeout_s:.0f} s"
                                       f"{detail}")
                try:
                    rank, seq, ok, value = self._results.get(timeout=min(left, 1.0))
                except queue_mod.Empty:
                    dead = [r for r, p in enumerate(self._procs)
                            if not p.is_alive() and r not in out and r not in failures]
                    for r in dead:
                        failures[r] = f"(process exited with code {self._procs[r].exitcode})"
                    continue
                if seq not in (self._seq, -1):
                    continue  # a late answer to an earlier, abandoned command
                if ok:
                    out[rank] = value
                else:
                    failures[rank] = value
                    # fail-stop makes the others fail within seconds; collect their errors, but
                    # never wait for the process-group timeout
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            if failures:
                raise RankFailure("".join(f"\n--- rank {r}:\n{tb}" for r, tb in sorted(failures.items())))
        except BaseException:
            self.close()
            raise
        return [out[r] for r in range(self.world)]

    def close(self) -> None:
        for q in getattr(self, "_commands", []):
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0  # for all ranks together: then they are killed
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self._procs = []
