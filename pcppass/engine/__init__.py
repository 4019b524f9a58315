"""A paged decode engine whose steps are laid out for P prefill-context-parallel ranks.

See docs/MODEL_CONTRACT.md for what a model implements and :mod:`pcppass.engine.runner` for a step.
"""

from pcppass.contract import CacheGroupSpec, CacheSpec
from pcppass.engine.layout import PlanError
from pcppass.engine.runner import Engine, Runner, StepRecord, compiled_runner, eager_runner
from pcppass.engine.workload import RequestSpec, WorkloadConfig, generate_workload

__all__ = [
    "CacheGroupSpec",
    "CacheSpec",
    "Engine",
    "PlanError",
    "RequestSpec",
    "Runner",
    "StepRecord",
    "WorkloadConfig",
    "compiled_runner",
    "eager_runner",
    "generate_workload",
]
