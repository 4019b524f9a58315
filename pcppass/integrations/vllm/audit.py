"""``pcppass audit --vllm DIR``: the writes in the graph vLLM itself compiles for a model directory.

vLLM is started in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, compile caches off, so its
compile reaches the backend) with ``compilation_config={"mode": 2, "backend":
"pcppass.integrations.vllm.audit_backend"}``: the engine compiles while it warms up, the backend
records the classified writes of Dynamo's whole graph and runs it unchanged.

``DIR`` may hold only ``config.json``: it is then loaded with dummy weights
(:mod:`.loaders`), so a production architecture is audited from its published config. ``layers``
cuts the depth to a prefix that keeps one layer of every kind (:mod:`.config_dir`);
``moe_dispatch="op"`` puts the MoE layers through the GPU path's ``vllm::moe_forward`` ops.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx

from pcppass.analysis.records import StateWrite
from pcppass.analysis.report import EXIT_COVERED, EXIT_ERROR, EXIT_UNCOVERED, AuditReport, print_writes_table
from pcppass.integrations.vllm.config_dir import (
    ConfigDirError, Shrink, architectures, has_weights, parsed_layer_kinds, read_config, shrink_config,
    write_config_dir,
)
from pcppass.integrations.vllm.engine_args import cpu_engine_args
from pcppass.integrations.vllm.loaders import AUTO_FORMAT, DUMMY_FORMAT, MOE_DISPATCH, register_loaders

#: what an in-process audit needs from vLLM's environment (set unless already set)
AUDIT_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: its compile reaches us
    "VLLM_DISABLE_COMPILE_CACHE": "1",  # a compile-cache hit would skip the backend
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: a small KV cache for an audit run
}
#: dtypes an audit runs in (the graph's KV rows and state are in this dtype)
DTYPES = ("float32", "bfloat16", "float16")
#: engine limits of an audit run: its graph is traced once, with a symbolic token count
AUDIT_ENGINE_ARGS = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 256}
#: op namespaces that are not vLLM's (or another library's) custom ops
_BUILTIN_NAMESPACES = ("aten", "prims", "_c10d_functional", "_dynamo", "higher_order")


class VllmAuditError(RuntimeError):
    """vLLM did not hand pcppass a graph (it compiled in another process, or not at all)."""


class VllmLoadError(RuntimeError):
    """vLLM could not build, load or compile the model (one line: architecture and cause)."""


@dataclass
class OpUse:
    """One custom op of vLLM's graph and what pcppass reports on it."""

    op: str
    calls: int
    status: str  # "covered (copy_rows)", "read-only", "uncovered: <reason>", "no record"

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "calls": self.calls, "pcppass": self.status}


@dataclass
class VllmAudit:
    """What ``pcppass audit --vllm`` found for one model directory."""

    report: AuditReport
    model_dir: str
    architectures: list[str]
    weights: str  # "files" or "dummy"
    dtype: str
    moe_dispatch: str
    shrink: Shrink | None
    ops: list[OpUse] = field(default_factory=list)
    #: vLLM's layers by name (attention, MoE, state layers): class and state (:func:`layer_state`)
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.report.ok

    def to_dict(self) -> dict[str, Any]:
        return {**self.report.to_dict(), "engine": "vllm", "architectures": self.architectures,
                "weights": self.weights, "dtype": self.dtype, "moe_dispatch": self.moe_dispatch,
                "shrink": self.shrink.to_dict() if self.shrink is not None else None,
                "ops": [u.to_dict() for u in self.ops], "vllm_layers": self.layers,
                "seconds": round(self.seconds, 1)}


def op_name(target: Any) -> str | None:
    """``ns::name`` of a custom op call target (None for aten, builtins and Python functions)."""
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
    elif isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name
    else:
        return None
    return None if name.split("::")[0] in _BUILTIN_NAMESPACES else name


def _status(records: list[StateWrite]) -> str:
    if not records:
        return "no record"
    uncovered = sorted({w.reason.value if w.reason else "unclassified" for w in records if not w.covered})
    if uncovered:
        return "uncovered: " + "; ".join(uncovered)
    # each record's own recipe: an op whose effect is decided per layer (the attention op that
    # writes K/V on one backend and reads on another) has one pattern but per-record recipes
    recipes = sorted({w.recipe.value for w in records if w.recipe is not None})
    return "read-only" if recipes == ["read_only"] else "covered (" + ", ".join(recipes) + ")"


def op_inventory(graphs: list[torch.fx.GraphModule], writes: list[StateWrite]) -> list[OpUse]:
    """Every custom op the graphs call, how often, and what the audit reports on it."""
    calls: Counter[str] = Counter()
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and (name := op_name(node.target)) is not None:
                calls[name] += 1
    by_op: dict[str, list[StateWrite]] = {}
    for w in writes:
        by_op.setdefault(w.op, []).append(w)
    return [OpUse(op, n, _status(by_op.get(op, []))) for op, n in sorted(calls.items())]


