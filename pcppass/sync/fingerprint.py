"""Compile-time agreement: every rank must have rewritten the same graph.

Ranks that trace different graphs would issue different collectives and hang (or, with equal
sizes, corrupt each other's replicas). At compile time each rank publishes the fingerprint of its
rewritten graph in the process group's c10d store under the compile's ordinal and waits, with a
timeout, for every other rank's: no collective is involved, so a mismatch or a rank that never
compiles becomes an error instead of a hang.
"""

from __future__ import annotations

import datetime
import itertools
import threading

import torch.distributed as dist

from pcppass.errors import PcpSyncError

_lock = threading.Lock()
_ordinals: dict[tuple[int, str, str], itertools.count] = {}


def _store() -> dist.Store:
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def exchange_fingerprint(
    fingerprint: str, group: dist.ProcessGroup, *, namespace: str = "graph", timeout_s: float = 60.0,
    inputs: str = "",
) -> None:
    """Publish ``fingerprint`` for this rank's next compile and check every rank's matches.

    ``namespace`` separates independent compile sequences (e.g. decode and mixed graphs); within
    one, compiles are matched by ordinal, so every rank must compile in the same order.
    ``inputs``: the graph's inputs as traced, one per line, published beside the fingerprint so
    that a mismatch names the inputs whose shapes differ.
    """
    store = _store()
    group_name = group.group_name
    key = (id(store), group_name, namespace)
    with _lock:
        ordinal = next(_ordinals.setdefault(key, itertools.count()))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # Raised errors keep this frame alive: it must not keep the group alive too (a gloo group
    # aborted after a failure here closes its connections only once nothing holds it).
    del group
    prefix = f"pcppass/fingerprint/{group_name}/{namespace}/{ordinal}/"
    store.set(prefix + str(rank), fingerprint)
    store.set(prefix + "inputs/" + str(rank), inputs)
    keys = [prefix + str(r) for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # the store raises a backend-specific timeout error
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise PcpSyncError(
            f"pcppass: rank(s) {missing} did not compile {namespace} graph #{ordinal} within "
            f"{timeout_s:.0f} s; every rank must compile the same graphs in the same order "
            f"(a rank that recompiles alone would hang the next collective)"
        ) from exc
    fingerprints = [store.get(k).decode() for k in keys]
    if any(fp != fingerprint for fp in fingerprints):
        listing = ", ".join(f"rank {r}: {fp[:16]}" for r, fp in enumerate(fingerprints))
        # the inputs are set before the fingerprint's wait: every rank's is there
        every_inputs = [store.get(prefix + "inputs/" + str(r)).decode() for r in range(world)]
        raise PcpSyncError(
            f"pcppass: ranks traced different graphs for {namespace} graph #{ordinal} [{listing}]. "
            f"{_differing_inputs(every_inputs)}Every rank must run the same model and configuration "
            "with inputs of the same shapes, dtypes and strides (row counts padded to one size; "
            "Dynamo specialises a size of 0 or 1, so a rank with 0 rows of something and a rank "
            "with 1 trace different graphs). Refused on every rank before the graph ran."
        )


def _differing_inputs(every_rank: list[str]) -> str:
    """``"Inputs traced differently: ..."`` naming each input whose description differs between
    ranks (the first few), or "" when they agree (the graphs differ elsewhere)."""
    per_rank = [text.splitlines() for text in every_rank]
    if len({len(lines) for lines in per_rank}) != 1:
        return "The ranks' graphs have different inputs. "
    differing = [lines for lines in zip(*per_rank) if len(set(lines)) > 1]
    if not differing:
        return ""
    shown = "; ".join(" / ".join(f"rank {r}: {line}" for r, line in enumerate(lines))
                      for lines in differing[:3])
    return f"Inputs traced differently: {shown}. "
