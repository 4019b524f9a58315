"""vLLM's cache-handle ops without vLLM: an opaque ``LayerName`` registered the way vLLM registers
it (``register_opaque_type(..., typ="value", hoist=True)``) and custom ops with vLLM's exact schemas
(namespace aside), resolving their cache and slot mapping from a per-step context by layer name.

Shared by tests/test_analysis_handles.py and tests/test_analysis_catalogue.py.
"""

from __future__ import annotations

import torch
from torch._library.opaque_object import get_opaque_type_name, register_opaque_type


class LayerName:
    """A layer's name as an opaque value: Dynamo lifts it to a graph input (one graph for all layers)."""

    def __init__(self, value: str):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, LayerName) and self.value == other.value

    def __hash__(self):
        return hash(self.value)

    def __fx_repr__(self):
        return f"LayerName({self.value!r})", {"LayerName": LayerName}


register_opaque_type(LayerName, typ="value", hoist=True)
#: the schema spelling of the opaque type; the op's schema then prints it as ``PyObject``
PYOBJECT = get_opaque_type_name(LayerName)

#: the per-step context the ops resolve their cache and slot mapping from, by layer name
CONTEXT: dict[str, dict[str, torch.Tensor]] = {}

LIB = torch.library.Library("pcppass_vllm_like", "FRAGMENT")
LIB.define(f"unified_kv_cache_update(Tensor key, Tensor value, {PYOBJECT} layer_name) -> Tensor")
LIB.define("unified_kv_cache_update_str(Tensor key, Tensor value, str layer_name) -> Tensor")
LIB.define(f"unified_mla_kv_cache_update(Tensor kv_c_normed, Tensor k_pe, {PYOBJECT} layer_name, "
           "str kv_cache_dtype, Tensor k_scale) -> Tensor")
LIB.define("unified_mla_kv_cache_update_str(Tensor kv_c_normed, Tensor k_pe, str layer_name, "
           "str kv_cache_dtype, Tensor k_scale) -> Tensor")
LIB.define("unified_attention_with_output(Tensor query, Tensor key, Tensor value, Tensor(a3!) output, "
           f"{PYOBJECT} layer_name, Tensor? output_scale=None, Tensor(a6!)? output_block_scale=None, "
           "Tensor? kv_cache_dummy_dep=None) -> ()")
LIB.define(f"attention_reading(Tensor query, {PYOBJECT} layer_name) -> Tensor")
LIB.define("resize_rows(Tensor x, str mode, str layer_norm_type) -> Tensor")


def _name(layer_name) -> str:
    return layer_name.value if isinstance(layer_name, LayerName) else layer_name


def _kv_update(key, value, layer_name):
    ctx = CONTEXT[_name(layer_name)]
    cache, slots = ctx["kv_cache"], ctx["slot_mapping"]
    live = slots >= 0
    cache[0].flatten(0, 1)[slots[live]] = key[live]
    cache[1].flatten(0, 1)[slots[live]] = value[live]
    return torch.empty(0, dtype=key.dtype, device=key.device)


def _mla_update(kv_c_normed, k_pe, layer_name, kv_cache_dtype, k_scale):
    ctx = CONTEXT[_name(layer_name)]
    cache, slots = ctx["kv_cache"], ctx["slot_mapping"]
    live = slots >= 0
    cache.flatten(0, 1)[slots[live]] = torch.cat((kv_c_normed, k_pe), -1)[live]
    return torch.empty(0, dtype=k_pe.dtype, device=k_pe.device)


def _attention(query, key, value, output, layer_name, output_scale=None, output_block_scale=None,
               kv_cache_dummy_dep=None):
    output.copy_(query * CONTEXT[_name(layer_name)]["kv_cache"].mean())


for name, impl in (("unified_kv_cache_update", _kv_update), ("unified_kv_cache_update_str", _kv_update),
                   ("unified_mla_kv_cache_update", _mla_update),
                   ("unified_mla_kv_cache_update_str", _mla_update),
                   ("unified_attention_with_output", _attention),
                   ("attention_reading", lambda q, layer_name: q * 2),
                   ("resize_rows", lambda x, mode, layer_norm_type: x + 1)):
    LIB.impl(name, impl, "CompositeExplicitAutograd")


def _token(*args):
    return args[0].new_empty(0)


for name in ("unified_kv_cache_update", "unified_kv_cache_update_str", "unified_mla_kv_cache_update",
             "unified_mla_kv_cache_update_str"):
    torch.library.register_fake(f"pcppass_vllm_like::{name}", _token, lib=LIB)
torch.library.register_fake("pcppass_vllm_like::unified_attention_with_output",
                            lambda *a, **k: None, lib=LIB)
torch.library.register_fake("pcppass_vllm_like::attention_reading",
                            lambda q, layer_name: torch.empty_like(q), lib=LIB)
torch.library.register_fake("pcppass_vllm_like::resize_rows",
                            lambda x, mode, layer_norm_type: torch.empty_like(x), lib=LIB)

ops = torch.ops.pcppass_vllm_like
VLLM_SCHEMAS = {  # as vLLM's ops print (vllm_real_graphs.md), namespace aside
    "unified_kv_cache_update": "(Tensor key, Tensor value, PyObject layer_name) -> Tensor",
    "unified_mla_kv_cache_update": "(Tensor kv_c_normed, Tensor k_pe, PyObject layer_name, "
                                   "str kv_cache_dtype, Tensor k_scale) -> Tensor",
    "unified_attention_with_output": "(Tensor query, Tensor key, Tensor value, Tensor(a3!) output, "
                                     "PyObject layer_name, Tensor? output_scale=None, "
                                     "Tensor(a6!)? output_block_scale=None, "
                                     "Tensor? kv_cache_dummy_dep=None) -> ()",
}
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
