"""Run-time checks of the state a sharded step keeps, around each call of the compiled step.

* :class:`RebindCheck`: state replaced instead of written in place. ``caches["k"] =
  caches["k"].index_copy(...)`` or ``self.buf = self.buf + 1`` inside the step becomes a graph
  output that Dynamo stores back into the dict or module AFTER the graph, where no replica sync sees
  it. The next call then receives, where that state sits, a tensor the previous call returned:
  refused before the step runs (on every rank: each receives its own rebound tensor), naming the
  state. The previous call is that of any graph of the backend (:class:`StepHistory`), so a
  rebinding that makes Dynamo recompile (a new shape) is refused by the new graph's first call.
  The rebound state itself was computed by the rebinding step on each rank alone. Arguments
  passed as bare locals (``L['x']``) cannot be rebound by the step and are not watched.
* :class:`StateDigestCheck`: a write the graph cannot see (a custom op whose ``mutates_args``
  omits a cache it writes). On checked calls (the first ``digest_first_steps``, then every
  ``digest_every``-th), every non-parameter tensor argument is digested before and after the
  step, and the digests of all ranks are gathered (one small all-gather): a tensor that was equal
  on every rank before the step and differs after it diverged in this step, and is named.

Both are configured by :class:`pcppass.checks.SyncChecks`. A step replayed from a CUDA graph runs
neither (no Python runs); a runner that replays steps runs some of them un-captured inside
:func:`digest_forced`, whose digest checks are then due whatever the cadence and also name state
that differed across ranks before the step (it diverged in a replay since the last check).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.fx

from pcppass.checks import SyncChecks
from pcppass.errors import PcpSyncError

#: set by :func:`digest_forced`
_DIGEST_FORCED: contextvars.ContextVar[bool] = contextvars.ContextVar("pcppass_digest_forced", default=False)
_BARE_LOCAL = re.compile(r"^L\['[^']*'\]$")
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def source_names(gm: torch.fx.GraphModule) -> list[str | None]:
    """The Dynamo source name of each placeholder (None where it has none)."""
    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        names.append((name() if callable(name) else name) if source is not None else None)
    return names


class StepHistory:
    """What the previous call of any graph of one backend returned, and which tensor each watched
    source held: shared by the graphs of the backend, so a rebinding that makes Dynamo recompile
    (the new tensor fails a guard) is refused by the new graph's first call too."""

    def __init__(self) -> None:
        self.input_ids: dict[str, int] = {}
        self.outputs: dict[int, weakref.ref] = {}


class RebindCheck:
    """See the module docstring. Call :meth:`before` with the step's arguments and
    :meth:`after` with its outputs."""

    def __init__(self, names: Sequence[str | None], rank: int | None,
                 history: StepHistory | None = None) -> None:
        #: argument position -> source name, for the state a step could rebind (parameters are
        #: left out: a decode step does not rebind weights, and there are many of them)
        self.watched = {i: n for i, n in enumerate(names)
                        if n is not None and not _BARE_LOCAL.match(n) and "_parameters[" not in n}
        self.rank = rank
        self.history = history or StepHistory()

    def before(self, args: Sequence[Any]) -> None:
        rebound = []
        seen, outputs = self.history.input_ids, self.history.outputs
        for i, name in self.watched.items():
            arg = args[i]
            if not isinstance(arg, torch.Tensor):
                continue
            returned = outputs.get(id(arg))
            if seen.get(name) != id(arg) and returned is not None and returned() is arg:
                rebound.append(name)
            seen[name] = id(arg)
        if rebound:
            raise PcpSyncError(
                f"pcppass: rank {self.rank}: the previous step replaced state instead of writing it "
                f"in place: {', '.join(rebound)} now hold(s) a tensor that step computed. Dynamo "
                "stores such values (`caches[name] = caches[name].index_copy(...)`, `self.buf = "
                "new_tensor`) after the graph, where no replica sync sees them, so each rank holds "
                "its own version. Write the state in place inside the graph (cache.index_copy_(...), "
                "a pcppass:: cache-write op). (A per-step input the caller feeds back from the "
                "previous step's outputs on purpose looks the same: SyncChecks(rebinding=False).)"
            )

    def after(self, outputs: Any) -> None:
        flat = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        self.history.outputs = {id(t): weakref.ref(t) for t in flat if isinstance(t, torch.Tensor)}


def tensor_digest(t: torch.Tensor) -> tuple[int, int]:
    """Two wrapping int64 sums over ``t``'s bytes as words: their total, and their row sums and
    column sums weighted by position (rows or words swapped between slots change it too). Two
    reductions over the tensor, no temporary of its size (words of 8 bytes when the size allows)."""
    if t.numel() == 0:
        return 0, 0
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = _widest_words(data)
    rows = t.shape[0] if t.dim() > 1 and words.numel() % t.shape[0] == 0 else 1
    words = words.view(rows, -1)
    by_row = words.sum(1, dtype=torch.int64)
    by_column = words.sum(0, dtype=torch.int64)
    row_weights = torch.arange(1, 2 * by_row.numel(), 2, dtype=torch.int64, device=t.device)
    column_weights = torch.arange(1, 2 * by_column.numel(), 2, dtype=torch.int64, device=t.device)
    weighted = (by_row * row_weights).sum() + (by_column * column_weights).sum()
    return int(by_row.sum()), int(weighted)


