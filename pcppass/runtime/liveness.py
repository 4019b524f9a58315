"""Peer liveness: a dead, hung or failed rank is named, and on NCCL its peers' collectives end, in
bounded time.

A rank that dies (SIGKILL, OOM killer, a lost host) never joins the collective its peers wait in.
On gloo the kernel closes the dead process's sockets and the peers' collective fails at once; on
NCCL nothing tells the peers: their collective spins until the NCCL watchdog's timeout, which then
takes the process down (SIGABRT, no Python exception: pcppass's fail-stop never runs). The same
holds for a peer that fails and aborts its own communicator: NCCL does not tell the others.

Each rank of a sharded step therefore runs one :class:`PeerWatch` per process group, a daemon
thread that, every ``SyncChecks.liveness_interval_s``, increments this rank's heartbeat counter in
the c10d store and reads every peer's. A peer whose counter has not moved for
``SyncChecks.liveness_timeout_s`` is declared dead; a peer whose fail-stop aborted its own group
(:func:`pcppass.runtime.failstop.abort_group` marks it failed in the store) is declared failed. The
watch keeps the verdict, which pcppass's fail-stop turns into a
:class:`~pcppass.errors.PcpSyncError` naming the rank, and on NCCL aborts this rank's group
(``_abort_process_group``: ``ncclCommAbort`` ends the waiting collective). On gloo it does not
abort: the waiting collective fails by itself once the peer's sockets close, and an abort from
this thread while a gloo collective waits was seen to keep the wait going until the peers' processes
exited. Bound: a dead peer is declared at most ``liveness_timeout_s + liveness_interval_s`` after
its last heartbeat; a failed one within one interval. The step's hot path does nothing: the thread
works beside it (a few store round trips per interval, on its own connection to the store).

Store keys, all updated with ``add`` (which never waits for a key), under
``pcppass/live/{group}/``: ``beat/{r}`` (counter), ``state/{r}`` (0 running, -1 left: the group
was destroyed by its owner or the process exits with it, k > 0 failed as the k-th rank to fail,
``failures`` counts them), ``finished/{r}`` (the sharded steps a rank that left had finished). A
peer that has not beaten yet (still compiling; the compile fingerprint exchange bounds that) or
that left is never declared dead; one that left after fewer sharded steps than this rank has
started is declared ``left``: it will never join this rank's step.

On gloo nothing ends a collective waiting on a peer whose sockets stay open (a hung, not dead,
process): an abort does not interrupt it. pcppass's host collectives therefore wait through
:func:`wait_watched`, in slices of one interval, and raise once the watch has a verdict.

Limits: a gloo collective waited for otherwise (the state digest's, a caller's own) ends only at
the process-group timeout; its error then names the hung rank. If the store's host (global rank
0) dies, the store becomes unreachable: after ``liveness_timeout_s`` of failed store calls
(retried every quarter of it) it is declared dead.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch.distributed as dist

from pcppass.runtime.groups import abort_group_by_id

if TYPE_CHECKING:
    from pcppass.checks import SyncChecks

log = logging.getLogger(__name__)

_LEFT = -1


@dataclass(frozen=True)
class Verdict:
    """Why a peer stopped: ``dead`` (no heartbeat for ``silent_s``), ``failed`` (its own error) or
    ``left`` (it destroyed the group, or its process exited, after ``steps`` sharded steps, while
    this rank runs a later one)."""

    rank: int | str
    kind: Literal["dead", "failed", "left"]
    silent_s: float = 0.0
    steps: int = 0

    def sentence(self, timeout_s: float) -> str:
        if self.kind == "failed":
            return (f"Rank {self.rank} failed first (its own error names the cause) and aborted the "
                    "process group, which broke this rank's collective.")
        if self.kind == "left":
            return (f"Rank {self.rank} left the process group (destroyed it, or its process exited) "
                    f"after {self.steps} sharded step(s), and this rank runs a later one: it will "
                    "never join that step's collectives (an error on that rank outside pcppass "
                    "ended its run; its own output names it).")
        return (f"Rank {self.rank} stopped responding: no heartbeat for {self.silent_s:.1f} s (it "
                "died or hangs; every rank's heartbeat is watched in the c10d store, and a silent "
                f"rank is declared dead after SyncChecks.liveness_timeout_s = {timeout_s:g} s).")


def _private_store(store: dist.Store, timeout_s: float) -> dist.Store:
    """A connection of our own to ``store``'s server (a TCPStore client serialises its calls:
    sharing the default one would queue heartbeats behind a compile's long ``wait``)."""
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    return base


