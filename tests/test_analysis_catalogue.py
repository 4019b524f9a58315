"""A catalogue of adversarial graph constructs that write persistent state.

Every construct must come out of the audit either covered with the right bytes per row, or
uncovered with a reason and a detail naming the op and the source line: none is silently missed.
Views (``view``, ``reshape``, ``as_strided``, slices, ``.data``, dtype views), ``out=``, in-place
dunders, setitem on a submodule buffer, globals, attributes, closures, ``scatter_`` /
``masked_scatter_``, opaque calls (``allow_in_graph``, ``nonstrict_trace``, a higher-order op
without a body), checkpoint regions, handles, context-held caches, tensor-subclass caches,
int32 slots, patterns that do not fit. The two constructs the graph cannot show (a custom op that
under-declares ``mutates_args``, a cache held only by a context) are caught by the dynamic audit,
which names the rows they change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.fx
import torch.utils.checkpoint
from torch.testing._internal.two_tensor import TwoTensor

import pcppass.ops  # noqa: F401  (registers the pcppass ops)
from pcppass.analysis import Uncovered, find_state_writes
from pcppass.analysis.dynamic import dynamic_audit
from pcppass.analysis.trace import StepInputs, capture_graph
from pcppass.registry import register_pattern, register_refusal, register_resolver
from pcppass.spec import CacheRole, ContextCache, PagedRows, Refusal, Reviewed, WritePattern

import audit_fixtures  # noqa: F401  (registers pcppass_test ops)
from audit_fixtures import graph_with_sparse_state
from vllm_like_ops import CONTEXT, LAYERS, LayerName, ops as vllm_like

ROWS, HEADS, DIM = 4, 2, 16
ROW_BYTES = HEADS * DIM * 4  # one fp32 row [2, 16]


@dataclass(frozen=True)
class Covered:
    bytes_per_row: int = ROW_BYTES


@dataclass(frozen=True)
class Refused:
    reason: Uncovered


@dataclass
class Construct:
    name: str
    build: Callable[[], torch.fx.GraphModule]
    #: one (substring of the state name, outcome) per record, in graph order
    expect: list[tuple[str, Covered | Refused]] = field(default_factory=list)


CATALOGUE: list[Construct] = []


def _inputs(caches: dict) -> StepInputs:
    x, slots = torch.randn(ROWS, HEADS, DIM), torch.tensor([1, 5, 6, 30])
    return StepInputs((x, slots, caches), {}, [(x, 0), (slots, 0)])


def _kv() -> torch.Tensor:
    return torch.zeros(4, 8, HEADS, DIM)


def construct(expect: list, **caches: Callable[[], torch.Tensor]):
    """Register ``fn(x, slots, caches)`` as the forward of a one-step model over ``caches``."""
    def register(fn):
        class Step(torch.nn.Module):
            def forward(self, x, slots, c):
                fn(x, slots, c)
                return x.sum()

        def build():
            return capture_graph(Step(), _inputs({k: make() for k, make in caches.items()}))

        CATALOGUE.append(Construct(fn.__name__, build, expect))
        return fn
    return register


def module_construct(expect: list):
    """Register ``make() -> (model, StepInputs)``."""
    def register(make):
        CATALOGUE.append(Construct(make.__name__, lambda: capture_graph(*make()), expect))
        return make
    return register


# ----------------------------------------------------------------------------- views


@construct([("kv", Covered())], kv=_kv)
def flattened_paged_view(x, s, c):
    c["kv"].view(-1, HEADS, DIM)[s] = x


@construct([("kv", Covered())], kv=_kv)
def reshape_then_index_copy(x, s, c):
    c["kv"].reshape(-1, HEADS * DIM).index_copy_(0, s, x.reshape(ROWS, -1))


@construct([("kv", Covered())], kv=_kv)
def as_strided_dense(x, s, c):
    c["kv"].as_strided((32, HEADS * DIM), (HEADS * DIM, 1)).index_copy_(0, s, x.reshape(ROWS, -1))


@construct([("kv", Refused(Uncovered.NON_INVERTIBLE_VIEW))], kv=_kv)
def as_strided_overlapping(x, s, c):
    c["kv"].as_strided((32, HEADS * DIM), (DIM, 1)).index_copy_(0, s, x.reshape(ROWS, -1))


@construct([("kv", Covered())], kv=_kv)
def slice_of_blocks(x, s, c):
    c["kv"][1:3].flatten(0, 1)[s % 16] = x


@construct([("hf", Covered())], hf=lambda: torch.zeros(HEADS, 40, DIM))
def narrowed_sequence_dim(x, s, c):
    c["hf"][:, 8:].index_copy_(1, s, x.transpose(0, 1))


@construct([("kv", Covered())], kv=_kv)
def data_attribute(x, s, c):
    c["kv"].data.view(-1, HEADS, DIM)[s] = x


@construct([("bf", Covered(64))], bf=lambda: torch.zeros(4, 8, 32, dtype=torch.bfloat16))
def byte_view_of_bf16(x, s, c):
    c["bf"].view(torch.uint8).view(-1, 64)[s] = x.reshape(ROWS, -1).to(torch.bfloat16).view(torch.uint8)


# ----------------------------------------------------------------------------- spellings


@construct([("flat", Covered())], flat=lambda: torch.zeros(32, HEADS, DIM))
def unbound_method_spelling(x, s, c):
    torch.Tensor.index_copy_(c["flat"], 0, s, x)


@construct([("flat", Covered())], flat=lambda: torch.zeros(32, HEADS, DIM))
def aten_overload_spelling(x, s, c):
    torch.ops.aten.index_put_.default(c["flat"], [s], x)


@construct([("kv", Covered())], kv=_kv)
def index_put_accumulate(x, s, c):
    c["kv"].view(-1, HEADS, DIM).index_put_((s,), x, accumulate=True)


@construct([("kv", Covered())], kv=_kv)
def augmented_setitem(x, s, c):
    c["kv"].view(-1, HEADS, DIM)[s] += x


@construct([("list", Covered())], list=lambda: [torch.zeros(32, HEADS, DIM), torch.zeros(32, HEADS, DIM)])
def list_element(x, s, c):
    c["list"][1].index_copy_(0, s, x)


@construct([("kv", Covered()), ("kv", Covered())], kv=lambda: torch.zeros(2, 4, 8, HEADS, DIM),
           scale=lambda: torch.ones(()))
def pattern_op_on_unbound_views(x, s, c):
    k_cache, v_cache = c["kv"].unbind(0)
    torch.ops.pcppass.reshape_and_cache_flash(x, x, k_cache, v_cache, s, "auto", c["scale"], c["scale"])


# ----------------------------------------------------------------------------- whole-tensor updates


@construct([("acc", Refused(Uncovered.NON_ROW_STATE))], acc=lambda: torch.zeros(HEADS, DIM))
def out_keyword(x, s, c):
    torch.mul(x[0], 2, out=c["acc"])


@construct([("acc", Refused(Uncovered.NON_ROW_STATE))] * 2, acc=lambda: torch.zeros(HEADS, DIM))
def inplace_dunders(x, s, c):
    c["acc"] += x.sum(0)
    c["acc"].__imul__(2)


@construct([("kv", Refused(Uncovered.NON_ROW_STATE))] * 3, kv=_kv)
def copy_fill_and_constant_index(x, s, c):
    c["kv"][0].copy_(x[:1].expand(8, HEADS, DIM))
    c["kv"][1].zero_()
    c["kv"][2, 3] = 1.0


@construct([("stats", Refused(Uncovered.NON_ROW_STATE))], stats=lambda: torch.zeros(DIM))
def foreach_list_update(x, s, c):
    torch._foreach_add_([c["stats"]], [x[0, 0]])


# ----------------------------------------------------------------------------- indexed writes no pattern covers


@construct([("flat", Refused(Uncovered.UNKNOWN_MUTATING_OP))] * 3, flat=lambda: torch.zeros(32, 32))
def scatter_masked_scatter_index_add(x, s, c):
    c["flat"].scatter_(0, s[:, None].expand(-1, 32), x.reshape(ROWS, 32))
    c["flat"].masked_scatter_(c["flat"] > 0, x.reshape(-1)[:1].expand(32 * 32))
    c["flat"].index_add_(0, s, x.reshape(ROWS, 32))


@construct([("flat", Refused(Uncovered.UNKNOWN_LAYOUT))] * 2, flat=lambda: torch.zeros(32, HEADS, DIM))
def mask_and_two_index_tensors(x, s, c):
    c["flat"][c["flat"][:, 0, 0] > 0] = 0.0
    c["flat"][s, s % 2] = x[:, 0]


@construct([("kv", Covered())], kv=_kv)
def int32_row_index(x, s, c):
    c["kv"].view(-1, HEADS, DIM)[s.to(torch.int32)] = x


# ----------------------------------------------------------------------------- where the state lives


class WithSubmodule(torch.nn.Module):
    class Cache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(32, HEADS, DIM))

    def __init__(self):
        super().__init__()
        self.sub = self.Cache()
        self.plain = torch.zeros(32, HEADS, DIM)  # a tensor attribute, not a buffer

    def forward(self, x, s, c):
        self.sub.cache[s] = x
        self.plain.index_copy_(0, s, x)
        GLOBAL_CACHE.view(-1, HEADS, DIM)[s] = x
        return x.sum()


GLOBAL_CACHE = torch.zeros(4, 8, HEADS, DIM)


@module_construct([("_modules['sub']._buffers['cache']", Covered()), ("plain", Covered()), ("GLOBAL_CACHE", Covered())])
def submodule_buffer_attribute_and_global():
    return WithSubmodule(), _inputs({})


def _closure_model():
    cache = torch.zeros(32, HEADS, DIM)

    class Closure(torch.nn.Module):
        def forward(self, x, s, c):
            cache.index_copy_(0, s, x)
            return x.sum()

    return Closure()


@module_construct([("cache", Covered())])
def closure_tensor():
    return _closure_model(), _inputs({})


# ----------------------------------------------------------------------------- opaque calls


def _store_rows(cache, s, x):
    cache.index_copy_(0, s, x)
    return x


_store_in_graph = torch.compiler.allow_in_graph(_store_rows)


@torch._dynamo.nonstrict_trace
def _store_nonstrict(cache, s, x):
    cache.index_copy_(0, s, x)
    return x


@construct([("a", Refused(Uncovered.OPAQUE_CALL)), ("b", Refused(Uncovered.OPAQUE_CALL))],
           a=lambda: torch.zeros(32, HEADS, DIM), b=lambda: torch.zeros(32, HEADS, DIM))
def allow_in_graph_and_nonstrict_trace(x, s, c):
    _store_in_graph(c["a"], s, x)
    _store_nonstrict(c["b"], s, x)


def _graph_with_bodiless_higher_order_op() -> torch.fx.GraphModule:
    from torch._higher_order_ops.flat_apply import flat_apply

    graph = torch.fx.Graph()
    cache = graph.placeholder("cache")
    cache.meta["example_value"] = torch.zeros(4, 4)
    graph.output(graph.call_function(flat_apply, (0, 0, cache)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


CATALOGUE.append(Construct("higher_order_op_without_body", _graph_with_bodiless_higher_order_op,
                           [("cache", Refused(Uncovered.OPAQUE_CALL))]))


@construct([("flat", Refused(Uncovered.WRITE_IN_HIGHER_ORDER_OP))], flat=lambda: torch.zeros(32, HEADS, DIM))
def checkpoint_region(x, s, c):
    def body(x, cache):
        cache.index_copy_(0, s, x)
        return x * 2

    torch.utils.checkpoint.checkpoint(body, x, c["flat"], use_reentrant=False)


# ----------------------------------------------------------------------------- custom ops and patterns


@torch.library.custom_op("pcppass_cat::store_head0", mutates_args=("cache",))
def store_head0(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    cache.flatten(0, 1)[slots.long(), 0] = x


@store_head0.register_fake
def _(x, cache, slots) -> None:
    return None


@torch.library.custom_op("pcppass_cat::store_rows", mutates_args=("cache",))
def store_rows(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    cache.flatten(0, 1)[slots.long()] = x


@store_rows.register_fake
def _(x, cache, slots) -> None:
    return None


@torch.library.custom_op("pcppass_cat::store_any_rows", mutates_args=("cache",))
def store_any_rows(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    cache.flatten(0, 1)[slots.long()] = x


@store_any_rows.register_fake
def _(x, cache, slots) -> None:
    return None


register_pattern(WritePattern(
    "catalogue.store_any_rows", ops=("pcppass_cat::store_any_rows",),
    caches=(CacheRole("cache", slots="slots", layout=PagedRows(), values=("x",)),), row_args={"x": 0},
), replace=True)
# the pattern says the row is the whole [2, 16] cache row while the op writes one head of it
register_pattern(WritePattern(
    "catalogue.store_head0", ops=("pcppass_cat::store_head0",),
    caches=(CacheRole("cache", slots="slots", layout=PagedRows(), values=("x",)),), row_args={"x": 0},
), replace=True)
# a pattern whose slot argument the op does not have
register_pattern(WritePattern(
    "catalogue.store_rows", ops=("pcppass_cat::store_rows",),
    caches=(CacheRole("cache", slots="slot_mapping", layout=PagedRows()),),
), replace=True)


@construct([("kv", Refused(Uncovered.ROW_BYTES_MISMATCH))], kv=_kv)
def layout_wider_than_the_op_writes(x, s, c):
    torch.ops.pcppass_cat.store_head0(x[:, 0], c["kv"], s)


@construct([("kv", Refused(Uncovered.UNKNOWN_LAYOUT))], kv=_kv)
def pattern_names_a_missing_argument(x, s, c):
    torch.ops.pcppass_cat.store_rows(x, c["kv"], s)


@construct([("kv", Covered())], kv=_kv)
def int32_slot_mapping_of_a_pattern_op(x, s, c):
    torch.ops.pcppass_cat.store_any_rows(x, c["kv"], s.to(torch.int32))


@construct([("kv", Refused(Uncovered.SLOT_DTYPE))], kv=_kv)
def float_slot_mapping_of_a_pattern_op(x, s, c):
    torch.ops.pcppass_cat.store_any_rows(x, c["kv"], s.to(torch.float32))


@construct([("kv", Refused(Uncovered.UNKNOWN_MUTATING_OP))], kv=lambda: torch.zeros(4, 8, HEADS * DIM))
def custom_op_without_pattern(x, s, c):
    torch.ops.pcppass_test.scale_rows_into(x.reshape(ROWS, -1), c["kv"], s, 0.5)


@construct([("kv", Refused(Uncovered.TENSOR_SUBCLASS_STATE))],
           kv=lambda: TwoTensor(torch.zeros(32, HEADS, DIM), torch.zeros(32, HEADS, DIM)))
def tensor_subclass_cache(x, s, c):
    c["kv"][2:].index_copy_(0, s % 8, x)


CATALOGUE.append(Construct("unknown_storage", graph_with_sparse_state, [
    ("state", Refused(Uncovered.NON_INVERTIBLE_VIEW)),  # sparse: zero strides, reported anyway
    ("unknown storage", Refused(Uncovered.UNKNOWN_STORAGE)),
]))


# ----------------------------------------------------------------------------- handles and tokens


@torch.library.custom_op("pcppass_cat::touch", mutates_args=())
def touch(cache: torch.Tensor) -> torch.Tensor:
    return cache.new_empty(0)


@touch.register_fake
def _(cache):
    return cache.new_empty(0)


@torch.library.custom_op("pcppass_cat::note_step", mutates_args=())
def note_step(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


@note_step.register_fake
def _(x):
    return x.new_empty(0)


class VllmLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_name = LayerName(LAYERS[0])

    def forward(self, x, s, c):
        dep = vllm_like.unified_kv_cache_update(x[:, 0], x[:, 1], self.layer_name)
        out = torch.empty_like(x[:, 0])
        vllm_like.unified_attention_with_output(x[:, 0], x[:, 0], x[:, 1], out, self.layer_name, None, None, dep)
        token = torch.ops.pcppass_test.opaque_kv_update(x[:, 0], s, "layers.0.kv")   # str handle
        touched = torch.ops.pcppass_cat.touch(c["kv"])                                # a cache, token out
        torch.ops.pcppass_cat.note_step(x)                                            # side effect only
        return out + token.sum() + touched.sum()


@module_construct([
    (LAYERS[0], Refused(Uncovered.UNDECLARED_CACHE_HANDLE)),
    (LAYERS[0], Refused(Uncovered.UNDECLARED_CACHE_HANDLE)),
    ("layers.0.kv", Refused(Uncovered.UNDECLARED_CACHE_HANDLE)),
    ("kv", Refused(Uncovered.UNDECLARED_CACHE_HANDLE)),
    ("<unknown>", Refused(Uncovered.SIDE_EFFECT_ONLY)),
])
def handles_tokens_and_side_effects():
    return VllmLayer(), _inputs({"kv": _kv()})


#: state an op reaches through a string it is handed, whatever the argument is called
ODD_CONTEXT: dict[str, torch.Tensor] = {}


@torch.library.custom_op("pcppass_cat::blend_rows", mutates_args=())
def blend_rows(x: torch.Tensor, slots: torch.Tensor, where: str) -> torch.Tensor:
    ODD_CONTEXT[where].index_copy_(0, slots, x)   # writes the state ``where`` names
    return x * 2                                  # and returns real output


@blend_rows.register_fake
def _(x, slots, where):
    return torch.empty_like(x)


class OddlyNamedHandle(torch.nn.Module):
    def forward(self, x, s, c):
        return torch.ops.pcppass_cat.blend_rows(x, s, "rows/0") + 1   # real output, used


@module_construct([("rows/0", Refused(Uncovered.UNDECLARED_CACHE_HANDLE))])
def oddly_named_string_handle_with_real_output():
    ODD_CONTEXT["rows/0"] = torch.zeros(32, HEADS, DIM)
    return OddlyNamedHandle(), _inputs({})


@torch.library.custom_op("pcppass_cat::store_rows_old", mutates_args=("cache",))
def store_rows_old(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    cache.flatten(0, 1)[slots.long()] = x


@store_rows_old.register_fake
def _(x, cache, slots) -> None:
    return None


# reviewed for releases of its package that are not installed: the pattern no longer applies
register_pattern(WritePattern(
    "catalogue.store_rows_old", ops=("pcppass_cat::store_rows_old",),
    caches=(CacheRole("cache", slots="slots", layout=PagedRows(), values=("x",)),), row_args={"x": 0},
    reviewed=Reviewed("store_rows_old above", evidence="tests/test_analysis_catalogue.py::x",
                      package="torch", versions="<1.0"),
), replace=True)


@construct([("kv", Refused(Uncovered.STALE_REVIEW))], kv=_kv)
def pattern_reviewed_for_another_release(x, s, c):
    torch.ops.pcppass_cat.store_rows_old(x, c["kv"], s)


@torch.library.custom_op("pcppass_cat::attend_named", mutates_args=("out",))
def attend_named(x: torch.Tensor, layer_name: str, out: torch.Tensor) -> None:
    out.copy_(x)


@attend_named.register_fake
def _(x, layer_name, out) -> None:
    return None


# writes or only reads, per layer: the resolver must say, and "catalogue" registers no effect
register_pattern(WritePattern(
    "catalogue.attend_named", ops=("pcppass_cat::attend_named",), caches=(),
    context=(ContextCache("layer_name", cache="kv_cache", slots="slot_mapping"),), reads=("layer_name",),
    resolver="catalogue", row_args={"x": 0},
    reviewed=Reviewed("attend_named above", evidence="tests/test_analysis_catalogue.py::x"),
), replace=True)
register_resolver("catalogue", lambda handle: {}, replace=True)


class AttendNamed(torch.nn.Module):
    def forward(self, x, s, c):
        out = torch.empty_like(x)
        torch.ops.pcppass_cat.attend_named(x, "layers.0.attn", out)
        return out


@module_construct([("layers.0.attn", Refused(Uncovered.UNDECIDED_HANDLE))])
def per_layer_op_nobody_decides():
    return AttendNamed(), _inputs({})


@torch.library.custom_op("pcppass_cat::index_and_store", mutates_args=("scratch",))
def index_and_store(x: torch.Tensor, layer_name: str, cache: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    cache.view(-1)[: x.numel()] = x.view(-1)  # the real, undeclared write
    scratch.fill_(-1)                         # the declared one: scratch of the step
    return x * 2


@index_and_store.register_fake
def _(x, layer_name, cache, scratch):
    return torch.empty_like(x)


register_refusal(Refusal("catalogue.index_and_store", ops=("pcppass_cat::index_and_store",),
                         why="writes `cache` without declaring it",
                         reviewed=Reviewed("index_and_store above", evidence="tests/test_analysis_catalogue.py::x")))


class IndexAndStore(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scratch", torch.zeros(8))

    def forward(self, x, s, c):
        return torch.ops.pcppass_cat.index_and_store(x, "layers.0.indexer", c["kv"], self.scratch)


# one record per call, naming the real write: none blaming the declared scratch buffer
@module_construct([("layers.0.indexer", Refused(Uncovered.REFUSED_OP))])
def op_refused_by_name():
    return IndexAndStore(), _inputs({"kv": _kv()})


# ----------------------------------------------------------------------------- the walk


@pytest.mark.parametrize("construct", CATALOGUE, ids=[c.name for c in CATALOGUE])
def test_construct_is_covered_with_its_row_bytes_or_refused_with_a_reason(construct):
    writes = find_state_writes(construct.build())
    assert writes, f"{construct.name}: the write was silently missed"
    got = [(w.state, w.covered, w.bytes_per_row if w.covered else w.reason) for w in writes]
    assert len(writes) == len(construct.expect), got
    for w, (state, outcome) in zip(writes, construct.expect):
        assert state in w.state, got
        if isinstance(outcome, Covered):
            assert w.covered and w.bytes_per_row == outcome.bytes_per_row, got
            assert w.written_bytes_per_row in (None, w.bytes_per_row)
        else:
            assert not w.covered and w.reason is outcome.reason, got
            assert w.detail and w.reason.value in w.describe()
        if w.node.graph.owning_module is not None and w.node.meta.get("stack_trace"):
            assert w.source.split(":")[0].endswith(".py"), w.source


def test_every_reason_has_a_construct():
    reasons = {o.reason for c in CATALOGUE for _, o in c.expect if isinstance(o, Refused)}
    # a user Triton kernel needs Triton: tests/test_analysis_triton_cuda.py
    assert set(Uncovered) - reasons == {Uncovered.USER_TRITON_KERNEL}


# ----------------------------------------------------------------------------- what only a run shows


@torch.library.custom_op("pcppass_cat::under_declared_store", mutates_args=())
def under_declared_store(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    cache.flatten(0, 1)[slots] = x  # writes ``cache`` although mutates_args says nothing
    return x * 2


@under_declared_store.register_fake
def _(x, cache, slots):
    return torch.empty_like(x)


class UnderDeclared(torch.nn.Module):
    def forward(self, x, s, c):
        return torch.ops.pcppass_cat.under_declared_store(x, c["kv"], s) + 1   # real output


class ContextOnly(torch.nn.Module):
    """vLLM's MLA update: the latent cache lives in the per-step context only."""

    def __init__(self):
        super().__init__()
        self.layer_name, self.k_scale = LayerName(LAYERS[1]), torch.ones(())

    def forward(self, x, s, c):
        dep = vllm_like.unified_mla_kv_cache_update(x[:, 0], x[:, 1, :4], self.layer_name, "auto", self.k_scale)
        return x + dep.sum()