def _widest_words(data: torch.Tensor) -> torch.Tensor:
    """``data`` (flat uint8) as the widest integer words its size and alignment allow."""
    for width in (8, 4, 2):
        if data.numel() % width == 0 and (data.storage_offset() % width == 0):
            return data.view(_WORDS[width])
    return data


class StateDigestCheck:
    """See the module docstring. ``due()`` says whether this call is checked; then
    ``before(args)`` and ``after(args)`` around the step."""

    def __init__(self, names: Sequence[str | None], group: dist.ProcessGroup | None,
                 checks: SyncChecks, rank: int | None) -> None:
        self.names = [n if n is not None else f"input #{i}" for i, n in enumerate(names)]
        #: parameters are read-only in a decode step (and the largest tensors): never digested
        self.positions = [i for i, n in enumerate(names) if n is None or "_parameters[" not in n]
        self.group = group
        self.checks = checks
        self.rank = rank
        self.calls = 0
        self._before: list[tuple[int, int]] = []

    def due(self) -> bool:
        """Whether this call is checked. Never while a CUDA graph is being captured: the digest
        reads the device on the host (the call still counts)."""
        call, self.calls = self.calls, self.calls + 1
        if not self.checks.state_digest or _capturing():
            return False
        if _DIGEST_FORCED.get():
            return True
        every = self.checks.digest_every
        return call < self.checks.digest_first_steps or (every > 0 and call % every == 0)

    def _digests(self, args: Sequence[Any]) -> list[tuple[int, int]]:
        return [tensor_digest(args[i]) if isinstance(args[i], torch.Tensor) else (0, 0)
                for i in self.positions]

    def before(self, args: Sequence[Any]) -> None:
        self._before = self._digests(args)

    def after(self, args: Sequence[Any]) -> None:
        after = self._digests(args)
        mine = torch.tensor([list(b) + list(a) for b, a in zip(self._before, after)], dtype=torch.int64,
                            device=_collective_device(self.group))
        world = dist.get_world_size(self.group)
        every_rank = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every_rank, mine, group=self.group)
        every_rank = [r.cpu() for r in every_rank]
        diverged = [
            self.names[i] for k, i in enumerate(self.positions)
            if all(torch.equal(r[k, :2], every_rank[0][k, :2]) for r in every_rank)
            and not all(torch.equal(r[k, 2:], every_rank[0][k, 2:]) for r in every_rank)
        ]
        if diverged:
            raise PcpSyncError(
                f"pcppass: rank {self.rank}: state diverged across ranks in this step (equal on every "
                f"rank before it, different after): {', '.join(diverged)}. Something wrote it outside "
                "the synchronised writes, e.g. a custom op whose mutates_args omits a cache it writes. "
                "Declare the write (mutates_args) and cover it with a pattern."
            )
        # A forced check follows steps replayed from a CUDA graph, which no digest saw: state
        # that already differed before this step diverged in one of them.
        if not _DIGEST_FORCED.get():
            return
        earlier = [self.names[i] for k, i in enumerate(self.positions)
                   if not all(torch.equal(r[k, :2], every_rank[0][k, :2]) for r in every_rank)]
        if earlier:
            raise PcpSyncError(
                f"pcppass: rank {self.rank}: state differed across ranks before this step: "
                f"{', '.join(earlier)}. It diverged since the last checked step, in steps no digest saw "
                "(replayed from a CUDA graph): something in them wrote it outside the synchronised "
                "writes. Declare the write (mutates_args) and cover it with a pattern."
            )


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the digests must live for a collective on ``group``: an NCCL group takes CUDA tensors
    only (a CPU tensor fails with "No backend type associated with device type cpu")."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def digest_forced() -> Iterator[None]:
    """Every state-digest check of a step run in this context is due (where ``state_digest`` is
    on), and names state that differed across ranks already before the step too: the steps a
    CUDA-graph runner runs un-captured between replays, which no digest sees
    (:class:`pcppass.engine.graphs.CudaGraphRunner`)."""
    token = _DIGEST_FORCED.set(True)
    try:
        yield
    finally:
        _DIGEST_FORCED.reset(token)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def checking_state(compiled: Callable, gm: torch.fx.GraphModule, group: dist.ProcessGroup | None,
                   checks: SyncChecks, rank: int | None, history: StepHistory | None = None) -> Callable:
    """``compiled`` with the state rebinding and digest checks (see the module docstring);
    ``history``: shared by every graph of one backend."""
    names = source_names(gm)
    rebinding = RebindCheck(names, rank, history) if checks.rebinding else None
    digest = StateDigestCheck(names, group, checks, rank) if checks.state_digest else None

    def run(*args: Any) -> Any:
        if rebinding is not None:
            rebinding.before(args)
        checked = digest is not None and digest.due()
        if checked:
            digest.before(args)
        outputs = compiled(*args)
        if checked:
            digest.after(args)
        if rebinding is not None:
            rebinding.after(outputs)
        return outputs

    return run
