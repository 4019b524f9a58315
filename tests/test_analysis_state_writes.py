"""find_state_writes on small modules: every spelling of a write, views, temporaries, reasons."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pcppass.analysis import Uncovered, find_state_writes
from pcppass.analysis.trace import StepInputs, capture_graph
from pcppass.patterns.gqa_kv import RESHAPE_AND_CACHE_FLASH
from pcppass.registry import register_pattern, unregister_pattern
from pcppass.spec import CacheRole, PagedRows, Recipe, WritePattern

import audit_fixtures  # noqa: F401  (registers pcppass_test ops)


@torch.library.custom_op("pcppass_test::kv_store", mutates_args=("key_cache", "value_cache"))
def kv_store(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    for cache, rows in ((key_cache, key), (value_cache, value)):
        live = slot_mapping >= 0
        cache.flatten(0, 1)[slot_mapping[live]] = rows[live]


@kv_store.register_fake
def _(key, value, key_cache, value_cache, slot_mapping) -> None:
    return None


KV_STORE = WritePattern(
    name="test_kv_store",
    ops=("pcppass_test::kv_store",),
    caches=(CacheRole("key_cache", slots="slot_mapping", layout=PagedRows()),
            CacheRole("value_cache", slots="slot_mapping", layout=PagedRows())),
    row_args={"key": 0, "value": 0, "slot_mapping": 0},
    recipe=Recipe.COPY_ROWS,
)


@pytest.fixture(autouse=True)
def _kv_store_pattern():
    register_pattern(KV_STORE, replace=True)
    yield
    unregister_pattern(KV_STORE.name)


class Mixed(torch.nn.Module):
    """Every family at once: stacked K/V unbound into views, a counter, scratch, setitem, HF style."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x, slots, caches):
        k_cache, v_cache = caches["kv"].unbind(0)                       # views of one state tensor
        torch.ops.pcppass_test.kv_store(x, x, k_cache, v_cache, slots)  # 2 covered writes
        self.steps.add_(1)                                              # non-row state
        scratch = torch.zeros(4, 2, 16)                                 # temporary: not reported
        scratch.index_copy_(0, torch.arange(4), x[:4])
        scratch[0] = 1
        caches["flat"].view(-1, 2, 16)[slots] = x                       # paged rows via flat view
        caches["hf"].index_copy_(1, slots, x.transpose(0, 1))           # IndexedDim(dim=1)
        caches["hf2"][:, slots] = x.transpose(0, 1)                     # setitem on dim 1
        caches["flat"][0] = 1                                           # fixed region: non-row
        caches["flat"].view(-1, 2, 16)[slots > 3] = 0                   # mask index: unknown layout
        return x.sum() + scratch.sum()


def _mixed_inputs(rows: int = 6):
    x = torch.randn(rows, 2, 16)
    slots = torch.arange(rows)
    caches = {
        "kv": torch.zeros(2, 4, 8, 2, 16),
        "flat": torch.zeros(4, 8, 2, 16),
        "hf": torch.zeros(2, 64, 16),
        "hf2": torch.zeros(2, 64, 16),
    }
    return StepInputs((x, slots, caches), {}, [(x, 0), (slots, 0)])


def _summary(writes):
    return [(w.op, w.state, w.arg, w.covered, w.reason, w.bytes_per_row) for w in writes]


