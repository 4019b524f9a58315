"""The pattern language cannot be built wrong: positional traps, type checks, names that the op's
schema does not have, and every built-in pattern against the schemas of its ops."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pcppass.ops  # noqa: F401  (registers the pcppass ops)
from pcppass.analysis import Uncovered, find_state_writes
from pcppass.analysis.trace import StepInputs, capture_graph
from pcppass.registry import register_pattern, unregister_pattern
from pcppass.spec import (
    BlockSplit, ByArgValue, CacheRole, IndexedDim, PagedRows, Recipe, Refusal, Reviewed, RowLayout, WritePattern,
)


@torch.library.custom_op("pcppass_spec::store_dim1", mutates_args=("cache",))
def store_dim1(src: torch.Tensor, cache: torch.Tensor, index: torch.Tensor) -> None:
    cache.index_copy_(1, index, src)


@store_dim1.register_fake
def _(src, cache, index) -> None:
    return None


class StoreDim1(torch.nn.Module):
    def forward(self, src, index, cache):
        torch.ops.pcppass_spec.store_dim1(src, cache, index)
        return src.sum()


def _store_dim1_writes(layout: RowLayout, slots: str = "index"):
    pattern = register_pattern(WritePattern(
        "spec.store_dim1", ops=("pcppass_spec::store_dim1",),
        caches=(CacheRole("cache", slots=slots, layout=layout),), row_args={"src": 1, "index": 0},
    ), replace=True)
    try:
        src, index, cache = torch.randn(2, 3, 16), torch.tensor([4, 9, 1]), torch.zeros(2, 32, 16)
        return find_state_writes(capture_graph(StoreDim1(), StepInputs((src, index, cache))))
    finally:
        unregister_pattern(pattern.name)


def test_indexed_dim_positional_is_the_dim():
    assert IndexedDim(1) == IndexedDim(dim=1) and IndexedDim(1).dim == 1
    (w,) = _store_dim1_writes(IndexedDim(1))
    # rows along dim 1 of a [2, 32, 16] fp32 cache: 32 rows of 2 * 16 floats
    assert w.covered and (w.layout.kind, w.layout.dim, w.layout.block_size) == ("indexed_dim", 1, 32)
    assert w.bytes_per_row == 2 * 16 * 4


def test_kind_is_a_class_constant_not_a_field():
    assert [f.name for f in dataclasses.fields(IndexedDim)] == ["dim"]
    assert [f.name for f in dataclasses.fields(PagedRows)] == []
    assert (PagedRows.kind, BlockSplit.kind, IndexedDim.kind, ByArgValue.kind) == (
        "paged_rows", "block_split", "indexed_dim", "by_arg_value")
    with pytest.raises(TypeError):
        PagedRows(kind="indexed_dim")


def test_by_arg_value_positional_reads_the_argument():
    layout = ByArgValue("kv_cache_dtype", (("auto", PagedRows()), ("fp8", IndexedDim(0))))
    assert layout.arg == "kv_cache_dtype" and layout.cases[1] == ("fp8", IndexedDim(0))
    assert ByArgValue("mode", {"a": PagedRows()}).cases == (("a", PagedRows()),)
    resolved = layout.resolve((4, 8, 2, 16), 2, {"kv_cache_dtype": "auto"})
    assert (resolved.kind, resolved.block_size, resolved.bytes_per_row) == ("paged_rows", 8, 64)


@pytest.mark.parametrize("build,error,needle", [
    (lambda: BlockSplit("k", "quant_block_size"), TypeError, "positional"),
    (lambda: BlockSplit(value_arg=""), TypeError, "value_arg"),
    (lambda: IndexedDim("1"), TypeError, "int"),
    (lambda: IndexedDim(True), TypeError, "int"),
    (lambda: ByArgValue("kv_cache_dtype", ()), TypeError, "non-empty"),
    (lambda: ByArgValue("kv_cache_dtype", (("auto", PagedRows),)), TypeError, "layout instance"),
    (lambda: ByArgValue("kv_cache_dtype", (("a", PagedRows()), ("a", PagedRows()))), ValueError, "repeats"),
    (lambda: ByArgValue(("auto", PagedRows()), "kv_cache_dtype"), TypeError, "arg"),
    (lambda: CacheRole("kv", "slots"), TypeError, "positional"),
    (lambda: CacheRole("kv", slots=""), TypeError, "slots"),
    (lambda: CacheRole("kv", slots="s", layout=PagedRows), TypeError, "PagedRows()"),
    (lambda: CacheRole("kv", slots="s", layout="paged"), TypeError, "RowLayout"),
    (lambda: WritePattern("p", ("a::b",), ()), TypeError, "positional"),
    (lambda: WritePattern("p", ops="a::op", caches=(CacheRole("kv", slots="s"),)), TypeError, "tuple of names"),
    (lambda: WritePattern("p", ops=("op",), caches=(CacheRole("kv", slots="s"),)), ValueError, "namespace::op"),
    (lambda: WritePattern("p", ops=("a::op",), caches=CacheRole("kv", slots="s")), TypeError, "caches"),
    (lambda: WritePattern("p", ops=("a::op",), caches=()), TypeError, "caches"),
    (lambda: WritePattern("p", ops=("a::op",), caches=(CacheRole("kv", slots="s"),) * 2), ValueError, "two cache roles"),
    (lambda: WritePattern("p", ops=("a::op",), caches=(CacheRole("kv", slots="s"),), row_args={"x": "0"}),
     TypeError, "row_args"),
    (lambda: WritePattern("p", ops=("a::op",), caches=(CacheRole("kv", slots="s"),), recipe="copy"),
     ValueError, "copy"),
    (lambda: WritePattern("p", ops=("a::op",), caches=(CacheRole("kv", slots="s"),), recipe=Recipe.RERUN),
     ValueError, "row_args"),
    (lambda: WritePattern("", ops=("a::op",), caches=(CacheRole("kv", slots="s"),)), TypeError, "name"),
])
def test_wrong_constructions_raise(build, error, needle):
    with pytest.raises(error, match=None) as info:
        build()
    assert needle in str(info.value)


def test_recipe_given_as_its_value_is_the_enum():
    p = WritePattern("p", ops=("a::op",), caches=(CacheRole("kv", slots="s"),), recipe="rerun",
                     row_args={"s": 0})
    assert p.recipe is Recipe.RERUN and p.ops == ("a::op",)


def test_slot_argument_missing_from_the_schema_is_uncovered_and_named():
    (w,) = _store_dim1_writes(IndexedDim(1), slots="slot_mapping")
    assert not w.covered and w.reason is Uncovered.UNKNOWN_LAYOUT
    assert "'slot_mapping'" in w.detail and "pcppass_spec::store_dim1" in w.detail
    assert "src, cache, index" in w.detail


def test_layout_argument_missing_from_the_schema_is_uncovered():
    (w,) = _store_dim1_writes(BlockSplit(value_arg="k", quant_block_arg="qbs"))
    assert not w.covered and "'k', 'qbs'" in w.detail


def _builtin_patterns() -> list[WritePattern]:
    """The patterns the modules of ``pcppass.patterns`` define (other tests register their own
    deliberately wrong ones in the same registry)."""
    import importlib
    import pkgutil

    import pcppass.patterns as pkg

    found = []
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        found += [v for v in vars(module).values() if isinstance(v, WritePattern)]
    return found


def test_every_builtin_pattern_names_only_arguments_of_its_ops():
    """Each pattern's roles, slots, layout and row arguments exist in every registered schema."""
    checked = 0
    for pattern in _builtin_patterns():
        for op in pattern.ops:
            ns, _, name = op.partition("::")
            if pattern.aten_family is not None or not hasattr(getattr(torch.ops, ns), name):
                continue  # aten spellings bind per call; vLLM's own ops are not registered here
            packet = getattr(getattr(torch.ops, ns), name)
            for overload in packet.overloads():
                schema = getattr(packet, overload)._schema
                names = {a.name for a in schema.arguments}
                assert set(pattern.arguments()) <= names, (pattern.name, schema)
                checked += 1
    assert checked >= 7


