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
  omits a cache it writes, wherever the cache lives: a buffer, a parameter, an argument, or a
  tensor the op fetches through a Python lookup). On checked calls (the first
  ``digest_first_steps``, then every ``digest_every``-th; ``digest_every=1`` checks every call),
  every tensor argument of the graph (parameters included) and, with ``digest_outside``, every
  other live tensor of the process (``gc``) is digested before and after the step, and the
  digests of all ranks are gathered (one small all-gather, plus one ``all_gather_object`` of what
  changed outside the graph): a tensor that the step changed on some rank and that differs across
  ranks after it (whatever it was before) diverged in this step, and is named; module parameters
  and buffers, and arguments an earlier checked step changed, must also be equal on every rank
  before each checked step (else they diverged in an unchecked one).

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
from pcppass.runtime.collectives import all_gather_object_watched, all_gather_watched
from pcppass.sync.rows import restoring_on_failure

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
    return tuple(int(x) for x in _digest(t).tolist())


def _digest(t: torch.Tensor) -> torch.Tensor:
    """:func:`tensor_digest` as an int64 ``[2]`` tensor on ``t``'s device (no host read)."""
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = _widest_words(data)
    rows = t.shape[0] if t.dim() > 1 and words.numel() % t.shape[0] == 0 else 1
    words = words.view(rows, -1)
    by_row = words.sum(1, dtype=torch.int64)
    by_column = words.sum(0, dtype=torch.int64)
    row_weights = torch.arange(1, 2 * by_row.numel(), 2, dtype=torch.int64, device=t.device)
    column_weights = torch.arange(1, 2 * by_column.numel(), 2, dtype=torch.int64, device=t.device)
    weighted = (by_row * row_weights).sum() + (by_column * column_weights).sum()
    return torch.stack([by_row.sum(), weighted])


def _digests(tensors: Sequence[Any], whole_storage: bool = False) -> torch.Tensor:
    """``[len(tensors), 2]`` int64 on the host: each tensor's digest (of its whole storage with
    ``whole_storage``; zeros for a non-tensor), read back once per device."""
    out = torch.zeros(len(tensors), 2, dtype=torch.int64)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            by_device.setdefault(t.device, []).append((i, _digest(_whole_storage(t) if whole_storage else t)))
    for found in by_device.values():
        out[[i for i, _ in found]] = torch.stack([d for _, d in found]).cpu()
    return out


def _widest_words(data: torch.Tensor) -> torch.Tensor:
    """``data`` (flat uint8) as the widest integer words its size and alignment allow."""
    for width in (8, 4, 2):
        if data.numel() % width == 0 and (data.storage_offset() % width == 0):
            return data.view(_WORDS[width])
    return data


# ---------------------------------------------------------------------------------------------
# State outside the graph
# ---------------------------------------------------------------------------------------------

#: storages pcppass itself writes on every step, per rank (device status words, peer-store
#: mailboxes and epoch counters): never state
_NOT_STATE: dict[tuple, weakref.ref] = {}


