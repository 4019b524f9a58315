"""``pcppass audit --dynamic`` watches state the step does not receive: caches held in a
module-global dict, in a plain attribute of a helper object and in a closure (vLLM's forward
context is the first kind). It names the rows they change, and says plainly when it could not
watch everything, never "every state change explained"."""

from __future__ import annotations

import torch

from pcppass.analysis import audit
from pcppass.analysis.dynamic import dynamic_audit
from pcppass.analysis.trace import StepInputs

#: a per-step context: the cache lives here only, as vLLM's forward context holds its KV caches
CONTEXT: dict[str, torch.Tensor] = {}


class Holder:
    """A plain object (not a module) keeping a cache as an attribute."""

    def __init__(self) -> None:
        self.cache = torch.zeros(4, 4, 8)


HOLDER = Holder()


def make_writer():
    cache = torch.zeros(4, 4, 8)

    def write(x, slots):
        cache.flatten(0, 1)[slots] = x

    return write


#: layer name -> how the op reaches its cache (none of them through the step's arguments)
WRITERS = {
    "layers.0.ctx": lambda x, slots: CONTEXT["layers.0.ctx"].flatten(0, 1).index_copy_(0, slots, x),
    "layers.1.attr": lambda x, slots: HOLDER.cache.flatten(0, 1).index_copy_(0, slots, x),
    "layers.2.closure": make_writer(),
}


@torch.library.custom_op("pcppass_dyn::context_update", mutates_args=())
def context_update(x: torch.Tensor, slots: torch.Tensor, layer_name: str) -> torch.Tensor:
    live = slots >= 0
    WRITERS[layer_name](x[live], slots[live])
    return x.new_empty(0)


@context_update.register_fake
def _(x, slots, layer_name):
    return x.new_empty(0)


class ContextModel(torch.nn.Module):
    def forward(self, x, slots):
        deps = [torch.ops.pcppass_dyn.context_update(x, slots, name) for name in WRITERS]
        return x * 2 + sum(d.sum() for d in deps)


def _step():
    CONTEXT["layers.0.ctx"] = torch.zeros(4, 4, 8)
    x, slots = torch.randn(3, 8) + 1, torch.tensor([2, 7, -1])
    return ContextModel(), StepInputs((x, slots), {}, [(x, 0), (slots, 0)])


def test_state_outside_the_arguments_is_watched_and_named():
    model, inputs = _step()
    report = dynamic_audit(model, inputs, steps=1)
    assert not report.ok and report.verified
    changes = {c.state: (c.unit, c.rows) for c in report.changes}
    assert changes == {
        f"{__name__}.CONTEXT['layers.0.ctx']": ("slot", [2, 7]),
        "Holder.cache": ("slot", [2, 7]),
        "closure of make_writer.<locals>.write": ("slot", [2, 7]),
    }
    assert report.unreachable >= 3
    lines = report.summary_lines()
    assert not any("every state change" in line for line in lines)


def test_static_audit_flags_the_handles_and_the_report_is_not_ok():
    model, inputs = _step()
    report = audit(model, inputs, dynamic_steps=1)
    assert [(w.state, w.arg) for w in report.writes] == [(name, "layer_name") for name in WRITERS]
    payload = report.to_dict()
    assert not report.ok and payload["verified"] and len(payload["unexplained_changes"]) == 3


class RowsOnly(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_a_clean_step_is_explained_only_when_everything_was_watched():
    x = torch.randn(3, 8)
    inputs = StepInputs((x,), {}, [(x, 0)])
    clean = dynamic_audit(RowsOnly(), inputs, steps=1)
    assert clean.ok and clean.verified and clean.watched > 0
    assert "every state change in 1 step(s) is explained" in clean.summary_lines()[-1]
    blind = dynamic_audit(RowsOnly(), inputs, steps=1, max_bytes=0)
    assert not blind.ok and not blind.verified and not blind.changes
    assert "beyond the 0 B snapshot budget" in blind.blind_spots[0]
    assert "could NOT verify" in blind.summary_lines()[-1]


def test_state_created_by_the_last_step_is_not_claimed_checked():
    created = []

    class Lazy(torch.nn.Module):
        def forward(self, x):
            return x * 2

    def allocate(module, args, out):
        created.append(torch.ones(16))  # a cache allocated during the step, kept alive

    model = Lazy()
    model.register_forward_hook(allocate)
    x = torch.randn(3, 8)
    report = dynamic_audit(model, StepInputs((x,), {}, [(x, 0)]), steps=1)
    assert not report.verified and "created during the last step" in report.blind_spots[0]
