"""Deferred sync runs at the end of the step: what it sends must be what each site consumed.

A model may update a tensor in place after passing it to a write op (a residual ``x.add_(...)``,
a slot tensor reused as scratch). The deferred schedule packs the re-run inputs and the slots at the
end of the step, so without a snapshot the other replicas would re-run on (or fill slots from) the
updated values: replicas diverge with no error. Both cases run on 2 gloo ranks and must stay exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pcppass.compiler import PcpBackend
from pcppass.engine.launch import launch
from pcppass.registry import register_pattern
from pcppass.spec import CacheRole, PagedRows, Recipe, WritePattern


@torch.library.custom_op("snaptest::write_memory", mutates_args=("memory",))
def write_memory(x: torch.Tensor, memory: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    s = slot_mapping[keep]
    memory[s // memory.shape[1], s % memory.shape[1]] = torch.tanh(x[keep])


@write_memory.register_fake
def _(x, memory, slot_mapping):
    return None


def _pattern(recipe: Recipe) -> WritePattern:
    return WritePattern(name=f"snaptest.write_memory.{recipe.value}", ops=("snaptest::write_memory",),
                        caches=(CacheRole("memory", slots="slot_mapping", layout=PagedRows()),),
                        row_args={"x": 0, "slot_mapping": 0}, recipe=recipe)


def rerun_input_updated_later(h, slots, memory):
    x = h * 3.0
    torch.ops.snaptest.write_memory(x, memory, slots)
    x.add_(1.0)  # residual-style update after the write: the re-run must not see it
    return x.sum(1)


def slots_updated_later(h, slots, memory):
    local_slots = slots * 1  # computed in the graph
    torch.ops.snaptest.write_memory(h, memory, local_slots)
    local_slots.add_(1)  # scratch reuse after the write: the copy must use the slots written
    return local_slots


CASES = {"rerun": (Recipe.RERUN, rerun_input_updated_later),
         "copy_rows": (Recipe.COPY_ROWS, slots_updated_later)}


def _rank(rank: int, world: int, case: str):
    recipe, step = CASES[case]
    register_pattern(_pattern(recipe), replace=True)
    torch._dynamo.reset()
    backend = PcpBackend(schedule="deferred", inner="eager")
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    memory = torch.zeros(4, 4, 8)
    h = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([1, 2, 5, 6])
    compiled(h[2 * rank:2 * rank + 2].clone(), slots[2 * rank:2 * rank + 2].clone(), memory)
    gathered = [torch.empty_like(memory) for _ in range(world)]
    dist.all_gather(gathered, memory)
    # the single-rank reference: every row written by its owner
    reference = torch.zeros(4, 4, 8)
    write_memory(h * 3.0 if case == "rerun" else h, reference, slots)
    return backend.reports[0].mode, [torch.equal(g, reference) for g in gathered]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_deferred_sync_sends_what_the_site_consumed(case):
    for mode, equal in launch(_rank, 2, case, timeout_s=100):
        assert mode == "sharded"
        assert equal == [True, True], f"{case}: replicas differ from the single-rank reference"