def _root_cause(exc: BaseException) -> BaseException:
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        nxt = getattr(exc, "inner_exception", None) or exc.__cause__
        if nxt is None:
            break
        exc = nxt
    return exc


def load_error(exc: BaseException, archs: list[str], model_dir: str) -> VllmLoadError:
    """One line naming the architecture and the cause of vLLM's failure."""
    cause = _root_cause(exc)
    text = " ".join(str(cause).split())
    text = re.sub(r"^\d+ validation errors? for \w+ (Value error, )?", "", text)  # pydantic's wrapper
    arch = ", ".join(archs) or "no architecture in config.json"
    unknown_type = re.search(r"has model type `([^`]*)` but Transformers does not recognize", text)
    if "are not supported for now" in text or "Cannot find model module" in text:
        return VllmLoadError(f"{arch}: vLLM {_vllm_version()} has no implementation of this architecture "
                             f"(not in its model registry) ({model_dir})")
    if unknown_type:
        return VllmLoadError(f"{arch}: model_type {unknown_type.group(1)!r} is unknown to vLLM "
                             f"{_vllm_version()} and to transformers ({model_dir})")
    if len(text) > 400:
        text = text[:400] + " ..."
    return VllmLoadError(f"vLLM could not load {arch} from {model_dir}: {type(cause).__name__}: {text}")


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


@contextlib.contextmanager
def _prepared_dir(model_dir: str, layers: int | None) -> Iterator[tuple[str, Shrink | None]]:
    """The directory vLLM loads: ``model_dir`` itself, or a config-only copy cut to ``layers``."""
    if layers is None:
        yield model_dir, None
        return
    config = read_config(model_dir)
    try:
        kinds = parsed_layer_kinds(model_dir)
    except Exception as exc:  # noqa: BLE001 - vLLM or transformers cannot parse it: one line
        raise load_error(exc, architectures(config), model_dir) from exc
    shrunk, shrink = shrink_config(config, layers, kinds)
    with tempfile.TemporaryDirectory(prefix="pcppass-audit-") as tmp:
        write_config_dir(shrunk, tmp)
        kept = parsed_layer_kinds(tmp)
        if kept != kinds[: shrink.layers]:
            raise ConfigDirError(f"cutting {model_dir} to {shrink.layers} layers changed its layer kinds: "
                                 f"{kinds[: shrink.layers]} became {kept}")
        yield tmp, shrink


def _llm_args(model_dir: str, *, dummy: bool, dtype: str, moe_dispatch: str) -> dict[str, Any]:
    args = cpu_engine_args(model_dir, dtype=dtype, **AUDIT_ENGINE_ARGS,
                           compilation_config={"mode": 2, "backend": "pcppass.integrations.vllm.audit_backend"})
    if dummy or moe_dispatch != "auto":
        register_loaders()
        args["load_format"] = DUMMY_FORMAT if dummy else AUTO_FORMAT
        args["model_loader_extra_config"] = {MOE_DISPATCH: moe_dispatch}
    return args