# ----------------------------------------------------------------------------- reviewed declarations


def test_a_read_declaration_needs_a_review():
    with pytest.raises(ValueError, match="needs reviewed=Reviewed"):
        WritePattern("p", ops=("a::op",), caches=(), reads=("layer_name",), recipe=Recipe.READ_ONLY)
    with pytest.raises(ValueError, match="must name a test"):
        Reviewed("read a.py", evidence="a test")
    with pytest.raises(ValueError, match="give both `package` and `versions`"):
        Reviewed("read a.py", evidence="tests/t.py::test_x", package="vllm")


def test_a_pattern_reviewed_for_other_releases_no_longer_covers():
    """A review names the releases it read: with another one installed, the write is uncovered and
    the message names the installed release."""
    installed = Reviewed("x", evidence="t.py::t", package="torch", versions=">=2.0").installed_version()
    role = CacheRole("cache", slots="index", layout=IndexedDim(1))
    register_pattern(WritePattern(
        "spec.store_dim1", ops=("pcppass_spec::store_dim1",), caches=(role,), row_args={"src": 1, "index": 0},
        reviewed=Reviewed("store_dim1 in this file", evidence="tests/test_analysis_spec.py::x",
                          package="torch", versions="<1.0")), replace=True)
    try:
        src, index, cache = torch.randn(2, 3, 16), torch.tensor([4, 9, 1]), torch.zeros(2, 32, 16)
        (w,) = find_state_writes(capture_graph(StoreDim1(), StepInputs((src, index, cache))))
    finally:
        unregister_pattern("spec.store_dim1")
    assert not w.covered and w.reason is Uncovered.STALE_REVIEW, w
    assert f"reviewed for torch<1.0 (store_dim1 in this file); installed: {installed}" in w.detail
    assert installed == torch.__version__.split("+")[0] or installed == torch.__version__