def not_state(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t``'s storage as pcppass's own per-rank scratch, which the digest of live tensors
    outside the graph leaves out; returns ``t``."""
    storage = t.untyped_storage()
    _NOT_STATE[(t.device, storage.data_ptr())] = weakref.ref(t)
    return t


def _storage_key(t: torch.Tensor) -> tuple | None:
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage, as a flat uint8 tensor (views of one storage share it)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def outside_tensors(args: Sequence[Any]) -> list[torch.Tensor]:
    """One tensor per storage (digested whole) of every live tensor (``gc``) that none of ``args`` views,
    without pcppass's own scratch: state a step can reach only through a Python lookup (a cache
    in a module-global dict fetched by layer index inside an op). Fake, meta and wrapper-subclass
    tensors and sparse layouts are left out (``pcppass audit --dynamic`` names them)."""
    from pcppass.analysis.live_state import live_tensors
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    seen = {_storage_key(a) for a in args if isinstance(a, torch.Tensor)}
    seen.update(k for k, ref in list(_NOT_STATE.items()) if ref() is not None)
    found = []
    for t in live_tensors(collect=False):
        if t.layout != torch.strided or is_traceable_wrapper_subclass(t):
            continue
        key = _storage_key(t)
        if key is None or key in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(key)
        found.append(t)
    return found


#: op namespaces whose ops write only what their schema declares (and pcppass's own cache writes
#: and sync ops, which read no state they are not handed)
_TRUSTED_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d", "pcppass"})
_TRUSTED_MODULES = ("torch", "_operator", "operator", "builtins", "math")


def opaque_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The calls of ``gm`` whose code could reach state through a Python lookup (a custom op of a
    namespace other than torch's and pcppass's, a function Dynamo kept opaque): only those can
    write a tensor outside the graph's inputs, so only their graphs need the digest of live
    tensors outside the graph. Aten ops, torch functions and tensor methods touch their
    arguments only."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            continue  # a body the analysis sees, or a Triton kernel (no Python in it)
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            name = target.name() if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name
            if name.split("::")[0] not in _TRUSTED_NAMESPACES:
                found.append(name)
            continue
        if not getattr(target, "__module__", "").split(".")[0] in _TRUSTED_MODULES:
            found.append(getattr(target, "__qualname__", str(target)))
    return list(dict.fromkeys(found))


def _unmatched(mine: list[tuple], every_rank: list[list[tuple]]) -> list[int]:
    """Which of this rank's changed outside tensors (``(shape, dtype, before, after)``) no other
    rank changed alike: the multisets of what changed must be equal on every rank."""
    from collections import Counter

    counts = [Counter(entries) for entries in every_rank]
    return [i for i, entry in enumerate(mine) if any(c[entry] != counts[0][entry] for c in counts)] \
        if any(c != counts[0] for c in counts) else []


class StateDigestCheck:
    """See the module docstring. ``due()`` says whether this call is checked; then
    ``before(args)`` and ``after(args)`` around the step."""

    def __init__(self, names: Sequence[str | None], group: dist.ProcessGroup | None,
                 checks: SyncChecks, rank: int | None, outside: bool = True) -> None:
        self.names = [n if n is not None else f"input #{i}" for i, n in enumerate(names)]
        self.group = group
        self.checks = checks
        self.rank = rank
        #: digest live tensors outside the graph too (``digest_outside``, and the graph calls
        #: code that could reach them: :func:`opaque_calls`)
        self.outside = checks.digest_outside and outside
        self.calls = 0
        #: module parameters and buffers, and inputs seen changed by an earlier checked step:
        #: state that must be equal on every rank whenever a step is checked
        self.state = {i for i, n in enumerate(names) if n is not None and ("_parameters[" in n or "_buffers[" in n)}
        self._before = torch.zeros(0, 2, dtype=torch.int64)
        self._outside: list[torch.Tensor] = []
        self._outside_before = torch.zeros(0, 2, dtype=torch.int64)

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

    def before(self, args: Sequence[Any]) -> None:
        self._before = _digests(args)
        self._outside = outside_tensors(args) if self.outside else []
        self._outside_before = _digests(self._outside, whole_storage=True)

    def after(self, args: Sequence[Any]) -> None:
        after = _digests(args)
        mine = torch.cat([self._before, after], dim=1).to(_collective_device(self.group))
        # [world, args, 4]: before, after
        every = all_gather_watched(mine, self.group, "the state digest all-gather").cpu()
        changed = (every[:, :, :2] != every[:, :, 2:]).any(dim=2).any(dim=0)
        differs_after = (every[:, :, 2:] != every[:1, :, 2:]).any(dim=2).any(dim=0)
        differs_before = (every[:, :, :2] != every[:1, :, :2]).any(dim=2).any(dim=0)
        diverged = [self.names[i] for i in range(len(args)) if changed[i] and differs_after[i]]
        outside = self._outside_diverged()
        if diverged or outside:
            raise PcpSyncError(
                f"pcppass: rank {self.rank}: state diverged across ranks in this step (written in it, "
                f"different on the ranks after it): {', '.join(diverged + outside)}. Something wrote "
                "it outside the synchronised writes, e.g. a custom op whose mutates_args omits a cache "
                "it writes, or one that fetches a cache through a Python lookup. Declare the write "
                "(mutates_args, or a cache handle its pattern resolves) and cover it with a pattern."
            )
        # State that already differed before the step diverged in steps no digest saw: unchecked
        # calls, or steps replayed from a CUDA graph (a forced check follows those: every input).
        watched = range(len(args)) if _DIGEST_FORCED.get() else sorted(self.state)
        earlier = [self.names[i] for i in watched if differs_before[i]]
        self.state.update(i for i in range(len(args)) if changed[i])
        if earlier:
            raise PcpSyncError(
                f"pcppass: rank {self.rank}: state differed across ranks before this step: "
                f"{', '.join(earlier)}. It diverged since the last checked step, in steps no digest saw "
                "(unchecked calls, or calls replayed from a CUDA graph): something in them wrote it "
                "outside the synchronised writes. Declare the write (mutates_args) and cover it with a "
                "pattern; SyncChecks(digest_every=1) checks every call and names the step."
            )

    def _outside_diverged(self) -> list[str]:
        """Live tensors outside the graph that this step changed on some rank but not alike on
        all (matched by shape, dtype and digest before and after, so no rank needs the others'
        names): named by what holds them on this rank."""
        if not self.outside:
            return []
        from pcppass.analysis.live_state import holder_name

        after = _digests(self._outside, whole_storage=True)
        mine = [(tuple(t.shape), str(t.dtype), tuple(b), tuple(a)) for t, b, a in
                zip(self._outside, self._outside_before.tolist(), after.tolist()) if b != a]
        tensors = [t for t, b, a in zip(self._outside, self._outside_before.tolist(), after.tolist()) if b != a]
        every_rank = all_gather_object_watched(mine, self.group, _collective_device(self.group),
                                               "the state digest all-gather")
        names = [f"{holder_name(tensors[i], ignore=(self._outside, tensors))} (outside the graph)"
                 for i in _unmatched(mine, every_rank)]
        if not names and any(_unmatched(entries, every_rank) for entries in every_rank):
            names = ["a tensor outside the graph that another rank changed and this rank did not"]
        self._outside = []
        return names


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
    digest = (StateDigestCheck(names, group, checks, rank, outside=bool(opaque_calls(gm)))
              if checks.state_digest else None)

    def run(*args: Any) -> Any:
        if rebinding is not None:
            rebinding.before(args)
        checked = digest is not None and digest.due()
        if checked:
            digest.before(args)
        with restoring_on_failure():  # a step that fails before its verdict writes back its rows
            outputs = compiled(*args)
        if checked:
            digest.after(args)
        if rebinding is not None:
            rebinding.after(outputs)
        return outputs

    return run
