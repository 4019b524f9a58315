"""Peer liveness: a dead or hung rank is named, and its peers' collectives are aborted, in bounded time.

A rank that dies (SIGKILL, OOM killer, a lost host) never joins the collective its peers wait in.
On gloo the kernel closes the dead process's sockets and the peers' collective fails at once; on
NCCL nothing tells the peers: their collective spins until the NCCL watchdog's timeout, which then
takes the process down (SIGABRT, no Python exception: pcppass's fail-stop never runs).

Each rank of a sharded step therefore runs one :class:`PeerWatch` per process group, a daemon
thread that, every ``SyncChecks.liveness_interval_s``, increments this rank's heartbeat counter in
the c10d store and reads every peer's. A peer whose counter has not moved for
``SyncChecks.liveness_timeout_s`` is declared dead; a peer whose fail-stop aborted its own group
(:func:`pcppass.runtime.failstop.abort_group` marks it failed in the store) is declared failed. The
watch then aborts this rank's group (``_abort_process_group``: on NCCL ``ncclCommAbort`` ends the
in-flight collective) and keeps the verdict, which pcppass's fail-stop turns into a
:class:`~pcppass.errors.PcpSyncError` naming the rank. Bound: a dead peer is declared at most
``liveness_timeout_s + liveness_interval_s`` after its last heartbeat; a failed one within one
interval. The step's hot path does nothing: the thread works beside it (a few store round trips
per interval, on its own connection to the store).

Store keys, all updated with ``add`` (which never waits for a key), under
``pcppass/live/{group}/``: ``beat/{r}`` (counter), ``state/{r}`` (0 running, -1 left cleanly: the
group was destroyed by its owner, k > 0 failed as the k-th rank to fail, ``failures`` counts
them). A peer that has not beaten yet (still compiling; the compile fingerprint exchange bounds
that) or that left cleanly is never declared dead.

Limits: on gloo an abort does not interrupt a collective already waiting on a peer whose sockets
stay open (a hung, not dead, process): that wait ends at the process-group timeout, and the error
then names the hung rank. If the store's host (global rank 0) dies, the store becomes unreachable:
after ``liveness_timeout_s`` of failed store calls (retried every quarter of it) it is declared
dead. A rank that exits without destroying its process group looks dead to peers that outlive it
by more than the timeout: they abort their group (harmless once no collective is left to run).
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

if TYPE_CHECKING:
    from pcppass.checks import SyncChecks

log = logging.getLogger(__name__)

_LEFT = -1


@dataclass(frozen=True)
class Verdict:
    """Why a peer stopped: ``dead`` (no heartbeat for ``silent_s``) or ``failed`` (its own error)."""

    rank: int | str
    kind: Literal["dead", "failed"]
    silent_s: float = 0.0

    def sentence(self, timeout_s: float) -> str:
        if self.kind == "failed":
            return (f"Rank {self.rank} failed first (its own error names the cause) and aborted the "
                    "process group, which broke this rank's collective.")
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
        #: this rank's place among the ranks that failed (0: it has not)
        self.failed_ordinal = 0
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (last beat, when it changed)
        self._store_lost_since: float | None = None
        self._left = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pcppass-liveness-{self.name}", daemon=True)

    def _add(self, key: str, delta: int) -> int:
        return int(self.store.add(self.prefix + key, delta))

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
        while not self._left.wait(self.interval_s if self._store_lost_since is None else self.timeout_s / 4):
            done = self.failed_ordinal or self.verdict is not None
            try:
                self._add(f"beat/{self.rank}", 1)  # beats on after a failure: failed, not dead
            except Exception as exc:  # the store's host is gone (or hangs); retried less often
                log.debug("pcppass: liveness store call failed: %r", exc)
                if done:
                    return  # nobody is left to tell
            if done:
                continue
            if not self.alive():
                self._leave()
                return
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
        return dead[0] if dead else Verdict(failed[0][1], "failed") if failed else None

    def _declare(self, verdict: Verdict) -> None:
        from pcppass.runtime.failstop import abort_group_by_id

        self.verdict = verdict
        log.error("pcppass: rank %s: %s Aborting the process group.", self.rank, verdict.sentence(self.timeout_s))
        abort_group_by_id(self._pg_id)

    def _leave(self) -> None:
        """The group was destroyed by its owner: say so, so peers still running do not call this
        rank dead, and stop."""
        self._left.set()
        try:
            self._add(f"state/{self.rank}", _LEFT)
        except Exception:  # the store went with the group: nobody is left to tell
            pass

    # ------------------------------------------------------------------ the fail-stop path

    def mark_failed(self) -> None:
        """This rank's fail-stop aborts the group: tell the peers (their watches abort theirs)."""
        if self.failed_ordinal or self._left.is_set():
            return
        try:
            ordinal = self._add("failures", 1)
            self._add(f"state/{self.rank}", ordinal)
            self.failed_ordinal = ordinal
        except Exception as exc:
            log.debug("pcppass: could not mark this rank failed in the store: %r", exc)

    def culprit(self) -> Verdict | None:
        """Who broke this rank's step: a peer that stopped beating (watched for three intervals),
        else the peer that failed first; None if every peer is alive and none failed first."""
        if self.verdict is not None and self.verdict.kind == "dead":
            return self.verdict
        try:
            first = self._peers()
            time.sleep(3 * self.interval_s)
            last = self._peers()
        except Exception:
            return Verdict(self.store_host, "dead", 3 * self.interval_s)
        now = time.monotonic()
        dead = [Verdict(r, "dead", max(3 * self.interval_s, now - self._seen.get(r, (0, now))[1]))
                for r, (beat, state) in last.items()
                if beat == first[r][0] and beat > 0 and state != _LEFT]
        mine = self.failed_ordinal or float("inf")
        failed = sorted((state, r) for r, (_, state) in last.items() if 0 < state < mine)
        return dead[0] if dead else Verdict(failed[0][1], "failed") if failed else self.verdict


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


def live_watches() -> list[PeerWatch]:
    """Every watch whose group still exists (``abort_group(None)`` aborts all of them)."""
    return [w for w in list(_watches.values()) if w.alive()]


@atexit.register
def _stop_watches() -> None:
    """At exit: a rank that destroyed its group says it left (peers still running must not call
    it dead); every heartbeat thread stops before the interpreter and the store's server go
    (a thread left in a store call then would abort the process)."""
    for watch in list(_watches.values()):
        if not watch.alive() and not watch.failed_ordinal and watch.verdict is None:
            watch._leave()
        watch._left.set()
    for watch in list(_watches.values()):
        watch._thread.join(timeout=2.0)