def test_under_declared_op_is_invisible_statically_and_named_by_the_dynamic_audit():
    inputs = _inputs({"kv": _kv()})
    assert find_state_writes(capture_graph(UnderDeclared(), inputs)) == []  # the documented blind spot
    report = dynamic_audit(UnderDeclared(), inputs, steps=1)
    assert [(c.state, c.unit, c.rows) for c in report.changes] == [("c['kv']", "slot", [1, 5, 6, 30])]
    assert not report.ok


def test_context_held_cache_is_flagged_statically_and_named_by_the_dynamic_audit():
    CONTEXT[LAYERS[1]] = {"kv_cache": torch.zeros(4, 8, DIM + 4), "slot_mapping": torch.tensor([3, 9, 12, -1])}
    inputs = _inputs({})
    (w,) = find_state_writes(capture_graph(ContextOnly(), inputs))
    assert (w.state, w.reason) == (LAYERS[1], Uncovered.UNDECLARED_CACHE_HANDLE)
    report = dynamic_audit(ContextOnly(), inputs, steps=1)
    (change,) = report.changes
    # named by the module global that holds it (this module imports the same dict)
    assert change.state.endswith(".CONTEXT['model.layers.1.self_attn.attn']['kv_cache']"), change.state
    assert change.rows == [3, 9, 12] and not report.ok
