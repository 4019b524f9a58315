"""Which graph the sync pass was handed, and whether it is the whole decode step.

The analysis and the rewrite work on the graph Dynamo hands to a ``torch.compile`` backend: writes
are still as written there, and every placeholder carries its Dynamo source (buffer, argument,
global), which is how state is told from temporaries. Sharding is sound only if that graph is the
whole step: code outside it (eager code between graphs, other pieces of a split graph) writes
state that nothing synchronises. The stages a pass can be installed at:

==========================================  ==============================================  ============
route                                       graph the pass sees                             pcppass
==========================================  ==============================================  ============
``torch.compile(backend=pcppass.backend)``  Dynamo graph of the frame (torch IR, as written) supported
``PcpSyncPass`` called by an engine's own   the same graph, if called on what Dynamo hands   supported
backend (vLLM ``DYNAMO_TRACE_ONCE``)        the backend, before AOT
Inductor ``post_grad_custom_post_pass``     post-grad ATen graph: ``auto_functionalized_v2``  refused
                                            nodes, placeholders without Dynamo sources
vLLM piecewise backend                      one piece of ``split_graph`` (between attention   refused
                                            ops): not the whole step
==========================================  ==============================================  ============
"""

from __future__ import annotations

import logging
import os
import sys
import types

import torch
import torch.fx

from pcppass.errors import PcpGraphStageError

log = logging.getLogger(__name__)

#: keys Dynamo puts into ``gm.meta`` of the graph module it hands to the backend
_DYNAMO_GM_META = ("dynamo_flat_name_to_original_fqn", "dynamo_compile_id")
_SUPPORTED_ROUTE = (
    "compile the whole step with torch.compile(model, backend=pcppass.backend, fullgraph=True), or "
    "call PcpSyncPass on the graph module Dynamo hands your backend, before AOT/Inductor"
)


def _functionalized_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    names = ("auto_functionalized", "auto_functionalized_v2")
    return [n for n in graph.nodes
            if n.op == "call_function" and getattr(n.target, "__name__", None) in names]


def check_graph_stage(gm: torch.fx.GraphModule) -> None:
    """Raise :class:`~pcppass.errors.PcpGraphStageError` unless ``gm`` is a Dynamo graph.

    Refused: a post-AOT graph (functionalized writes, placeholders without Dynamo sources), and a
    graph some of whose inputs are values computed elsewhere (a piece of a split graph).
    """
    functionalized = _functionalized_nodes(gm.graph)
    if functionalized:
        raise PcpGraphStageError(
            f"pcppass: this is a post-grad (AOT, functionalized) graph: {functionalized[0].name} is "
            f"{functionalized[0].target.__name__}; writes there are functional copies, state inputs "
            "carry no Dynamo source, and the pass would not see them as written. pcppass rewrites "
            f"the Dynamo graph: {_SUPPORTED_ROUTE}."
        )
    sourceless = [n.name for n in gm.graph.find_nodes(op="placeholder") if "grapharg" not in n.meta]
    if sourceless:
        raise PcpGraphStageError(
            f"pcppass: placeholder(s) {sourceless[:4]} carry no Dynamo source: this graph is not the "
            "graph Dynamo traced (a piece of a split graph, such as vLLM's piecewise pieces, or an "
            "AOT graph), so it is not the whole step and state cannot be told from temporaries. "
            f"{_SUPPORTED_ROUTE[0].upper()}{_SUPPORTED_ROUTE[1:]}."
        )


def is_dynamo_graph_module(gm: torch.fx.GraphModule) -> bool:
    """True if ``gm`` carries the metadata Dynamo puts on the graph module it hands over (a piece
    or a copy made from it by other code does not)."""
    return all(key in gm.meta for key in _DYNAMO_GM_META)


def graph_breaks(gm: torch.fx.GraphModule) -> list[str] | None:
    """The graph break that ends ``gm``, whether it resumes after one, and whether it is the graph
    of a frame called by eager code Dynamo skipped; None: cannot tell.

    A step split into several graphs runs the code between them eagerly, unseen by the analysis:
    a graph that ends in a break, a resume function's graph, or the graph of a frame whose caller
    Dynamo skipped (:func:`eager_caller`) is not the whole step. Dynamo says none of it in a
    public API: the compile reason is read from the graph module (torch >= 2.12) or the frame
    Dynamo is translating, the frame's code name from that frame, its caller from the Python
    stack. Anything missing or unexpected returns None, and the caller refuses to shard unless
    told the graph is whole.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code_name = tx.f_code.co_name
        reason = getattr(gm, "compile_subgraph_reason", None) or tx.output.compile_subgraph_reason
        graph_break = reason.graph_break
        user_stack = reason.user_stack
        text = reason.reason
    except Exception as exc:  # Dynamo internals moved, or no Dynamo compile is running
        log.debug("pcppass: graph-break detection unavailable: %r", exc)
        return None
    if not isinstance(code_name, str) or not isinstance(graph_break, bool):
        return None
    found = []
    if graph_break:
        where = ""
        if user_stack:
            frame = user_stack[-1]
            where = f" at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
        found.append(f"graph break{where}: {str(text).strip().splitlines()[0]}")
    if code_name.startswith("torch_dynamo_resume_in_"):
        found.append(f"graph resumes after a graph break ({code_name}): the code before it ran eagerly")
        return found
    caller = eager_caller()
    if caller is None:
        return found or None
    if caller:
        found.append(f"graph of {code_name}, called by {caller}, which Dynamo skipped and ran eagerly: "
                     "the step's code around this call is in no graph")
    return found


def eager_caller(frame: types.FrameType | None = None) -> str | None:
    """Where the frame Dynamo is compiling was called from, if that is user code running eagerly;
    "" if it was called by ``torch.compile``'s own wrapper; None: cannot tell.

    When Dynamo skips a frame (a graph break it cannot resume from, a frame it will not trace), it
    runs it eagerly and compiles the frames it calls, each as its own graph: such a graph is not
    the whole step. Read from the Python stack (no API says it): above the backend sit Dynamo's
    frame-conversion callbacks (``convert_frame.py``), then the caller of the compiled frame;
    above that, through torch's own modules (``nn.Module.__call__``), either the wrapper in
    ``torch/_dynamo/eval_frame.py`` (the frame is the compiled function itself) or a user frame.
    """
    frame = frame or sys._getframe(1)
    while frame is not None and not _is_torch_file(frame, "_dynamo/convert_frame.py"):
        frame = frame.f_back
    while frame is not None and _is_torch_file(frame, "_dynamo/convert_frame.py"):
        frame = frame.f_back
    while frame is not None and _is_torch_file(frame, ""):
        if _is_torch_file(frame, "_dynamo/eval_frame.py"):
            return ""
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code
    return f"{code.co_name} ({code.co_filename}:{frame.f_lineno})"


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _is_torch_file(frame: types.FrameType, relative: str) -> bool:
    filename = frame.f_code.co_filename
    return filename.startswith(_TORCH_DIR) and filename[len(_TORCH_DIR):].replace(os.sep, "/").startswith(relative)
