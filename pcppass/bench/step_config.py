"""What the decode-step bench runs: its variants and its configuration (``pcppass bench step``).

Apart from :mod:`pcppass.bench.step` so that the pieces it drives (:mod:`pcppass.bench.sync_micro`)
and the reports read the configuration without importing the bench itself.
"""

from __future__ import annotations

from dataclasses import dataclass

#: synced variant -> (schedule, transport); ``<variant>_nochecks``: the same with every check off
SYNCED_KINDS = {"immediate": ("immediate", "auto"), "deferred": ("deferred", "auto"),
                "deferred_allgather": ("deferred", "allgather")}
NOCHECKS = "_nochecks"
VARIANTS = ("replicated", "immediate", "deferred", "deferred_allgather", "immediate_nochecks", "deferred_nochecks",
            "deferred_allgather_nochecks", "nosync")
DEFAULT_VARIANTS = ("replicated", "immediate", "deferred", "nosync")
SYNCED = tuple(v for v in VARIANTS if v not in ("replicated", "nosync"))
SHARDED = SYNCED + ("nosync",)


def with_checks_off(variants: tuple[str, ...]) -> tuple[str, ...]:
    """``variants`` plus the checks-off twin of each checked synced variant, in :data:`VARIANTS` order."""
    twins = {v + NOCHECKS for v in variants if v in SYNCED_KINDS}
    return tuple(v for v in VARIANTS if v in variants or v in twins)


@dataclass(frozen=True)
class StepBenchConfig:
    models: tuple[str, ...] = ("deepseek_v32",)
    size: str = "full"
    world: int = 2
    rows_per_rank: tuple[int, ...] = (32,)
    contexts: tuple[int, ...] = (4096,)
    layers: tuple[int, ...] = (2,)
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    warmup: int = 3
    reps: int = 20
    smoke_steps: int = 3
    #: "device": pcppass.sync.rows_cuda (no host reads); "reference": the plain-torch ops
    sync_kernels: str = "device"
    gather_hidden: bool = True
    cuda_graph: bool = False
    sync_microbench: bool = False
    micro_layers: int = 61
    micro_rows: tuple[int, ...] = (8, 32, 128)
    micro_reference: bool = False
    #: the cache-write ops' data-dependent value checks (host reads) during eager steps (a capture
    #: skips them; the backend's device checks of the slot inputs run either way)
    op_value_checks: bool = False
    #: the caches in symmetric memory (pcppass.sync.peer), so the backend can pick peer stores
    symmetric_caches: bool = False
    out: str = "bench/results"
    tag: str = ""
    timeout_s: float = 580.0
