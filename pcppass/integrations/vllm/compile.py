"""A backend for vLLM's own compile: ``compilation_config={"mode": 2, "backend": ...}``.

In vLLM's ``DYNAMO_TRACE_ONCE`` mode (``mode=2``; the CPU platform turns ``mode=3`` into it too)
the backend named by ``compilation_config["backend"]`` receives Dynamo's whole graph of the
model's forward (one graph: placeholders still carry their Dynamo sources, the layer names are
``LayerName`` placeholders or string constants) and returns the callable vLLM runs every step::

    LLM(model=..., compilation_config={"mode": 2, "backend": "pcppass.integrations.vllm.backend"})

:class:`VllmBackend` then

1. checks it is Dynamo's whole graph (a piece of vLLM's piecewise split or a post-grad graph is
   refused: :class:`~pcppass.errors.PcpGraphStageError`) and audits it
   (:func:`pcppass.analysis.find_state_writes`): every KV write, by layer, and what covers it; an
   uncovered write or a graph break raises :class:`~pcppass.errors.PcpCoverageError`;
2. rewrites it: the replica sync of every covered write, resolved by layer name at run time, in
   one collective per step (deferred schedule) on vLLM's world group;
3. compiles the result with Inductor (or ``inner``).

vLLM's own runner has no step kind and no decode ownership plan for pcppass, and inside it the
world group is vLLM's tensor-parallel world: the backend syncs only a one-process engine (where
the sync is an identity that still runs every step, so what vLLM executes is the rewritten graph)
and refuses a larger world. Decode sharding across ranks runs through
:mod:`pcppass.integrations.vllm.adapter`.

``backend.reports`` keeps what each compile did, readable when vLLM's engine core runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
import torch.distributed as dist
import torch.fx

from pcppass.analysis import StateWrite, find_state_writes
from pcppass.errors import PcpCoverageError, PcpError
from pcppass.rewrite.insert import SyncRewrite, insert_sync
from pcppass.rewrite.plan import SyncPlan, plan_sync
from pcppass.rewrite.stage import check_graph_stage, graph_breaks
from pcppass.runtime.validate import InputValidator, validating

Inner = Literal["inductor", "aot_eager", "eager"]


@dataclass
class VllmCompile:
    """What :class:`VllmBackend` did with one graph of vLLM's model."""

    writes: list[StateWrite]
    rewrite: SyncRewrite | None = None
    graph: torch.fx.GraphModule | None = field(default=None, repr=False)

    @property
    def uncovered(self) -> list[StateWrite]:
        return [w for w in self.writes if not w.covered]


class VllmBackend:
    """Audit, rewrite and compile vLLM's Dynamo graph (see the module docstring).

    ``audit_only=True`` records the writes and runs the graph unchanged, eagerly, whatever covers
    them (``pcppass audit --vllm``).
    """

    def __init__(self, *, inner: Inner = "inductor", audit_only: bool = False) -> None:
        if inner not in ("inductor", "aot_eager", "eager"):
            raise ValueError(f"inner must be inductor, aot_eager or eager, got {inner!r}")
        self.inner: Inner = "eager" if audit_only else inner
        self.audit_only = audit_only
        self.reports: list[VllmCompile] = []

    def __repr__(self) -> str:
        return f"VllmBackend(inner={self.inner!r}, audit_only={self.audit_only})"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        check_graph_stage(gm)  # a piece of vLLM's piecewise split, or a post-grad graph: refused
        report = VllmCompile(find_state_writes(gm), graph=gm)
        self.reports.append(report)
        if self.audit_only:
            return _compile(self.inner, gm, example_inputs)
        # vLLM compiles with fullgraph=True (its TorchCompileWithNoGuardsWrapper), so a graph break
        # fails Dynamo before this graph exists: when stage.graph_breaks cannot tell (None), the
        # graph is whole; one it does see is refused
        breaks = graph_breaks(gm) or []
        if report.uncovered or breaks:
            raise PcpCoverageError(report.uncovered, breaks)
        plan = plan_sync([w for w in report.writes if w.covered])
        report.rewrite = self._insert_sync(gm, plan)
        # vLLM calls the graph without Dynamo's guards: a LayerName input must be the compiled one
        return validating(_compile(self.inner, gm, example_inputs), InputValidator.from_plan(gm, plan))

    @staticmethod
    def _insert_sync(gm: torch.fx.GraphModule, plan: SyncPlan) -> SyncRewrite:
        if not dist.is_initialized():
            raise PcpError("pcppass: vLLM's process group is not initialised: the sync has no group")
        group = dist.group.WORLD
        world = dist.get_world_size(group)
        if world != 1:
            raise PcpError(
                f"pcppass: inside vLLM's own runner (world of {world} ranks, vLLM's tensor-parallel "
                "world) pcppass syncs one-process engines only: vLLM's runner hands it no step kind "
                "and no decode ownership. Shard decode through pcppass.integrations.vllm.adapter.")
        return insert_sync(gm, plan, schedule="deferred", group_name=group.group_name,
                           world_size=world, extra_fingerprint="vllm")


def _compile(inner: Inner, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    if inner == "eager":
        return gm.forward
    if inner == "aot_eager":
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


#: ``compilation_config={"mode": 2, "backend": "pcppass.integrations.vllm.backend"}``
backend = VllmBackend()
#: records the writes and runs the graph eagerly, unchanged (``pcppass audit --vllm``)
audit_backend = VllmBackend(audit_only=True)
