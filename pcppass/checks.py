"""The switches of every safety check pcppass performs, in one place (:class:`SyncChecks`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncChecks:
    """Run-time and compile-time checks (all on by default; each costs a host sync on GPUs)."""

    #: validate slot-mapping inputs (dtype, length, range) before the graph runs
    inputs: bool = True
    #: compare every rank's graph fingerprint in each sync header
    header: bool = True
    #: refuse a slot written by two ranks in one step
    slot_conflicts: bool = True
    #: compare fingerprints through the c10d store when compiling
    compile_fingerprint: bool = True
    #: a rank that compiles alone waits this long for the others, then fails (and aborts the group)
    fingerprint_timeout_s: float = 60.0
