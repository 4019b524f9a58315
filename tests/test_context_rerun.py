"""A context-addressed state update synced by RERUN or COPY_ROWS, chosen by bytes per row, on 2
gloo ranks.

The op here behaves like vLLM's recurrent-state ops (``vllm::mamba_mixer2``): it takes a layer
name, fetches the layer's state (one line per request) and its rows' state lines from a per-step
context, advances each row's line from the row's input and writes only its output. Its pattern
lists RERUN as an alternative to COPY_ROWS: the resolver vouches that re-running the update for
other rows is exact (the update is row-wise), and a row's input (8 floats) is smaller than its
state line (64 floats), so RERUN is chosen; a resolver that vouches nothing gets COPY_ROWS, with
both byte counts recorded either way. Rows change owner every step. After every step the states
are bitwise equal on both ranks and equal to one process applying every row's update, with one
collective per step, under eager, aot_eager and Inductor (the re-run op has no graph output: it
must survive dead-code elimination). Two ranks writing one state line, or one rank advancing a line
from two rows: every rank raises the same error before re-running anything, and every state is as
it was before the step on every rank (each rank writes back the lines its own op advanced, from
the snapshot taken before the op).
"""

from __future__ import annotations

import pytest
import torch

from pcppass.compiler import PcpBackend
from pcppass.engine.launch import launch
from pcppass.registry import HandleEffect, register_pattern, register_resolver
from pcppass.spec import CacheRole, ContextCache, Recipe, WritePattern

ROWS, WIDTH, HEADS, STATE, LINES = 4, 8, 4, 16, 12
LAYERS = ("layers.0", "layers.1")
#: bytes per row: a state line (HEADS x STATE float32), a row's input (WIDTH float32)
COPY_BYTES, RERUN_BYTES = HEADS * STATE * 4, WIDTH * 4

#: the per-step context the op reads (vLLM: the forward context and the layers' states)
CONTEXT: dict[str, dict[str, torch.Tensor]] = {}


