"""Every op: schema/mutation declarations and fake impl (opcheck), fake shapes under FakeTensorMode,
and torch.compile(fullgraph=True) with the op as one graph node and caches equal to eager."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels_cases import CACHE_ARGS, CASES, OPS, clone_args

OP_NAMES = sorted(CASES)


def call_op(name, kwargs):
    return OPS[name](**kwargs)


@pytest.mark.parametrize("name", OP_NAMES)
def test_opcheck(name):
    """Schema mutation annotations match what the real impl mutates; fake impl matches real
    (static and dynamic shapes through AOT dispatch)."""
    args = CASES[name]()
    torch.library.opcheck(OPS[name].default, (), args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("name", OP_NAMES)
def test_fake_outputs_match_real(name):
    args = CASES[name]()
    real = call_op(name, clone_args(args))
    with FakeTensorMode() as mode:
        fake_args = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        fake = call_op(name, fake_args)
    if real is None:
        assert fake is None
    else:
        assert fake.shape == real.shape and fake.dtype == real.dtype and fake.device == real.device


def step_fn(name, args):
    """A step taking the tensor arguments; ints, floats and strings are constants of the step, as
    model attributes are (a float graph input would be specialised with a restart under dynamic=True)."""
    op = OPS[name]
    constants = {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)}

    def step(tensors):
        out = op(**tensors, **constants)
        return out if out is not None else torch.zeros(())

    return step


def tensors_of(args):
    return {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("backend,dynamic", [("eager", False), ("aot_eager", False), ("aot_eager", True)])
@pytest.mark.parametrize("name", OP_NAMES)
def test_compile_fullgraph_matches_eager(name, backend, dynamic):
    """``dynamic=True``: the fake impl's structural checks run on symbolic sizes without guarding."""
    torch._dynamo.reset()
    args = CASES[name]()
    eager_args, compiled_args = clone_args(args), clone_args(args)
    eager_out = step_fn(name, args)(tensors_of(eager_args))

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        if backend == "eager":
            return gm.forward
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    compiled = torch.compile(step_fn(name, args), backend=recording, fullgraph=True, dynamic=dynamic)
    out = compiled(tensors_of(compiled_args))
    # fullgraph=True already refuses any graph break. Under dynamic=True Dynamo turns float constants
    # (eps) into symbolic inputs, then restarts once to specialise them: the last graph is the one run.
    assert len(graphs) == 1 or dynamic
    targets = [n.target for n in graphs[-1].graph.nodes if n.op == "call_function"]
    assert sum(1 for t in targets if "pcppass" in str(t) and name in str(t)) == 1, targets
    assert torch.equal(out, eager_out)
    for cache in CACHE_ARGS[name]:
        assert torch.equal(compiled_args[cache].view(torch.uint8), eager_args[cache].view(torch.uint8)), cache


def test_inductor_fused_norm_rope_matches_eager():
    torch._dynamo.reset()
    args = CASES["fused_norm_rope"]()
    eager_args, compiled_args = clone_args(args), clone_args(args)
    step = step_fn("fused_norm_rope", args)
    eager_out = step(tensors_of(eager_args))
    out = torch.compile(step, backend="inductor", fullgraph=True)(tensors_of(compiled_args))
    assert torch.equal(out, eager_out)
    for cache in CACHE_ARGS["fused_norm_rope"]:
        assert torch.equal(compiled_args[cache].view(torch.uint8), eager_args[cache].view(torch.uint8))