class PeerWatch:
    """The heartbeat thread of one process group (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, checks: "SyncChecks") -> None:
        from torch.distributed import distributed_c10d as c10d

        pg = group if group is not None else c10d.GroupMember.WORLD
        self.name: str = c10d._world.pg_names[pg]
        self._pg_id = id(pg)  # never the group itself: a gloo group closes only once unreferenced
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.interval_s = checks.liveness_interval_s
        self.timeout_s = checks.liveness_timeout_s
        ranks = c10d.get_process_group_ranks(pg)
        #: the group rank of the store's host (global rank 0), else a label
        self.store_host: int | str = ranks.index(0) if 0 in ranks else "the c10d store's host (global rank 0)"
        default_store = c10d._get_default_store()
        self.store = _private_store(default_store, min(self.timeout_s, 5.0))
        # On the store's host, the server lives as long as the default store object: keep it, or
        # aborting the group (which drops the default store) would silence every heartbeat.
        self._server = default_store
        self.prefix = f"pcppass/live/{self.name}/"
        #: set by the thread once a peer is declared dead or failed (read on the fail-stop path)
        self.verdict: Verdict | None = None
        #: whether the watch aborts the group on a verdict (NCCL), and did
        self.aborts = "nccl" in str(dist.get_backend(pg)).lower()
        self.aborted = False
        #: this rank's place among the ranks that failed (0: it has not)
        self.failed_ordinal = 0
        self._state = 0  # this rank's state key: 0 running, then once _LEFT or its failure ordinal
        #: sharded steps on this group that this process started and finished (counted by
        #: pcppass.runtime.failstop.fail_stopping; a rank that leaves publishes ``finished``)
        self.started = 0
        self.finished = 0
        self._state_lock = threading.Lock()
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (last beat, when it changed)
        self._store_lost_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pcppass-liveness-{self.name}", daemon=True)

    def _add(self, key: str, delta: int) -> int:
        return int(self.store.add(self.prefix + key, delta))

    def _set_state(self, value: int) -> bool:
        """Leave the running state for ``value`` (once: a failed rank never turns into a rank that
        left, whichever thread gets there first); False if it had left it already."""
        with self._state_lock:
            if self._state != 0:
                return False
            self._add(f"state/{self.rank}", value)
            self._state = value
            return True

    def _peers(self) -> dict[int, tuple[int, int]]:
        """Every peer's (beat, state)."""
        return {r: (self._add(f"beat/{r}", 0), self._add(f"state/{r}", 0))
                for r in range(self.world) if r != self.rank}

    def start(self) -> "PeerWatch":
        self._add(f"state/{self.rank}", 0)
        self._add(f"beat/{self.rank}", 1)
        self._thread.start()
        return self

    def alive(self) -> bool:
        """Whether the watched group still exists in this process."""
        from torch.distributed import distributed_c10d as c10d

        return any(id(pg) == self._pg_id for pg in list(c10d._world.pg_map))

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s if self._store_lost_since is None else self.timeout_s / 4):
            done = self._state != 0 or self.verdict is not None
            try:
                self._add(f"beat/{self.rank}", 1)  # beats on after a failure: failed, not dead
            except Exception as exc:  # the store's host is gone (or hangs); retried less often
                log.debug("pcppass: liveness store call failed: %r", exc)
                if done:
                    return  # nobody is left to tell
            if done:
                continue
            if not self.alive():
                if self._leave():
                    return
                continue  # pcppass's fail-stop aborted it: failed, beating on
            verdict = self._judge(time.monotonic())
            if verdict is not None:
                self._declare(verdict)

    def _judge(self, now: float) -> Verdict | None:
        """A peer that failed or stopped beating; None while every peer is alive."""
        try:
            peers = self._peers()
        except Exception:
            self._store_lost_since = self._store_lost_since or now
            silent = now - self._store_lost_since
            return Verdict(self.store_host, "dead", silent) if silent > self.timeout_s else None
        self._store_lost_since = None
        for r, (beat, _) in peers.items():
            if self._seen.get(r, (None,))[0] != beat:
                self._seen[r] = (beat, now)
        dead = [Verdict(r, "dead", now - self._seen[r][1]) for r, (beat, state) in peers.items()
                if beat > 0 and state != _LEFT and now - self._seen[r][1] > self.timeout_s]
        failed = sorted((state, r) for r, (_, state) in peers.items() if state > 0)
        return (dead[0] if dead else Verdict(failed[0][1], "failed") if failed
                else self._left_before_this_step(peers))

    def _left_before_this_step(self, peers: dict[int, tuple[int, int]]) -> Verdict | None:
        """A peer that left the group after fewer sharded steps than this rank has started: it
        will never join this rank's current (or next) step. A peer that left after the same
        number of steps finished its run with this rank and is no culprit."""
        started = self.started
        for r, (_, state) in sorted(peers.items()):
            if state == _LEFT:
                steps = self._add(f"finished/{r}", 0)
                if started > steps:
                    return Verdict(r, "left", steps=steps)
        return None

    def _declare(self, verdict: Verdict) -> None:
        """Keep the verdict; on NCCL abort the group: its waiting collective would spin forever.
        A gloo collective fails by itself once a dead or failed peer's sockets close, and aborting
        a gloo group from this thread while a collective waits can keep that wait from ending."""
        self.verdict = verdict
        log.error("pcppass: rank %s: %s%s", self.rank, verdict.sentence(self.timeout_s),
                  " Aborting the process group." if self.aborts else "")
        if self.aborts:
            abort_group_by_id(self._pg_id)
            self.aborted = True

    def _leave(self) -> bool:
        """The group was destroyed by its owner (or the process exits): say so, with the sharded
        steps this rank finished, so peers still running do not call this rank dead, and a peer
        that runs a later step knows at once that it never will join it; then stop. False if this
        rank had failed (then it beats on)."""
        try:
            if self._state == 0:
                self._add(f"finished/{self.rank}", self.finished)
            left = self._set_state(_LEFT)
        except Exception:  # the store went with the group: nobody is left to tell
            left = True
        if left:
            self._stop.set()
        return left

    # ------------------------------------------------------------------ the fail-stop path

    def mark_failed(self) -> None:
        """This rank's fail-stop aborts the group: tell the peers (their watches name this rank,
        and on NCCL abort their groups)."""
        try:
            ordinal = self._add("failures", 1)
            if self._set_state(ordinal):
                self.failed_ordinal = ordinal
        except Exception as exc:
            log.debug("pcppass: could not mark this rank failed in the store: %r", exc)

    def culprit(self) -> Verdict | None:
        """Who broke this rank's step: a peer that stopped beating, else the peer that failed
        first; None if every peer is alive and none failed first.

        The peers' beats are watched for three intervals. Peers stalled in their own error handling
        (aborting a gloo group can hold the interpreter a while) miss beats too, but resume: while
        more than one is silent, the watch goes on, up to ten intervals; then the dead peer is the
        silent one whose beat this rank's watch saw change least recently.
        """
        if self.verdict is not None and self.verdict.kind == "dead":
            return self.verdict
        start = time.monotonic()
        try:
            first = self._peers()
            silent = set(first)
            while True:
                time.sleep(self.interval_s / 2)
                last = self._peers()
                silent = {r for r in silent if last[r][0] == first[r][0] and last[r][0] > 0
                          and last[r][1] != _LEFT}
                waited = time.monotonic() - start
                if waited >= 10 * self.interval_s or (waited >= 3 * self.interval_s and len(silent) <= 1):
                    break
        except Exception:
            return Verdict(self.store_host, "dead", time.monotonic() - start)
        now = time.monotonic()
        oldest = sorted((self._seen.get(r, (0, now))[1], r) for r in silent)
        if oldest:
            when, r = oldest[0]
            return Verdict(r, "dead", max(now - start, now - when))
        mine = self.failed_ordinal or float("inf")
        failed = sorted((state, r) for r, (_, state) in last.items() if 0 < state < mine)
        if failed:
            return Verdict(failed[0][1], "failed")
        try:
            return self._left_before_this_step(last) or self.verdict
        except Exception:
            return self.verdict