def _update(state: torch.Tensor, x: torch.Tensor, lines: torch.Tensor, out: torch.Tensor | None) -> None:
    """Advance the line of every row with a line >= 0 by that row's input (row-wise)."""
    keep = (lines >= 0).nonzero().flatten()
    if not keep.numel():
        return
    line = lines[keep]
    rows = x[keep]
    drive = torch.tanh(rows[:, :HEADS, None] * rows[:, HEADS:].sum(-1)[:, None, None] + torch.arange(STATE))
    state[line] = state[line] * 0.5 + drive
    if out is not None:
        out[keep] = state[line].sum(-1).repeat(1, WIDTH // HEADS)


def _recur(x: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    entry = CONTEXT[layer_name]
    _update(entry["state"], x, entry["lines"], out)


LIB = torch.library.Library("ctxrerun", "FRAGMENT")
LIB.define("recur(Tensor x, Tensor(a!) out, str layer_name) -> ()")
LIB.impl("recur", _recur, "CompositeExplicitAutograd")
torch.library.register_fake("ctxrerun::recur", lambda x, out, layer_name: None, lib=LIB)

register_pattern(WritePattern(
    name="ctxrerun.recur", ops=("ctxrerun::recur",), caches=(),
    context=(ContextCache("layer_name", cache="state", slots="state_lines"),),
    resolver="ctxrerun", row_args={"x": 0}, recipe=Recipe.COPY_ROWS, alternatives=(Recipe.RERUN,),
))


def resolve(handle: str) -> dict[str, torch.Tensor]:
    entry = CONTEXT[handle]
    return {"state": entry["state"][:, None], "state_lines": entry["lines"]}


def rerun(op: str, handle: str, rows, lines: torch.Tensor) -> None:
    assert op == "ctxrerun::recur", op
    _update(CONTEXT[handle]["state"], rows["x"], lines, None)


def _effect(exact: bool):
    def effect(op: str, handle: str) -> HandleEffect:
        return HandleEffect(True, "the toy op advances its rows' state lines",
                            rerun_exact="the update is row-wise" if exact else None)
    return effect


class Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in LAYERS:
            out = torch.zeros_like(x)
            torch.ops.ctxrerun.recur(x * 3, out, name)
            x = x + out
        return x


def _step(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows and their lines. Request j (line j + 1) is owned by rank (j + step) % world,
    so every request changes owner every step; the last row is padding (line -1)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, WIDTH, generator=g)
    owned = [j + 1 for j in range(world * (ROWS - 1)) if (j + step) % world == rank]
    return x, torch.tensor(owned[:ROWS - 1] + [-1])


def _fresh() -> None:
    CONTEXT.clear()
    g = torch.Generator().manual_seed(7)
    for name in LAYERS:
        CONTEXT[name] = {"state": torch.randn(LINES, HEADS, STATE, generator=g), "lines": torch.empty(0)}


def _set_lines(lines: torch.Tensor) -> None:
    for name in LAYERS:
        CONTEXT[name]["lines"] = lines


def _rank_run(rank: int, world: int, inner: str, exact: bool, steps: int = 3):
    register_resolver("ctxrerun", resolve, effect=_effect(exact), rerun=rerun, replace=True)
    _fresh()
    backend = PcpBackend(inner=inner, schedule="deferred")
    compiled = torch.compile(Model(), backend=backend, fullgraph=True)
    states = []
    for step in range(steps):
        x, lines = _step(step, rank, world)
        _set_lines(lines)
        compiled(x)
        states.append({name: CONTEXT[name]["state"].numpy().copy() for name in LAYERS})
    report = backend.reports[-1]
    return states, report.all_gather_nodes, [(w.state, w.recipe.value, dict(w.recipe_bytes)) for w in report.writes]


#: two owners of one state line in one step: (every rank's lines, what the error names)
CONFLICTS = {
    # both ranks advance line 1, each also its own line 2 + rank
    "two_ranks": ([[1, 2, -1, -1], [1, 3, -1, -1]], "writing layers.0 (state): slot 1 was written by ranks [0, 1]"),
    # rank 0 advances line 1 from two rows
    "one_rank_twice": ([[1, 1, -1, -1], [2, 3, -1, -1]], "rank 0 advanced state line 1 from more than one row"),
}


def _rank_conflict(rank: int, world: int, lines: list[list[int]]) -> tuple[str, str, list[bytes], list[bytes]] | None:
    """A step with ``lines[rank]`` on each rank: the refusal, and every layer's whole state before
    and after the refused step."""
    import torch.distributed as dist

    register_resolver("ctxrerun", resolve, effect=_effect(True), rerun=rerun, replace=True)
    _fresh()
    torch._dynamo.reset()
    backend = PcpBackend(group=dist.new_group(list(range(world))), inner="eager", schedule="deferred")
    compiled = torch.compile(Model(), backend=backend, fullgraph=True)
    x, _ = _step(0, rank, world)
    _set_lines(torch.tensor(lines[rank]))
    before = [CONTEXT[name]["state"].numpy().tobytes() for name in LAYERS]
    try:
        compiled(x)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), before, [CONTEXT[name]["state"].numpy().tobytes() for name in LAYERS]
    return None


CASES = [("eager", True), ("inductor", True), ("eager", False)]


def _rank_all(rank: int, world: int):
    results = []
    for inner, exact in CASES:
        torch._dynamo.reset()
        results.append(_rank_run(rank, world, inner, exact))
    torch._dynamo.reset()
    return results, {name: _rank_conflict(rank, world, lines) for name, (lines, _) in CONFLICTS.items()}


def _reference(world: int, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """One process: each step, every rank's rows advanced on the states as synced before it."""
    _fresh()
    out = []
    for step in range(steps):
        for rank in range(world):
            x, lines = _step(step, rank, world)
            _set_lines(lines)
            Model()(x)
        out.append({name: CONTEXT[name]["state"].clone() for name in LAYERS})
    return out


@pytest.mark.timeout(400)
def test_context_state_rerun_or_copy_by_bytes():
    world = 2
    ranks = launch(_rank_all, world, timeout_s=380)
    reference = _reference(world)
    for i, (inner, exact) in enumerate(CASES):
        recipe = "rerun" if exact else "copy_rows"
        for rank in range(world):
            states, gathers, writes = ranks[rank][0][i]
            assert gathers == 1, (inner, gathers)
            assert writes == [(name, recipe, {"copy_rows": COPY_BYTES, "rerun": RERUN_BYTES}) for name in LAYERS], \
                (inner, writes)
            for step in range(3):
                for name in LAYERS:
                    assert torch.equal(torch.from_numpy(states[step][name]), reference[step][name]), \
                        (inner, exact, rank, step, name)
    for name, (_, names) in CONFLICTS.items():
        conflicts = [ranks[rank][1][name] for rank in range(world)]
        for conflict in conflicts:
            assert conflict is not None and conflict[0] == "PcpSyncError", (name, conflict)
            assert conflict[1] == conflicts[0][1], (name, "ranks raised different errors")
            assert names in conflict[1], (name, conflict[1])
            assert "every replica holds what it held before the step" in conflict[1], (name, conflict[1])
            # every line as before the step: the contested line and each rank's own lines
            assert conflict[3] == conflict[2], (name, "a replica's state changed although the step was refused")
        assert conflicts[0][2] == conflicts[1][2], name


def test_alternative_recipes_are_checked():
    context = (ContextCache("layer_name", cache="state", slots="state_lines"),)
    with pytest.raises(ValueError, match="one alternative recipe is RERUN"):
        WritePattern(name="x", ops=("x::y",), caches=(), context=context, resolver="r", row_args={"x": 0},
                     alternatives=(Recipe.READ_ONLY,))
    with pytest.raises(TypeError, match="tuple of recipes"):
        WritePattern(name="x", ops=("x::y",), caches=(), context=context, resolver="r", row_args={"x": 0},
                     alternatives=Recipe.RERUN)
    two_slots = context + (ContextCache("layer_name", cache="other", slots="slot_mapping"),)
    with pytest.raises(ValueError, match="one slots role"):
        WritePattern(name="x", ops=("x::y",), caches=(), context=two_slots, resolver="r", row_args={"x": 0},
                     alternatives=(Recipe.RERUN,))
    with pytest.raises(ValueError, match="context-addressed"):
        WritePattern(name="x", ops=("x::y",), caches=(CacheRole("cache", slots="slots"),),
                     row_args={"slots": 0}, alternatives=(Recipe.RERUN,))


def test_audit_shows_the_chosen_recipe_and_both_byte_counts():
    """``pcppass audit``'s table and JSON: the recipe chosen per handle and what each would move."""
    from rich.console import Console

    from pcppass.analysis.report import audit
    from pcppass.analysis.report import print_writes_table

    for exact, chosen in ((True, "rerun"), (False, "copy_rows")):
        register_resolver("ctxrerun", resolve, effect=_effect(exact), rerun=rerun, replace=True)
        _fresh()
        x, lines = _step(0, 0, 2)
        _set_lines(lines)
        torch._dynamo.reset()
        report = audit(Model(), (x,))
        rows = report.to_dict()["writes"]
        assert [(r["state"], r["recipe"], r["recipe_bytes"]) for r in rows] == [
            (name, chosen, {"copy_rows": COPY_BYTES, "rerun": RERUN_BYTES}) for name in LAYERS], rows
        assert all(f"recipe {chosen} (copy_rows {COPY_BYTES} B/row, rerun {RERUN_BYTES} B/row)" in r["detail"]
                   for r in rows), rows
        console = Console(record=True, width=300)
        print_writes_table("toy", report.writes, console)
        table = console.export_text()
        assert table.count(f"copy_rows {COPY_BYTES}, rerun {RERUN_BYTES}") == len(LAYERS), table
        assert table.count(chosen) >= len(LAYERS), table
