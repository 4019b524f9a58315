"""Cache handles, without vLLM: an opaque ``LayerName`` registered the way vLLM registers it
(``register_opaque_type(..., typ="value", hoist=True)``) and custom ops with vLLM's exact schemas
(``unified_kv_cache_update``, ``unified_mla_kv_cache_update``, the attention ops with
``Tensor(a3!) output``), in both of vLLM's modes (LayerName objects, and plain layer-name strings)."""

from __future__ import annotations

import torch

from pcppass.analysis import StateKind, Uncovered, find_state_writes
from pcppass.analysis.handles import string_addresses_state
from pcppass.analysis.trace import StepInputs, capture_graph
from vllm_like_ops import CONTEXT, LAYERS, VLLM_SCHEMAS, LayerName, ops


class GqaModel(torch.nn.Module):
    """vLLM's GQA attention layer: KV update (token out), attention fed the token as a dependency."""

    def __init__(self, opaque: bool):
        super().__init__()
        self.opaque = opaque
        self.layer_names = [LayerName(n) if opaque else n for n in LAYERS]

    def forward(self, q, k, v):
        for name in self.layer_names:
            update = ops.unified_kv_cache_update if self.opaque else ops.unified_kv_cache_update_str
            dep = update(k, v, name)                                          # KV update site
            out = torch.empty_like(q)
            ops.unified_attention_with_output(q, k, v, out, name, None, None, dep)  # attention site
            q = out + ops.resize_rows(q, "nearest", "rms")                    # options, not handles
        return q


class MlaModel(torch.nn.Module):
    def __init__(self, opaque: bool):
        super().__init__()
        self.opaque = opaque
        self.layer_names = [LayerName(n) if opaque else n for n in LAYERS]
        self.k_scale = torch.ones(())

    def forward(self, kv_c, k_pe, q):
        for name in self.layer_names:
            update = ops.unified_mla_kv_cache_update if self.opaque else ops.unified_mla_kv_cache_update_str
            dep = update(kv_c, k_pe, name, "auto", self.k_scale)               # MLA update site
            q = ops.attention_reading(q, name) + dep.sum()                     # real output, reads
        return q


def _context(width: int):
    slots = torch.tensor([3, 9, -1])
    for name in LAYERS:
        shape = (2, 4, 4, width) if width == 8 else (4, 4, width)
        CONTEXT[name] = {"kv_cache": torch.zeros(shape), "slot_mapping": slots}


def _summary(writes):
    return [(w.op.split("::")[1], w.state, w.arg, w.state_node, w.state_kind, w.reason) for w in writes]


def _line_of(marker: str) -> int:
    import inspect
    import sys

    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    (line,) = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(f"# {marker}")]
    return line


def test_schemas_are_vllms():
    for name, schema in VLLM_SCHEMAS.items():
        assert str(getattr(ops, name).default._schema) == f"pcppass_vllm_like::{name}{schema}"


def _gqa_writes(opaque: bool):
    _context(8)
    q, k, v = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8)
    model = GqaModel(opaque)
    model(q, k, v)  # eager: the ops really write the context's caches
    assert CONTEXT[LAYERS[1]]["kv_cache"][1].flatten(0, 1)[9].equal(v[1])
    return find_state_writes(capture_graph(model, StepInputs((q, k, v), {}, [(q, 0), (k, 0), (v, 0)])))


def test_layer_name_objects_are_handles_named_by_their_value():
    writes = _gqa_writes(opaque=True)
    handle = (StateKind.HANDLE, Uncovered.UNDECLARED_CACHE_HANDLE)
    assert _summary(writes) == [
        (op, layer, "layer_name", None, *handle)
        for layer in LAYERS
        for op in ("unified_kv_cache_update", "unified_attention_with_output")
    ]
    update, attention = writes[0], writes[1]
    assert update.source.endswith(f"test_analysis_handles.py:{_line_of('KV update site')}")
    assert attention.source.endswith(f":{_line_of('attention site')}")
    # the handle as the graph holds it: a lifted placeholder whose example value is a script object
    assert update.bound_args["layer_name"].op == "placeholder"
    assert update.written_node is None and not update.covered
    assert "declares no mutation" in update.detail and "model.layers.0.self_attn.attn" in update.detail
    assert "declares writes only to output" in attention.detail


def test_layer_name_strings_are_handles_and_options_are_not():
    writes = _gqa_writes(opaque=False)
    assert [(w.op.split("::")[1], w.state, w.arg) for w in writes] == [
        (op, layer, "layer_name")
        for layer in LAYERS
        for op in ("unified_kv_cache_update_str", "unified_attention_with_output")
    ]
    assert all(w.state_kind is StateKind.HANDLE for w in writes)


def test_mla_update_is_flagged_through_its_layer_name_not_its_dtype():
    for opaque in (True, False):
        _context(12)
        kv_c, k_pe, q = torch.randn(3, 8), torch.randn(3, 4), torch.randn(3, 8)
        gm = capture_graph(MlaModel(opaque), StepInputs((kv_c, k_pe, q), {}, [(kv_c, 0), (k_pe, 0), (q, 0)]))
        writes = find_state_writes(gm)
        suffix = "" if opaque else "_str"
        assert [(w.op.split("::")[1], w.state, w.arg) for w in writes] == [
            (op, layer, "layer_name")
            for layer in LAYERS
            for op in (f"unified_mla_kv_cache_update{suffix}", "attention_reading")
        ], opaque
        assert writes[0].source.endswith(f":{_line_of('MLA update site')}")
        # an op that takes a handle and returns real output is reported too
        assert writes[1].reason is Uncovered.UNDECLARED_CACHE_HANDLE


def test_which_strings_address_state():
    assert string_addresses_state("layer_name", "layers.0.kv")
    assert string_addresses_state("prefix", "model.layers.3.mlp")
    assert string_addresses_state("target", "model.layers.0.self_attn.attn")  # a module path
    # fail closed: any string that is not configuration by its name, whatever it holds
    for arg, value in (("where", "rows/0"), ("cache_key", "k0"), ("layerName", "l0"), ("group_name", "0"),
                       ("tag", "auto"), ("scaled_cache", "x"), ("dtype_of_cache", "kv")):
        assert string_addresses_state(arg, value), (arg, value)
    for arg, value in (("kv_cache_dtype", "auto"), ("kv_cache_dtype", "fp8.e4m3"), ("scale_fmt", "ue8m0"),
                       ("mode", "nearest"), ("layer_norm_type", "rms"), ("isa", "amx"), ("approximate", "tanh"),
                       ("reduce", "sum"), ("activation", "silu"), ("quant_method", "fp8"), ("scaleFmt", "ue8m0")):
        assert not string_addresses_state(arg, value), (arg, value)
    # a pattern that selects its layout by an argument makes that argument configuration
    assert not string_addresses_state("cache_flavour", "fp8", options=("cache_flavour",))


@torch.library.custom_op("pcppass_vllm_like::log_step", mutates_args=())
def log_step(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


@log_step.register_fake
def _(x):
    return x.new_empty(0)


def test_token_only_op_without_handle_is_a_side_effect():
    class Logged(torch.nn.Module):
        def forward(self, x):
            torch.ops.pcppass_vllm_like.log_step(x)     # result unused: only a side effect
            return x * 2

    x = torch.randn(3, 4)
    (w,) = find_state_writes(capture_graph(Logged(), StepInputs((x,), {}, [(x, 0)])))
    assert (w.op, w.state, w.state_node, w.reason) == (
        "pcppass_vllm_like::log_step", "<unknown>", None, Uncovered.SIDE_EFFECT_ONLY)
