"""Small models for the analysis/audit tests: an unregistered mutating op, an opaque cache write.

Importable as ``audit_fixtures:<factory>`` by the CLI tests (tests/ is on sys.path under pytest).
"""

from __future__ import annotations

import torch
import torch.fx

from pcppass.analysis.trace import StepInputs

# A cache-write op no pattern knows: the audit must list it as uncovered.
@torch.library.custom_op("pcppass_test::scale_rows_into", mutates_args=("cache",))
def scale_rows_into(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
    live = slots >= 0
    cache.view(-1, cache.shape[-1])[slots[live]] = x[live] * scale


@scale_rows_into.register_fake
def _(x, cache, slots, scale) -> None:
    return None


# A vLLM-style opaque write: fetches its cache by layer name from a global context, declares no
# mutation, and returns an empty dependency token that the next op takes.
CONTEXT: dict[str, torch.Tensor] = {}


@torch.library.custom_op("pcppass_test::opaque_kv_update", mutates_args=())
def opaque_kv_update(x: torch.Tensor, slots: torch.Tensor, layer_name: str) -> torch.Tensor:
    cache = CONTEXT[layer_name]
    live = slots >= 0
    cache.view(-1, cache.shape[-1])[slots[live]] = x[live]
    return torch.empty(0, device=x.device)


@opaque_kv_update.register_fake
def _(x, slots, layer_name):
    return x.new_empty(0)


@torch.library.custom_op("pcppass_test::attend", mutates_args=())
def attend(x: torch.Tensor, dep: torch.Tensor) -> torch.Tensor:
    return x * 2


@attend.register_fake
def _(x, dep):
    return torch.empty_like(x)


class UnknownOpModel(torch.nn.Module):
    def forward(self, x, slots, caches):
        torch.ops.pcppass_test.scale_rows_into(x, caches["kv"], slots, 0.5)  # line: unknown op
        return x + 1


class OpaqueWriteModel(torch.nn.Module):
    def forward(self, x, slots, caches):
        dep = torch.ops.pcppass_test.opaque_kv_update(x, slots, "layers.0.kv")
        return torch.ops.pcppass_test.attend(x, dep) + caches["kv"].sum()


def _step(rows: int = 5, blocks: int = 4, bs: int = 4, dim: int = 8):
    x = torch.arange(rows * dim, dtype=torch.float32).reshape(rows, dim) + 1
    slots = torch.tensor([1, 6, 9, 14, -1][:rows])
    caches = {"kv": torch.zeros(blocks, bs, dim)}
    return x, slots, caches


def unknown_op_model():
    x, slots, caches = _step()
    return UnknownOpModel(), StepInputs((x, slots, caches), {}, [(x, 0), (slots, 0)])


def opaque_write_model():
    x, slots, caches = _step()
    CONTEXT["layers.0.kv"] = caches["kv"]
    return OpaqueWriteModel(), StepInputs((x, slots, caches), {}, [(x, 0), (slots, 0)])


class EagerWriteModel(torch.nn.Module):
    """Covered writes in the graph, plus a write in eager code around the compiled region."""

    def forward(self, x, slots, caches):
        torch.ops.pcppass.reshape_and_cache_flash(
            x[:, None], x[:, None], caches["k"], caches["v"], slots, "auto", self.scale, self.scale)
        _eager_bookkeeping(caches["kv"])  # runs eagerly: no graph sees its write
        return x


@torch.compiler.disable
def _eager_bookkeeping(cache: torch.Tensor) -> None:
    cache[0, 3] = 7.0


def eager_write_model():
    import pcppass.ops  # noqa: F401

    x, slots, caches = _step()
    caches["k"] = torch.zeros(4, 4, 1, 8)
    caches["v"] = torch.zeros(4, 4, 1, 8)
    model = EagerWriteModel()
    model.scale = torch.ones(())
    return model, StepInputs((x, slots, caches), {}, [(x, 0), (slots, 0)])


class GraphBreakModel(torch.nn.Module):
    def forward(self, x, slots, caches):
        print("host sync")  # a graph break: the static audit needs one graph
        return x + 1


def graph_break_model():
    x, slots, caches = _step()
    return GraphBreakModel(), StepInputs((x, slots, caches))


def graph_with_sparse_state() -> torch.fx.GraphModule:
    """A graph whose state and one temporary have no readable storage (sparse COO)."""
    graph = torch.fx.Graph()
    state = graph.placeholder("state")
    state.meta["example_value"] = torch.zeros(4, 4).to_sparse()
    bumped = graph.call_method("add_", (state, 1))
    bumped.meta["example_value"] = state.meta["example_value"]
    fresh = graph.call_method("to_sparse", (graph.call_function(torch.zeros, (4, 4)),))
    fresh.meta["example_value"] = torch.zeros(4, 4).to_sparse()
    written = graph.call_method("mul_", (fresh, 2))
    written.meta["example_value"] = fresh.meta["example_value"]
    graph.output((bumped, written))
    return torch.fx.GraphModule(torch.nn.Module(), graph)
