"""The launcher's paged-attention kernels compiled for an H100/H200 (sm_90) on a machine without a
GPU, for what a test can read off their machine code: registers, spills, shared memory, the main
loop's instructions.

Each launcher runs on small CPU tensors with its kernel launch intercepted (:func:`intercept`); the
intercepted arguments are specialised as Triton's own launch would specialise them (the pointer and
integer alignments, the integers equal to 1) and compiled with Triton's bundled ``ptxas`` for
``sm_90a`` (:func:`compile_launch`), then disassembled with its ``cuobjdump`` (:func:`sass_stats`).
The loop is the longest backward branch of the SASS; its opcodes are counted once per iteration
(per warp). The shapes are those of the decode launches (one program per row, several key splits).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import KernelInterface

from pcppass.engine.attention import launch

SM90 = GPUTarget("cuda", 90, 32)
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@dataclass
class Launch:
    """One intercepted kernel launch: the jitted function and its arguments."""

    fn: object
    args: tuple
    kwargs: dict


class Recorder:
    """Stands in for a jitted kernel: ``recorder[grid](*args, **kwargs)`` records the first launch
    into ``found`` (when ``wanted``) and runs nothing."""

    def __init__(self, fn, found: list[Launch], wanted: bool = True):
        self.fn, self.found, self.wanted = fn, found, wanted

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            if self.wanted and not self.found:
                self.found.append(Launch(self.fn, args, kwargs))
        return record


class _Intercept:
    """Stands in for :func:`launch.kernels`' module: every kernel a :class:`Recorder`, only
    ``name``'s launch recorded (the others, e.g. the split combine, do not run); its other names
    (constants, host helpers) as they are."""

    def __init__(self, module, name: str, found: list[Launch]):
        self._module, self._name, self._found = module, name, found

    def __getattr__(self, attr: str):
        value = getattr(self._module, attr)
        if not isinstance(value, KernelInterface):
            return value
        return Recorder(value, self._found, attr == self._name)


def intercept(run: Callable[[], object], kernel: str) -> Launch:
    """The first launch of the attention kernel ``kernel`` made by ``run()``."""
    found: list[Launch] = []
    real = launch.kernels
    launch.kernels = lambda name="triton_kernels": _Intercept(real(name), kernel, found)
    try:
        run()
    finally:
        launch.kernels = real
    if not found:
        raise RuntimeError(f"no launch of {kernel}")
    return found[0]


def compile_launch(call: Launch, target: GPUTarget = SM90):
    """``triton.compile`` of an intercepted launch for ``target``, specialised as a launch would
    (Triton or Gluon kernels)."""
    kwargs = dict(call.kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    bound = dict(zip(call.fn.arg_names, call.args)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(call.fn.params):
        value = bound.get(param.name, param.default)
        if param.is_constexpr:
            signature[param.name], constexprs[(i,)] = "constexpr", value
            continue
        kind, attr = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = value
        elif attr:
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    source = GluonASTSource if call.fn.is_gluon() else ASTSource
    return triton.compile(source(call.fn, signature, constexprs, attrs), target=target, options=options)


@dataclass
class SassStats:
    registers: int
    stack_bytes: int
    shared_bytes: int
    loop_instructions: int
    loop_opcodes: collections.Counter
    sass: str


def tool(name: str, *args: str) -> str:
    """Output of Triton's bundled CUDA binary tool ``name`` (``cuobjdump``, ...)."""
    return subprocess.run([str(_BIN / name), *args], capture_output=True, text=True, check=True).stdout