_lock = threading.Lock()
#: id() of the watched group -> its watch (kept after the group is aborted: the fail-stop path
#: reads the verdict then)
_watches: dict[int, PeerWatch] = {}
_world_id: list[int] = []  # id() of the world group the last world watch was started for


def _group_id(group: dist.ProcessGroup | None) -> int | None:
    from torch.distributed import distributed_c10d as c10d

    if group is None or group is c10d.GroupMember.WORLD:
        return _world_id[-1] if _world_id else None
    return id(group)


def watch_peers(group: dist.ProcessGroup | None, checks: "SyncChecks") -> PeerWatch | None:
    """The running watch of ``group``, started on first use; None when ``checks.liveness`` is
    off or the group has one rank."""
    from torch.distributed import distributed_c10d as c10d

    if not checks.liveness or not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return None
    pg = group if group is not None else c10d.GroupMember.WORLD
    with _lock:
        watch = _watches.get(id(pg))
        if watch is None or not watch.alive() or watch.name != c10d._world.pg_names.get(pg):
            watch = _watches[id(pg)] = PeerWatch(pg, checks).start()
            if pg is c10d.GroupMember.WORLD:
                _world_id.append(id(pg))
        return watch


def watch_of(group: dist.ProcessGroup | None) -> PeerWatch | None:
    """The watch started for ``group`` (None: the world group), even after the group was
    aborted; None if no sharded step was compiled on it."""
    return _watches.get(_group_id(group))


