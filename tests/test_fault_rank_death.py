"""A rank killed with SIGKILL in the middle of a decode-sharded step: its peers raise, promptly.

The victim has written its own cache rows but not joined the step's sync collective, which its
peers are about to enter (deferred sync of a decode step; or, in a mixed step, the immediate syncs
and the engine's hidden-row all-gather).

What bounds the peers' wait (gloo): the kernel closes the dead process's sockets, so a peer whose
gloo pair connects to the victim fails its pending collective at once ("connection closed by
peer"); pcppass's fail-stop then aborts that peer's process group, which closes its own
connections, so every other peer fails the same way. The bound is therefore a few seconds of
local work, independent of the process-group timeout (set far higher here, 120 s, to prove it is
not what ended the wait); the process-group timeout is the bound only where a dead peer's sockets
stay open (a lost host). Every peer stays alive for a while after its error, as a server would, so
a peer that only failed because another peer's process exited would miss the bound. The c10d store
timeout is not involved: the store is only used while compiling, which is done by then. Killing
rank 0 (which hosts the TCPStore) is a separate case.

Every peer's error names the dead rank: pcppass's liveness watch (``SyncChecks.liveness``, a
heartbeat per rank in the c10d store, read by a daemon thread) tells which peer stopped beating.
Where nothing closes a connection (NCCL, where the peers' collective would spin until the NCCL
watchdog takes the process down), the watch itself declares a silent peer dead after
``SyncChecks.liveness_timeout_s`` (and, on NCCL, aborts the process group): the third case shows
the verdict on gloo, with survivors that are not in a collective when the victim dies (they
pause), so only the watch can notice; their next step raises naming the victim. It also stalls one
live rank for longer than the timeout first, which must not be taken for a death (its heartbeat
thread beats on).

The ranks and the dying op live in ``tests/rank_fault.py``, which also runs the same cases on NCCL
(2 GPUs) as a script.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from rank_fault import EXIT_BOUND_S, GLOO_BOUND_S, FaultCase, run_fault_case


def _assert_peers_raised_promptly(summary: dict, case: FaultCase) -> None:
    assert summary["exitcodes"][case.victim] == -signal.SIGKILL, summary
    assert not summary["hung"], f"ranks {summary['hung']} still alive {EXIT_BOUND_S} s after the answers: {summary}"
    peers = [r for r in range(case.world) if r != case.victim]
    assert sorted(int(r) for r in summary["outcomes"]) == peers, summary
    for o in summary["outcomes"].values():
        assert o["armed_step"] is not None and o["steps_done"] == o["armed_step"], o
        assert o["kinds"][o["armed_step"]] == case.step_kind, o
        assert o["error"] == "PcpSyncError", o
        assert f"rank {o['rank']}" in o["message"] and "failed" in o["message"], o["message"]
        assert f"Rank {case.victim} stopped responding: no heartbeat" in o["message"], o["message"]
        assert o["after_death_s"] is not None and 0 <= o["after_death_s"] < case.pause_s + GLOO_BOUND_S, o
        # the watch declared the victim dead while the survivor paused (only then: a live, stalled
        # rank is never declared dead)
        assert o["declared_before_step"] is bool(case.pause_s), o
    assert all(summary["exitcodes"][r] == 0 for r in peers), summary


GLOO_CASES = [
    # four ranks: the ranks whose gloo ring touches the victim fail on its closed sockets, the
    # others only through their abort (fail-stop)
    FaultCase(world=4, victim=3, step_kind="decode"),
    # rank 0 hosts the TCPStore; killed during a mixed step (immediate syncs, then the engine's all-gather)
    FaultCase(world=2, victim=0, step_kind="mixed"),
    # the victim dies while its peer pauses (no collective to break): the peer's liveness watch
    # declares it dead after its timeout and aborts the group, the next step raises naming it.
    # Before that, rank 0 stalls 2x the timeout while its peer waits for it: alive, not dead
    FaultCase(world=2, victim=1, step_kind="decode", pause_s=5.0, stall_s=3.0, liveness_timeout_s=1.5,
              liveness_interval_s=0.25),
]


@pytest.mark.timeout(240)
def test_sigkill_mid_step_peers_raise_within_bound():
    # the cases are independent process groups: run them side by side
    with ThreadPoolExecutor(len(GLOO_CASES)) as pool:
        summaries = list(pool.map(lambda case: run_fault_case(case, deadline_s=150.0), GLOO_CASES))
    for case, summary in zip(GLOO_CASES, summaries):
        _assert_peers_raised_promptly(summary, case)
