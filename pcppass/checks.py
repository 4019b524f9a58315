"""The switches of every safety check pcppass performs, in one place (:class:`SyncChecks`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncChecks:
    """Run-time and compile-time checks, all on by default.

    On CUDA the per-step checks (``inputs``, ``header``, ``slot_conflicts``) run on the device,
    inside the captured step, and leave a status word the next step reads without a host sync
    (``pcppass.sync.device_checks``): measured on 2x H200 they add 1-10 us per decode step
    (<= 0.4%, docs/BENCH.md). On CPU they run on the host. ``state_digest`` reads the state on the
    host and is skipped while a CUDA graph is captured; ``rebinding`` and ``liveness`` are host
    only and off the step's path."""

    #: validate slot-mapping inputs (dtype, length, range) before the graph runs
    inputs: bool = True
    #: compare every rank's graph fingerprint in each sync header
    header: bool = True
    #: refuse a slot written by two ranks in one step
    slot_conflicts: bool = True
    #: in a graph dynamic in the row count, compare every rank's row counts before each call
    #: (one small host collective per step): ranks with different counts would hand the sync
    #: all-gather buffers of different sizes. Off in the engine's runners (``ShardedRunner``, the
    #: vLLM adapter's ``VllmRunner``): the engine pads every rank's rows to one count computed alike
    #: on every rank (``pcppass.runtime.row_counts``)
    row_counts: bool = True
    #: compare fingerprints through the c10d store when compiling
    compile_fingerprint: bool = True
    #: a rank that compiles alone waits this long for the others, then fails (and aborts the group)
    fingerprint_timeout_s: float = 60.0
    #: refuse a step whose previous call replaced state (a dict entry, a module buffer) with a
    #: tensor it computed instead of writing it in place (checked before each call, host only)
    rebinding: bool = True
    #: cross-rank digest of the state before and after checked steps: names state that diverged
    #: although every write the graph shows is synchronised (an under-declared custom op, a cache
    #: fetched through a Python lookup): every tensor argument of the graph, parameters and
    #: buffers included, and (``digest_outside``) every other live tensor; one small all-gather
    #: (and an ``all_gather_object``) per checked step, skipped while a CUDA graph is captured
    state_digest: bool = True
    #: the first calls of each compiled step that are digest-checked
    digest_first_steps: int = 4
    #: afterwards every ``digest_every``-th call is checked (0: never; 1: every call, the checked
    #: mode that names the very step of any divergence the digest can see)
    digest_every: int = 64
    #: also digest every live tensor the graph does not receive (``gc``: state an op reaches
    #: through a Python lookup), in graphs that call code which could do such a lookup (a
    #: custom op of another namespace than torch's and pcppass's); pcppass's own per-rank
    #: scratch is left out
    digest_outside: bool = True
    #: watch every peer's heartbeat in the c10d store (a daemon thread per process group, nothing
    #: on the step's path): a peer that stops beating (died, hangs) or fails is named, and this
    #: rank's process group is aborted so its collectives end (NCCL) instead of waiting for the
    #: process-group timeout (pcppass.runtime.liveness)
    liveness: bool = True
    #: a peer whose heartbeat has not advanced for this long is declared dead: the bound on
    #: detecting a dead peer is ``liveness_timeout_s + liveness_interval_s``
    liveness_timeout_s: float = 30.0
    #: how often each rank beats and reads its peers' heartbeats
    liveness_interval_s: float = 0.5