def test_every_builtin_review_names_a_test_that_exists():
    """Every built-in declaration's evidence is a test function in this repository."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    import importlib
    import pkgutil

    import pcppass.patterns as pkg

    refusals = [v for info in pkgutil.iter_modules(pkg.__path__)
                for v in vars(importlib.import_module(f"{pkg.__name__}.{info.name}")).values() if isinstance(v, Refusal)]
    reviewed = [p for p in _builtin_patterns() if p.reviewed is not None] + refusals
    assert {p.name for p in reviewed} >= {"vllm.unified_attention_with_output", "vllm.moe_forward",
                                          "vllm.unified_mla_attention_with_output", "vllm.sparse_attn_indexer"}
    for pattern in reviewed:
        path, _, test = pattern.reviewed.evidence.partition("::")
        tree = ast.parse((root / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert test in names, (pattern.name, pattern.reviewed.evidence)
    # a read-only declaration is never made without one
    assert all(p.reviewed is not None for p in _builtin_patterns() if p.reads)


# ----------------------------------------------------------------------------- bytes per row


@torch.library.custom_op("pcppass_spec::store_key_half", mutates_args=("cache",))
def store_key_half(key: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    live = slots >= 0
    cache.flatten(0, 1)[slots[live], 0] = key[live]  # only the first of two heads


@store_key_half.register_fake
def _(key, cache, slots) -> None:
    return None


class StoreKeyHalf(torch.nn.Module):
    def forward(self, key, slots, cache):
        torch.ops.pcppass_spec.store_key_half(key, cache, slots)
        return key.sum()


def test_layout_wider_than_the_written_row_is_uncovered_with_both_numbers():
    pattern = register_pattern(WritePattern(
        "spec.store_key_half", ops=("pcppass_spec::store_key_half",),
        caches=(CacheRole("cache", slots="slots", layout=PagedRows(), values=("key",)),),
        row_args={"key": 0, "slots": 0},
    ))
    try:
        key, slots, cache = torch.randn(5, 16), torch.arange(5), torch.zeros(4, 8, 2, 16)
        (w,) = find_state_writes(capture_graph(StoreKeyHalf(), StepInputs((key, slots, cache))))
    finally:
        unregister_pattern(pattern.name)
    # the paged layout's row is [2, 16] fp32 = 128 B; the op writes key rows of 16 floats = 64 B
    assert not w.covered and w.reason is Uncovered.ROW_BYTES_MISMATCH
    assert "writes 64 B per row" in w.detail and "addresses 128 B per row" in w.detail
    assert "key [s" in w.detail or "key [5" in w.detail
    assert w.written_bytes_per_row == 64 and w.layout is None


def test_wrong_indexed_dim_is_caught_by_the_written_rows():
    """The trap of the issue: IndexedDim on the wrong dim resolves, but the bytes do not match."""
    def with_values(layout):
        pattern = register_pattern(WritePattern(
            "spec.store_dim1", ops=("pcppass_spec::store_dim1",),
            caches=(CacheRole("cache", slots="index", layout=layout, values=("src",)),),
            row_args={"src": 1, "index": 0},
        ), replace=True)
        try:
            src, index, cache = torch.randn(2, 3, 16), torch.tensor([4, 9, 1]), torch.zeros(2, 32, 16)
            (w,) = find_state_writes(capture_graph(StoreDim1(), StepInputs((src, index, cache))))
            return w
        finally:
            unregister_pattern(pattern.name)

    wrong = with_values(IndexedDim(0))
    assert wrong.reason is Uncovered.ROW_BYTES_MISMATCH
    assert "writes 128 B per row" in wrong.detail and "addresses 2048 B per row" in wrong.detail
    right = with_values(IndexedDim(1))
    assert right.covered and right.bytes_per_row == right.written_bytes_per_row == 128


# ----------------------------------------------------------------------------- slot dtype


@torch.library.custom_op("pcppass_spec::store_rows", mutates_args=("cache",))
def store_rows(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    live = slots >= 0
    cache.flatten(0, 1)[slots[live].long()] = x[live]


@store_rows.register_fake
def _(x, cache, slots) -> None:
    return None


STORE_ROWS = WritePattern(
    "spec.store_rows", ops=("pcppass_spec::store_rows",),
    caches=(CacheRole("cache", slots="slots", layout=PagedRows(), values=("x",)),),
    row_args={"x": 0, "slots": 0},
)


class Int32Slots(torch.nn.Module):
    def forward(self, x, slots, caches):
        torch.ops.pcppass_spec.store_rows(x, caches["op"], slots)            # int32 slot mapping
        caches["flat"].view(-1, 2, 16)[slots] = x.view(-1, 2, 16)            # int32 row index
        caches["flat"].view(-1, 2, 16)[slots.long()] = x.view(-1, 2, 16)     # int64
        torch.ops.pcppass_spec.store_rows(x, caches["op"], slots.float())    # not integers: refused
        return x.sum()


def test_int32_slot_mappings_are_covered_and_non_integer_ones_refused_with_op_state_line_and_dtype():
    register_pattern(STORE_ROWS, replace=True)
    try:
        x, slots = torch.randn(5, 32), torch.arange(5, dtype=torch.int32)
        caches = {"op": torch.zeros(4, 8, 32), "flat": torch.zeros(4, 8, 2, 16)}
        op, setitem, ok, floats = find_state_writes(capture_graph(Int32Slots(), StepInputs((x, slots, caches))))
    finally:
        unregister_pattern(STORE_ROWS.name)
    for w in (op, setitem, ok):
        assert w.covered and w.bytes_per_row == 128, w
    assert op.op == "pcppass_spec::store_rows" and "int32 slot mapping" in _source_line(op.source)
    assert not floats.covered and floats.reason is Uncovered.SLOT_DTYPE
    assert "through slot mapping slots of dtype torch.float32" in floats.detail
    assert floats.op in floats.detail and floats.state in floats.detail and floats.source in floats.detail
    assert "not integers: refused" in _source_line(floats.source)


def _source_line(location: str) -> str:
    path, line = location.rsplit(":", 1)
    with open(__file__ if path.endswith("test_analysis_spec.py") else path) as f:
        return f.read().splitlines()[int(line) - 1]


def test_declarations_made_in_a_restored_block_do_not_outlive_it():
    from pcppass.registry import declarations_restored, get_resolver, pattern_for_op, register_resolver

    builtin = pattern_for_op("aten::index_copy_")
    assert builtin is not None
    mine = WritePattern("spec.store_dim1", ops=("pcppass_spec::store_dim1",),
                        caches=(CacheRole("cache", slots="index", layout=IndexedDim(1)),),
                        row_args={"src": 1, "index": 0})
    with declarations_restored():
        register_pattern(mine)
        unregister_pattern(builtin.name)
        register_resolver("spec.restored", lambda handle: {})
        assert pattern_for_op("pcppass_spec::store_dim1") is mine and pattern_for_op("aten::index_copy_") is None
        assert get_resolver("spec.restored") is not None
    assert pattern_for_op("pcppass_spec::store_dim1") is None
    assert pattern_for_op("aten::index_copy_") is builtin
    assert get_resolver("spec.restored") is None