def test_mixed_module_every_write_found_and_classified():
    gm = capture_graph(Mixed(), _mixed_inputs())
    writes = find_state_writes(gm)
    assert _summary(writes) == [
        ("pcppass_test::kv_store", "L['caches']['kv']", "key_cache", True, None, 2 * 16 * 4),
        ("pcppass_test::kv_store", "L['caches']['kv']", "value_cache", True, None, 2 * 16 * 4),
        ("aten::add_", "L['self']._buffers['steps']", "self", False, Uncovered.NON_ROW_STATE, None),
        ("operator.setitem", "L['caches']['flat']", "self", True, None, 128),
        ("aten::index_copy_", "L['caches']['hf']", "self", True, None, 2 * 16 * 4),
        ("operator.setitem", "L['caches']['hf2']", "self", True, None, 2 * 16 * 4),
        ("operator.setitem", "L['caches']['flat']", "self", False, Uncovered.NON_ROW_STATE, None),
        ("operator.setitem", "L['caches']['flat']", "self", False, Uncovered.UNKNOWN_LAYOUT, None),
    ]
    k, v = writes[0], writes[1]
    assert k.layout.kind == v.layout.kind == "paged_rows" and k.layout.block_size == 8
    assert k.view.ops == ("unbind", "getitem") and v.view.storage_offset == 4 * 8 * 2 * 16
    assert [n.name for n in k.view_chain][0] == k.state_node.name
    assert writes[3].layout.kind == "paged_rows" and writes[3].layout.block_size == 8
    assert writes[4].layout.kind == "indexed_dim" and writes[4].layout.dim == 1
    assert writes[5].layout.dim == 1 and writes[5].layout.block_size == 64
    # aten writes: the bytes per row come from the source / values shape and match the layout
    assert [w.written_bytes_per_row for w in writes if w.covered] == [None, None, 128, 128, 128]
    assert writes[0].bound_args["slot_mapping"].name == "l_slots_"
    assert all(w.source.endswith(".py:" + w.source.rsplit(":", 1)[1]) for w in writes)
    assert "test_analysis_state_writes.py" in writes[2].source


def test_dynamic_rows_stay_symbolic():
    gm = capture_graph(Mixed(), _mixed_inputs())
    sym = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(
        n.meta["example_value"], torch.SymInt)]
    assert sym, "the row count was specialised"
    writes = find_state_writes(gm)
    assert sum(w.covered for w in writes) == 5


def test_unknown_op_uncovered_with_source_line():
    from audit_fixtures import unknown_op_model

    gm = capture_graph(*unknown_op_model())
    (w,) = find_state_writes(gm)
    assert w.reason is Uncovered.UNKNOWN_MUTATING_OP and not w.covered
    assert w.op == "pcppass_test::scale_rows_into" and w.arg == "cache"
    path, line = w.source.rsplit(":", 1)
    assert path.endswith("audit_fixtures.py")
    src = open(audit_fixtures.__file__).read().splitlines()[int(line) - 1]
    assert "scale_rows_into" in src


def test_user_pattern_turns_uncovered_into_covered():
    from audit_fixtures import unknown_op_model

    gm = capture_graph(*unknown_op_model())
    assert not find_state_writes(gm)[0].covered
    register_pattern(WritePattern(
        name="scale_rows_into",
        ops=("pcppass_test::scale_rows_into",),
        caches=(CacheRole("cache", slots="slots", layout=PagedRows()),),
        row_args={"x": 0, "slots": 0},
    ))
    try:
        (w,) = find_state_writes(gm)
        assert w.covered and w.pattern.name == "scale_rows_into"
        assert (w.layout.block_size, w.bytes_per_row) == (4, 8 * 4)
    finally:
        unregister_pattern("scale_rows_into")
    assert not find_state_writes(gm)[0].covered


def test_opaque_handle_op_flagged():
    from audit_fixtures import opaque_write_model

    gm = capture_graph(*opaque_write_model())
    writes = find_state_writes(gm)
    assert [(w.op, w.reason, w.state_node) for w in writes] == [
        ("pcppass_test::opaque_kv_update", Uncovered.UNDECLARED_CACHE_HANDLE, None)
    ]
    assert "layers.0.kv" in writes[0].detail and "audit_fixtures.py" in writes[0].source


def test_pattern_op_writing_through_non_invertible_view():
    class Expanded(torch.nn.Module):
        def forward(self, x, slots, caches):
            view = caches["kv"][:, :1].expand(4, 8, 2, 16)   # every offset aliases offset 0
            torch.ops.pcppass_test.kv_store(x, x, view, caches["v"], slots)
            return x.sum()

    x, slots = torch.randn(5, 2, 16), torch.arange(5)
    caches = {"kv": torch.zeros(4, 8, 2, 16), "v": torch.zeros(4, 8, 2, 16)}
    gm = capture_graph(Expanded(), StepInputs((x, slots, caches)))
    k, v = find_state_writes(gm)
    assert k.reason is Uncovered.NON_INVERTIBLE_VIEW and "zero stride" in k.detail
    assert v.covered