def wait_watched(work: dist.Work, group: dist.ProcessGroup | None, what: str) -> None:
    """Wait for ``work``, a collective on host tensors (gloo) of ``group``, for as long as every
    peer is alive (not for NCCL: a wait with a timeout there blocks the host, and the watch's
    abort of the communicator ends an NCCL collective anyway).

    Nothing ends a gloo collective waiting on a peer whose sockets stay open (a stopped process, a
    lost host): not an abort, only the process-group timeout. So the wait goes in slices of one
    heartbeat interval, and once this rank's watch declares a peer dead or failed it raises
    :class:`~pcppass.errors.PcpSyncError` naming the peer, within ``liveness_timeout_s`` plus an
    interval of the peer's last beat. The abandoned collective stays with the backend's worker
    thread until the process-group timeout, which the process's exit may wait for. A collective
    that fails by itself (a peer's closed connection) raises its own error at once. Without a
    watch (liveness off, one rank) this is ``work.wait()``."""
    watch = watch_of(group)
    if watch is None:
        work.wait()
        return
    piece = datetime.timedelta(seconds=watch.interval_s)
    while True:
        try:
            work.wait(piece)
            return
        except RuntimeError:
            if work.is_completed():
                raise  # the collective failed by itself: its error says how
        verdict = watch.verdict
        if verdict is not None:
            from pcppass.errors import PcpSyncError

            raise PcpSyncError(
                f"pcppass: rank {watch.rank}: {what} cannot complete: {verdict.sentence(watch.timeout_s)} "
                "This rank stopped waiting for it."
            )


def live_watches() -> list[PeerWatch]:
    """Every watch whose group still exists (``abort_group(None)`` aborts all of them)."""
    return [w for w in list(_watches.values()) if w.alive()]


@atexit.register
def _stop_watches() -> None:
    """At exit: a rank says it left, with the sharded steps it finished (peers still running must
    not call it dead, and a peer running a later step must not wait for it); every heartbeat
    thread stops before the interpreter and the store's server go (a thread left in a store call
    then would abort the process)."""
    for watch in list(_watches.values()):
        if watch.verdict is None:
            watch._leave()  # the group destroyed, or this process ending with it: it left
        watch._stop.set()
    for watch in list(_watches.values()):
        watch._thread.join(timeout=2.0)
