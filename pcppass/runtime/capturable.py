"""Whether a compiled step can be captured in a CUDA graph, decided before trying.

Capturing a step that cannot be captured is not harmless: the failing op fails the step, and a
failed sharded step aborts the process group (fail-stop), so everything after it on that group
fails too. :func:`capturable` reads what a backend compiled (``backend.reports``: the graphs it
handed to the inner compiler) and finds operators that would read the device on the host. Used by
:meth:`pcppass.sharded.ShardedRunner.capturable` (asked by the engine's decode graphs before they
capture) and the step bench.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

#: Modules whose operator implementations read the device on the host: the reference sync ops
#: (sizes, offsets and headers read back; ``pcppass.sync.rows``) and the checks of slot mappings
#: a graph computes (every rank's verdict read back; ``pcppass.sync.slot_check_ops``). On CUDA an
#: operator runs its registered CUDA kernel instead when one is registered and enabled
#: (``pcppass.sync.rows_cuda`` registers the sync ops'; ``rows_cuda.kernels_enabled``).
HOST_READING_MODULES = ("pcppass.sync.rows", "pcppass.sync.slot_check_ops")
#: Operator namespaces whose operators Inductor compiles or CUDA graphs capture as they are.
CAPTURABLE_NAMESPACES = ("aten", "prims", "_c10d_functional", "c10d_functional")


def step_device(graph: torch.fx.GraphModule) -> str:
    """The device type the graph's tensor inputs live on (``"cuda"`` if any does)."""
    kinds = set()
    for node in graph.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            kinds.add(value.device.type)
    return "cuda" if "cuda" in kinds else next(iter(sorted(kinds)), "unknown")


def _custom_op(qualname: str) -> Any:
    from torch._library.custom_ops import OPDEFS

    return OPDEFS.get(qualname)


def _host_read(target: Any) -> str | None:
    """Why running ``target`` on CUDA reads the device on the host (None: it does not)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, qualname = target._qualified_op_name.split("::")[0], target._qualified_op_name
    elif isinstance(target, torch._ops.OpOverload):
        namespace, qualname = target.namespace, target._schema.name
    else:
        return None  # a Python function or a torch function of the Dynamo graph: traced by Inductor
    if namespace in CAPTURABLE_NAMESPACES:
        return None
    opdef = _custom_op(qualname)
    if opdef is None:
        return f"{qualname} (not a pcppass custom op: cannot tell whether it reads the host)"
    if "cuda" in opdef._backend_fns and "cuda" not in opdef._disabled_kernel:
        return None  # its CUDA kernel runs
    module = getattr(opdef._init_fn, "__module__", "")
    if namespace != "pcppass":
        return f"{qualname} (an operator from {module or 'elsewhere'}: cannot tell whether it reads the host)"
    if module in HOST_READING_MODULES:
        return f"{qualname} ({module}: reads the device on the host)"
    return None


def host_reading_ops(graph: torch.fx.GraphModule) -> list[str]:
    """The operators of ``graph`` that read the device on the host when the step runs on CUDA,
    each with why (an unknown operator counts: a failed capture is not harmless)."""
    found: dict[str, None] = {}
    for node in graph.graph.nodes:
        if node.op == "call_function":
            why = _host_read(node.target)
            if why is not None:
                found.setdefault(why)
    return list(found)


def capturable(backend: Any) -> tuple[bool, str]:
    """Whether a step compiled by ``backend`` can be captured in a CUDA graph, and why not.

    ``None`` (a plain ``torch.compile``): yes. A backend may say so itself (a ``capturable``
    attribute). Otherwise every graph it compiled must run on CUDA, where the backend's run-time
    checks run on the device (input slot ranges by one kernel before the step, header and
    two-owner checks inside the sync kernels; the state digest skips captures), and no operator in
    it may read the device on the host (:func:`host_reading_ops`). Run the step once first: the
    backend compiles on the first call.
    """
    if backend is None:
        return True, ""
    explicit = getattr(backend, "capturable", None)
    if explicit is not None:
        return bool(explicit), "" if explicit else "the backend says its steps cannot be captured"
    graphs = [r.graph for r in getattr(backend, "reports", []) if getattr(r, "graph", None) is not None]
    if not graphs:
        return False, "the backend has compiled no graph yet (run the step once before capturing)"
    for graph in graphs:
        device = step_device(graph)
        if device != "cuda":
            return False, f"the step runs on {device}: no CUDA graph to capture"
        readers = host_reading_ops(graph)
        if readers:
            return False, "operators that read the device on the host: " + "; ".join(readers)
    return True, ""