def test_layout_that_does_not_fit_is_unknown_layout():
    class Flat(torch.nn.Module):
        def forward(self, x, slots, caches):
            torch.ops.pcppass_test.kv_store(x, x, caches["k"].view(-1), caches["v"], slots)
            return x.sum()

    x, slots = torch.randn(5, 2, 16), torch.arange(5)
    caches = {"k": torch.zeros(4, 8, 2, 16), "v": torch.zeros(4, 8, 2, 16)}
    k, v = find_state_writes(capture_graph(Flat(), StepInputs((x, slots, caches))))
    assert k.reason is Uncovered.UNKNOWN_LAYOUT and "paged" in k.detail
    assert v.covered


def test_vllm_spelling_and_out_kwarg():
    lib = torch.library.Library("_C_cache_ops", "FRAGMENT")
    try:
        lib.define("reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, "
                   "Tensor(b!) value_cache, Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, "
                   "Tensor v_scale) -> ()")
        lib.impl("reshape_and_cache_flash", lambda *a: None, "CompositeExplicitAutograd")
        lib.impl("reshape_and_cache_flash", lambda *a: None, "Meta")
    except RuntimeError:
        pass  # defined by an earlier test in this process

    class VllmStyle(torch.nn.Module):
        def forward(self, k, slots, kv_cache, out):
            key_cache, value_cache = kv_cache.unbind(0)
            torch.ops._C_cache_ops.reshape_and_cache_flash(
                k, k, key_cache, value_cache, slots, "auto", out, out)
            torch.add(k.sum(), 1, out=out)      # out= write into a state tensor: non-row
            return k

    k, slots = torch.randn(5, 2, 16), torch.arange(5)
    kv, out = torch.zeros(2, 4, 8, 2, 16), torch.zeros(())
    writes = find_state_writes(capture_graph(VllmStyle(), StepInputs((k, slots, kv, out))))
    assert [(w.op, w.arg, w.covered) for w in writes] == [
        ("_C_cache_ops::reshape_and_cache_flash", "key_cache", True),
        ("_C_cache_ops::reshape_and_cache_flash", "value_cache", True),
        ("add(out=)", "out", False),
    ]
    assert writes[0].pattern is RESHAPE_AND_CACHE_FLASH
    assert writes[2].reason is Uncovered.NON_ROW_STATE


def test_overload_resolved_from_arguments():
    class Aten(torch.nn.Module):
        def forward(self, x, idx, cache):
            torch.ops.aten.index_copy_(cache, 0, idx, x)   # a packet with several overloads
            return x

    x, idx, cache = torch.randn(3, 4), torch.tensor([0, 2, 5]), torch.zeros(8, 4)
    (w,) = find_state_writes(capture_graph(Aten(), StepInputs((x, idx, cache))))
    assert w.op == "aten::index_copy_" and w.covered and w.layout.dim == 0


def test_scatter_into_state_is_unknown_op_and_temporaries_never_reported():
    class Moe(torch.nn.Module):
        def forward(self, x, idx, cache):
            counts = torch.zeros(4, dtype=torch.int64)          # routing scratch
            counts.scatter_add_(0, idx, torch.ones_like(idx))
            buf = x.new_zeros(8, 4)
            buf.index_put_((idx,), x)
            cache.scatter_(0, idx[:, None].expand(-1, 4), x)    # state, no pattern
            return counts, buf

    x, idx, cache = torch.randn(3, 4), torch.tensor([0, 2, 3]), torch.zeros(8, 4)
    (w,) = find_state_writes(capture_graph(Moe(), StepInputs((x, idx, cache))))
    assert w.op == "aten::scatter_" and w.reason is Uncovered.UNKNOWN_MUTATING_OP
