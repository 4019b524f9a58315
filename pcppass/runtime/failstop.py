"""Fail-stop: a rank that fails during a sharded step stops its process group.

Every rank of a sharded step meets the others in collectives (the sync all-gather, the engine's
hidden all-gather). A rank that raises before reaching one (bad inputs on that rank only, a
compile the others did not make) would leave its peers waiting there until the process-group
timeout (minutes). Aborting the group instead makes the peers' pending and next collectives fail
at once ("connection closed by peer" on gloo, an aborted communicator on NCCL); their own error
then says that a peer stopped, and the failing rank's error names the cause.
"""

from __future__ import annotations

import contextlib
import gc
import traceback
from typing import Any, Callable, Iterator, NoReturn

import torch.distributed as dist

from pcppass.errors import PcpCoverageError, PcpError, PcpSyncError
from pcppass.runtime import liveness
from pcppass.runtime.groups import abort_process_group, group_is_gone, world_as_none


def group_rank(group: dist.ProcessGroup | None) -> int | None:
    """This process's rank in ``group`` (None once the group is gone)."""
    try:
        return dist.get_rank(group) if dist.is_initialized() else None
    except (RuntimeError, ValueError):
        return None


def abort_group(group: dist.ProcessGroup | None, *, failed: bool = True) -> bool:
    """Abort ``group`` (None: the world group and every subgroup) so peers stop waiting on it.

    NCCL aborts its communicators; a gloo group closes its connections when the group object is
    destroyed, which is why callers pass the group they were configured with (None for the world
    group) rather than keep a resolved world group alive. With ``failed`` (this rank's own
    failure), the peers' liveness watches are told through the store, so they abort their groups
    too within one heartbeat interval (on NCCL nothing else would release a peer waiting in a
    collective). Idempotent: a group that is gone already is left alone. Returns True if this
    call aborted it.
    """
    if group_is_gone(group):
        return False
    group = world_as_none(group)
    if failed:
        watches = liveness.live_watches() if group is None else [liveness.watch_of(group)]
        for watch in filter(None, watches):
            watch.mark_failed()
    abort_process_group(group)
    return True


def stop_error(exc: BaseException, group: dist.ProcessGroup | None, rank: int | None,
               what: str, *, alone: bool = False) -> BaseException:
    """Abort ``group`` after ``exc`` on this rank and return the error to raise.

    A :class:`PcpCoverageError` is a compile-time decision every rank makes alike on the same
    graph: the group stays usable and the error is returned as it is, unless ``alone`` (the
    caller knows the compile may be this rank's alone, a recompile after steps that ran: peers
    may wait in a collective for it), then the group is aborted first. Any other
    :class:`PcpError` already names its cause and is returned as it is, after the abort, unless
    the liveness watch had found a peer dead (then whatever this rank saw next, such as an
    aborted collective's garbage, is a consequence, and the dead peer is named). Anything else
    (typically the collective that a peer's abort or death broke) becomes a :class:`PcpSyncError`
    that says which rank saw it, during what, and, from the liveness watch, which peer stopped
    beating or failed first. An error this function made is never wrapped again.
    """
    if getattr(exc, "from_fail_stop", False):
        return exc
    if isinstance(exc, PcpCoverageError):
        if alone:
            abort_group(group)
        return exc
    watch = liveness.watch_of(group)
    abort_group(group)
    if not isinstance(exc, Exception):
        return exc
    if isinstance(exc, PcpError):
        verdict = watch.verdict if watch is not None else None
        if verdict is None or verdict.kind != "dead":
            return exc
    else:
        # Naming the culprit takes a few heartbeat intervals: first let go of what the failed
        # collective's frames hold (the group), so a gloo group closes its connections now and
        # releases the peers still waiting on this rank.
        traceback.clear_frames(exc.__traceback__)
        gc.collect()
        verdict = watch.culprit() if watch is not None else None
    who = f"rank {rank}" if rank is not None else "this rank"
    text = str(exc).strip()
    first_line = text.splitlines()[0] if text else type(exc).__name__
    cause = verdict.sentence(watch.timeout_s) if verdict is not None else (
        "If another rank failed first, its own error names the cause (bad inputs on that rank, a "
        "compile on that rank only) and its abort of the process group is what broke this rank's "
        "collective.")
    error = PcpSyncError(
        f"pcppass: {who}: {what} failed ({type(exc).__name__}: {first_line}). {cause} The process "
        "group is aborted here too, so every rank stops instead of waiting for the collective timeout."
    )
    error.from_fail_stop = True
    return error


def refuse_after_verdict(watch: liveness.PeerWatch, rank: int | None, what: str) -> None:
    """Raise before a step whose peers' watch has a verdict: a peer is dead, failed or gone, so
    the step's collectives cannot complete (on gloo a wait on a hung peer would last until the
    process-group timeout). Nothing was written."""
    verdict = watch.verdict
    if verdict is not None:
        raise PcpSyncError(f"pcppass: rank {rank}: refusing to run {what}: "
                           f"{verdict.sentence(watch.timeout_s)} Nothing was written.")


def raise_fail_stop(exc: BaseException, group: dist.ProcessGroup | None, rank: int | None,
                    what: str, *, alone: bool = False) -> NoReturn:
    """Raise :func:`stop_error` of ``exc`` (call from an ``except`` block handling ``exc``)."""
    error = stop_error(exc, group, rank, what, alone=alone)
    if error is exc:
        raise exc
    raise error from exc


@contextlib.contextmanager
def fail_stop(group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run a rank's sharded steps inside this block: an exception escaping it (the caller's own
    code between steps included) aborts ``group`` (None: every group) and marks this rank failed
    for the peers' liveness watches, so a peer waiting for this rank in a collective fails within
    seconds although this process lives on (a server that catches the error). A
    :class:`PcpCoverageError` (every rank refuses the same graph) leaves the group as it is."""
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, PcpCoverageError) and not getattr(exc, "from_fail_stop", False):
            abort_group(group)
        raise


def fail_stopping(step: Callable, group: dist.ProcessGroup | None, rank: int | None,
                  what: str, watch: liveness.PeerWatch | None = None,
                  validate: Callable[[tuple], None] | None = None) -> Callable:
    """``step`` with fail-stop: any error it raises aborts ``group`` first (see :func:`stop_error`).

    ``validate(args)`` (the host input checks) runs before anything else, the watch's verdict
    included: when every rank got the same bad input, each names it, instead of the slower ones
    reporting only the abort of the first.

    With the group's liveness ``watch``: a step is refused before it runs once the watch has a
    verdict on a peer (dead, failed, or gone from the group before this step: its collectives
    would never complete); a step that returns although the watch aborted the group meanwhile (on
    NCCL an aborted collective ends without an error) raises, naming the peer. The watch counts
    the steps this rank started and finished (a rank that leaves the group publishes its count)."""

    def run(*args: Any) -> Any:
        try:
            if validate is not None:
                validate(args)
            if watch is not None:
                refuse_after_verdict(watch, rank, what)
                watch.started += 1
            outputs = step(*args)
        except BaseException as exc:
            raise_fail_stop(exc, group, rank, what)
        if watch is not None:
            watch.finished += 1
        if watch is not None and watch.aborted:
            error = PcpSyncError(
                f"pcppass: rank {rank}: {what} ran while its process group was aborted: "
                f"{watch.verdict.sentence(watch.timeout_s)} Its collectives did not complete, so "
                "its outputs and the state it wrote are not valid."
            )
            error.from_fail_stop = True
            raise error
        return outputs

    return run