def layer_state(module: Any, vllm_config: Any) -> dict[str, Any]:
    """A vLLM layer's class and the state vLLM allocates for it (its KV cache spec): bytes per
    token of an attention cache, or shapes, dtypes and bytes per request of a recurrent state."""
    info: dict[str, Any] = {"class": type(module).__name__}
    get_spec = getattr(module, "get_kv_cache_spec", None)
    try:
        spec = get_spec(vllm_config) if get_spec is not None else None
    except Exception as exc:  # noqa: BLE001 - informational: the audit itself does not depend on it
        return {**info, "cache": f"unknown ({type(exc).__name__}: {exc})"}
    if spec is None:
        return info
    info["cache"] = type(spec).__name__
    if hasattr(spec, "shapes"):  # MambaSpec: one state per request
        info["state"] = [{"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
                         for shape, dtype in zip(spec.shapes, spec.dtypes)]
        info["bytes_per_request"] = spec.state_content_size_bytes
    else:
        info["bytes_per_token"] = spec.real_page_size_bytes // spec.block_size
        if getattr(spec, "sliding_window", None):
            info["sliding_window"] = spec.sliding_window
    return info


def _vllm_layers(llm: Any) -> dict[str, dict[str, Any]]:
    config = llm.llm_engine.vllm_config
    context = config.compilation_config.static_forward_context
    return {name: layer_state(module, config) for name, module in context.items()}


def audit_vllm(model_dir: str, *, layers: int | None = None, dtype: str = "float32",
               moe_dispatch: str = "auto", **llm_args: Any) -> VllmAudit:
    """Audit the graph vLLM compiles for ``model_dir`` (see the module docstring).

    ``llm_args`` go to ``vllm.LLM`` (defaults: :mod:`.engine_args`, :data:`AUDIT_ENGINE_ARGS`).
    Raises :class:`~.config_dir.ConfigDirError` for an unusable directory, :class:`VllmLoadError`
    when vLLM cannot build, load or compile the model, :class:`VllmAuditError` when it compiled
    nothing in this process.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    for key, value in AUDIT_ENV.items():
        os.environ.setdefault(key, value)
    start = time.perf_counter()
    archs = architectures(read_config(model_dir))
    from vllm import LLM

    from pcppass.integrations.vllm.compile import audit_backend

    first = len(audit_backend.reports)
    with _prepared_dir(model_dir, layers) as (load_dir, shrink):
        dummy = load_dir != model_dir or not has_weights(model_dir)
        args = _llm_args(load_dir, dummy=dummy, dtype=dtype, moe_dispatch=moe_dispatch)
        args.update(llm_args)
        try:
            llm = LLM(**args)
        except Exception as exc:  # noqa: BLE001 - vLLM's own failure, reported in one line
            raise load_error(exc, archs, model_dir) from exc
        vllm_layers = _vllm_layers(llm)
    reports = audit_backend.reports[first:]
    if not reports:
        raise VllmAuditError(
            f"vLLM compiled no graph of {model_dir} in this process (VLLM_ENABLE_V1_MULTIPROCESSING="
            f"{os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING')!r}, compilation mode off (vLLM's CPU "
            "platform turns it off when LoRA is enabled), or a compile-cache hit)")
    writes = [w for report in reports for w in report.writes]
    report = AuditReport(target=model_dir, writes=writes, graph=reports[0].graph)
    return VllmAudit(report=report, model_dir=model_dir, architectures=archs,
                     weights="dummy" if dummy else "files", dtype=dtype, moe_dispatch=moe_dispatch,
                     shrink=shrink,
                     ops=op_inventory([r.graph for r in reports if r.graph is not None], writes),
                     layers=vllm_layers, seconds=time.perf_counter() - start)


def audit_model_dir(model_dir: str, **llm_args: Any) -> AuditReport:
    """Every write into persistent state (and every handle) in vLLM's graph of ``model_dir``."""
    return audit_vllm(model_dir, **llm_args).report


def _print_audit(audit: VllmAudit, console: Any) -> None:
    archs = ", ".join(audit.architectures) or "?"
    console.print(f"{archs}: {audit.weights} weights, {audit.dtype}, MoE dispatch {audit.moe_dispatch}",
                  markup=False)
    if audit.shrink is not None:
        console.print(audit.shrink.summary(), markup=False)
    print_writes_table(audit.model_dir, audit.report.writes, console)
    console.print("custom ops in vLLM's graph: " + "; ".join(
        f"{u.op} x{u.calls}: {u.status}" for u in audit.ops), markup=False)
    report = audit.report
    console.print(f"{len(report.covered)} covered, {len(report.uncovered)} uncovered ({audit.seconds:.0f} s)")


def run_audit_cli(args: argparse.Namespace) -> int:
    """``pcppass audit --vllm DIR`` (or ``--zoo``): the table (or ``--json``) and exit codes of
    ``pcppass audit``: 0 covered, 1 uncovered, 2 the model could not be loaded."""
    from rich.console import Console

    err = Console(file=sys.stderr, width=200)
    if args.dynamic:
        err.print("pcppass audit --vllm: --dynamic is not supported (vLLM runs its own steps)")
        return EXIT_ERROR
    if args.zoo:
        from pcppass.integrations.vllm.zoo import run_zoo_cli

        return run_zoo_cli(args)
    if not args.model:
        err.print("pcppass audit --vllm: give a model directory (or --zoo)")
        return EXIT_ERROR
    try:
        # stdout is for the table or the JSON: vLLM's own log (on stdout by default) goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            extra = {"enable_prefix_caching": False} if args.no_prefix_caching else {}
            audit = audit_vllm(args.model, layers=args.layers, dtype=args.dtype, moe_dispatch=args.moe_dispatch,
                               **extra)
    except (ConfigDirError, VllmLoadError, VllmAuditError) as exc:
        err.print(f"pcppass audit --vllm: {exc}", markup=False, soft_wrap=True)
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - anything else vLLM raised: still one line
        err.print(f"pcppass audit --vllm: {load_error(exc, [], args.model)}", markup=False, soft_wrap=True)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(audit.to_dict(), indent=2))
    else:
        _print_audit(audit, Console(file=sys.stdout, width=200))
    return EXIT_COVERED if audit.ok else EXIT_UNCOVERED
