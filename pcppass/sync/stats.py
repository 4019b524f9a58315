"""Counters of replica synchronisation actually performed, per process.

The sync header op (:func:`pcppass.sync.rows.sync_read_header`) runs once per all-gather, so it
records every sync collective and its size as the compiled step executes (eager, aot_eager and
Inductor alike). The runner reads and resets them around each step to report collectives and
bytes per step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class SyncCounts:
    collectives: int = 0
    #: bytes this rank contributed (its packed buffer, header included), summed over collectives
    bytes_sent: int = 0
    #: bytes every rank received (world * packed), summed over collectives
    bytes_gathered: int = 0


class SyncCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = SyncCounts()

    def record(self, bytes_sent: int, world_size: int) -> None:
        with self._lock:
            c = self._counts
            self._counts = SyncCounts(
                c.collectives + 1, c.bytes_sent + bytes_sent, c.bytes_gathered + bytes_sent * world_size
            )

    def take(self) -> SyncCounts:
        """The counts since the last ``take`` (and reset them)."""
        with self._lock:
            counts, self._counts = self._counts, SyncCounts()
        return counts


SYNC_COUNTERS = SyncCounters()