def _loop_opcodes(sass: str) -> tuple[int, collections.Counter]:
    """Opcodes of the longest backward branch's body (the main loop), predicates dropped."""
    code = [(int(m.group(1), 16), m.group(2)) for m in
            (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    loops = [(int(m.group(1), 16), at) for at, text in code
             if (m := re.search(r"BRA\s+0x([0-9a-f]+)", text)) and int(m.group(1), 16) < at]
    if not loops:
        return 0, collections.Counter()
    start, end = max(loops, key=lambda span: span[1] - span[0])
    body = [re.sub(r"^@!?U?P\w+\s+", "", text) for at, text in code if start <= at <= end]
    return len(body), collections.Counter(text.split()[0].split(".")[0] for text in body)


def sass_stats(kernel) -> SassStats:
    """Registers, stack and shared bytes, the main loop's opcodes and the whole SASS of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        sass = tool("cuobjdump", "-sass", cubin)
        usage = tool("cuobjdump", "-res-usage", cubin)
    fields = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", usage))
    count, opcodes = _loop_opcodes(sass)
    return SassStats(int(fields.get("REG", 0)), int(fields.get("STACK", 0)), kernel.metadata.shared, count, opcodes,
                     sass)


def decode_step(rows: int = 2, context: int = 4096, block_size: int = 64):
    """StepRows of ``rows`` decode rows at ``context`` on the CPU (several key splits)."""
    cols = context // block_size
    g = torch.Generator().manual_seed(0)
    tables = torch.stack([1 + r * cols + torch.randperm(cols, generator=g) for r in range(rows)])
    step = launch.StepRows(tables, torch.full((rows,), context - 1), torch.arange(rows), torch.arange(rows + 1),
                           torch.zeros(rows, dtype=torch.bool))
    return step, 1 + rows * cols


def mla_inputs(ds_mla: bool, heads: int = 16) -> tuple:
    """(q_lat, q_pe, cache, step) of MLA decode on the CPU (512 + 64 dims; DeepSeek-V2's 16 heads,
    or V3.2's 128), over a bf16 or fp8_ds_mla cache."""
    from pcppass.ops.quant import encode_ds_mla_rows

    step, blocks = decode_step()
    q_lat = torch.randn(2, heads, 512, dtype=torch.bfloat16)
    q_pe = torch.randn(2, heads, 64, dtype=torch.bfloat16)
    kv = torch.randn(blocks * 64, 576, dtype=torch.bfloat16)
    cache = (encode_ds_mla_rows(kv[:, :512], kv[:, 512:]) if ds_mla else kv).view(blocks, 64, -1)
    return q_lat, q_pe, cache, step


def triton_mla_case(ds_mla: bool) -> Launch:
    """The launcher's dense MLA decode launch over :func:`mla_inputs` on CPU tensors: the Triton
    kernel (the Gluon kernels ask for CUDA tensors on sm_90)."""
    q_lat, q_pe, cache, step = mla_inputs(ds_mla)
    return intercept(lambda: launch.mla_attention(q_lat, q_pe, cache, step, 0.07, ds_mla), "mla_kernel")


def sparse_mla_gluon_case(picks_per_split: int = 1024) -> Launch:
    """DeepSeek-V3.2's sparse MLA decode launch of the Gluon kernel (128 heads, 2048 picks, the
    split the launcher picks for 32 decode rows per rank), what the launcher runs on Hopper."""
    q_lat, q_pe, cache, step = mla_inputs(True, heads=128)
    index = torch.randint(0, 4096, (2, 2048)).sort(dim=1).values
    splits = 2048 // picks_per_split
    out, part_o, part_ml = launch._outputs(2, 128, 512, splits, q_lat.dtype, q_lat.device)
    return intercept(lambda: launch.sparse_mla_gluon(q_lat, q_pe, cache, step, index, out, part_o, part_ml, 0.07,
                                                     splits, picks_per_split), "sparse_mla_kernel")


def dense_mla_gluon_case(heads: int = 16) -> Launch:
    """DeepSeek-V2's dense MLA decode launch of the Gluon kernel over fp8_ds_mla rows (16 heads),
    what the launcher runs on Hopper."""
    q_lat, q_pe, cache, step = mla_inputs(True, heads=heads)
    return intercept(lambda: launch.dense_mla_gluon(q_lat, q_pe, cache, step, 0.07), "dense_mla_kernel")
