"""vLLM's MoE models decode-sharded, on the dispatch vLLM uses on GPUs, and vLLM's collectives.

On CUDA, ROCm and XPU vLLM runs every MoE layer through ``vllm::moe_forward`` (or
``moe_forward_shared`` with a shared expert), an op that fetches the layer by name; on the CPU it
traces the MoE inline. Here the GPU dispatch is selected on the CPU (the same op, the same
``MoERunner._forward_impl`` inside: :func:`pcppass.integrations.vllm.loaders.use_moe_dispatch_op`),
so the graph pcppass rewrites holds the op GPU users get.

* Qwen3-MoE (``moe_forward``) and DeepSeek-V2 with MoE in every layer and a shared expert (MLA,
  ``moe_forward_shared``) on the GPU dispatch, Mixtral on the CPU path, sharded at P=2, Qwen3-MoE
  at P=4 (layer names as strings there), requests finishing on different steps: replicas bitwise
  identical after every step,  tokens equal to vLLM's own ``LLM.generate``, one collective per decode step; every MoE op is
  declared read-only by the reviewed declaration (with the resolver's per-layer reason).
* A layer that records EPLB expert loads is refused by name.
* vLLM's collectives (``all_reduce``, ``all_gather``, ``reduce_scatter``) on a real graph: read
  only through their group name, nothing uncovered.
"""

from __future__ import annotations

import pytest
import torch

from vllm_sharding import check_sharded

MOE_OPS = {"qwen3_moe": "vllm::moe_forward", "deepseek_v2_moe": "vllm::moe_forward_shared"}


def _moe_records(result: dict, op: str) -> list[tuple]:
    return [w for w in result["writes"] if w[0] == op]


@pytest.mark.timeout(2400)  # the session's sharded launches (vllm_sharding), if this test comes first
def test_moe_models_sharded_on_vllms_gpu_dispatch(vllm_sharded_two, vllm_sharded_four, vllm_reference_tokens):
    for model in ("qwen3_moe", "deepseek_v2_moe", "mixtral"):
        ranks = vllm_sharded_two[model]
        check_sharded(f"{model} P=2", ranks, vllm_reference_tokens[model])
        if model in MOE_OPS:
            records = _moe_records(ranks[0], MOE_OPS[model])
            layers = [f"model.layers.{n}.mlp.experts" for n in range(2)]
            assert [(w[1], w[2]) for w in records] == [(name, "read_only") for name in layers], ranks[0]["writes"]
    # at P=4 vLLM's layer names are plain strings: the other handle encoding of moe_forward
    for model in ("qwen3_moe", "deepseek_v2_moe", "mixtral"):
        check_sharded(f"{model} P=4", vllm_sharded_four[model], vllm_reference_tokens[model])
        if model in MOE_OPS:
            records = _moe_records(vllm_sharded_four[model][0], MOE_OPS[model])
            assert records and all(w[2] == "read_only" for w in records), vllm_sharded_four[model][0]["writes"]


def test_an_moe_layer_recording_expert_loads_is_refused():
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from pcppass.integrations.vllm.context import UnsupportedLayer
    from pcppass.integrations.vllm.effects import moe_effect

    layer = object.__new__(MoERunner)  # the checks read only the router and the routed experts
    torch.nn.Module.__init__(layer)
    layer.router = type("Router", (), {"eplb_state": None, "_routing_replay_out": None, "capture_fn": None})()
    layer.routed_experts = type("Experts", (), {"routing_sink": None})()
    assert not moe_effect(layer, "model.layers.0.mlp.experts").writes
    layer.router.eplb_state = object()
    with pytest.raises(UnsupportedLayer, match=r"model.layers.0.mlp.experts records expert load statistics \(EPLB\)"):
        moe_effect(layer, "model.layers.0.mlp.experts")


def test_vllm_collectives_are_declared_write_free():
    import vllm.distributed.parallel_state  # noqa: F401  (registers vllm::all_reduce and the others)

    import pcppass.integrations.vllm  # noqa: F401
    from pcppass.analysis import find_state_writes
    from pcppass.analysis.trace import StepInputs, capture_graph

    def step(x):
        y = torch.ops.vllm.all_reduce(x, "tp:0")
        z = torch.ops.vllm.all_gather(y, 0, 2, "tp:0")
        return torch.ops.vllm.reduce_scatter(z, 0, 2, "tp:0")

    writes = find_state_writes(capture_graph(step, StepInputs((torch.randn(4, 8),))))
    assert [(w.op, w.arg, w.state, w.covered, w.recipe.value) for w in writes] == [
        (f"vllm::{op}", "group_name", "tp:0", True, "read_only") for op in ("all_reduce", "all_gather", "reduce_scatter")]


class _Indexer(torch.nn.Module):
    """DeepSeek-V3.2's indexer call as vLLM makes it: its cache and top-k buffer are state."""

    def __init__(self):
        super().__init__()
        self.register_buffer("kv_cache", torch.zeros(4, 16 * 132, dtype=torch.uint8))
        self.register_buffer("topk_indices_buffer", torch.full((8, 2048), -1, dtype=torch.int32))

    def forward(self, hidden, q, k, weights):
        return torch.ops.vllm.sparse_attn_indexer(
            hidden, "model.layers.0.self_attn.indexer.k_cache", self.kv_cache, q, None, k, weights, 128,
            "ue8m0", 2048, 128, 256, 256, self.topk_indices_buffer, False, False, False,
            "model.layers.0.self_attn.attn")


def test_sparse_attn_indexer_is_refused_by_name(monkeypatch):
    """The real op's graph (a tiny V3.2 does not run on vLLM's CPU platform: 'Sparse Attention is
    not supported on CPU'): one uncovered record naming the indexer cache write; none blaming the
    top-k scratch buffer."""
    monkeypatch.setenv("VLLM_USE_LAYERNAME", "0")
    import vllm.model_executor.layers.sparse_attn_indexer  # noqa: F401  (registers the op)

    from pcppass.analysis import Uncovered, find_state_writes
    from pcppass.analysis.trace import StepInputs, capture_graph

    n = 8
    inputs = (torch.randn(n, 128), torch.zeros(n, 64, 128, dtype=torch.uint8), torch.randn(n, 128),
              torch.randn(n, 64))
    writes = find_state_writes(capture_graph(_Indexer(), StepInputs(inputs)))
    assert [(w.op, w.arg, w.state, w.reason) for w in writes] == [
        ("vllm::sparse_attn_indexer", "k_cache_prefix", "model.layers.0.self_attn.indexer.k_cache",
         Uncovered.REFUSED_OP)], writes
    assert "stores its K rows into the indexer cache" in writes[0].detail
    assert "topk_indices_buffer" not in (writes[0].state or "")
