"""vLLM's MoE and collective ops: reviewed declarations that they write nothing that outlives a step.

Each takes a string or a layer name that the analysis must treat as a handle (it could name state),
so each is reported uncovered unless a reviewed declaration says what it does there:

``vllm::moe_forward`` / ``vllm::moe_forward_shared`` (every MoE model on CUDA, ROCm and XPU; on the
CPU vLLM traces the MoE inline)::

    moe_forward(Tensor(a0!) hidden_states, Tensor router_logits, Tensor? shared_experts_input,
                Tensor? input_ids, PyObject layer_name, SymInt hidden_dim_unpadded) -> Tensor
    moe_forward_shared(...) -> (Tensor, Tensor)

They fetch the layer's ``MoERunner`` by name and run routing, the experts and the shared experts,
writing only their outputs (and ``hidden_states``, a temporary of the step). The ``"vllm"``
resolver confirms it per layer: a layer recording EPLB expert loads, a routing replay buffer or a
routed-expert capture writes per-rank state on every step and is refused
(:func:`pcppass.integrations.vllm.effects.moe_effect`).

vLLM's collectives take the process group's name, never a piece of state, and return new tensors::

    all_reduce(Tensor tensor, str group_name) -> Tensor
    all_gather(Tensor tensor, SymInt dim, SymInt world_size, str group_name) -> Tensor
    reduce_scatter(Tensor tensor, SymInt dim, SymInt world_size, str group_name) -> Tensor

``vllm::sparse_attn_indexer`` (DeepSeek-V3.2's indexer off CUDA) is refused by name: it writes the
indexer K cache without declaring it (see :data:`SPARSE_ATTN_INDEXER`).

Reviewed against vLLM 0.32's source; with another vLLM installed they no longer apply.
"""

from pcppass.registry import register_pattern, register_refusal
from pcppass.spec import Recipe, Refusal, Reviewed, WritePattern

#: the vLLM releases these declarations were reviewed in (pcppass.integrations.vllm.effects)
VLLM_RELEASES = ">=0.32.0,<0.33"

MOE_FORWARD = register_pattern(WritePattern(
    name="vllm.moe_forward",
    ops=("vllm::moe_forward", "vllm::moe_forward_shared"),
    caches=(),
    reads=("layer_name",),
    resolver="vllm",
    recipe=Recipe.READ_ONLY,
    reviewed=Reviewed(
        "model_executor/layers/fused_moe/runner/moe_runner.py: _moe_forward(_shared) -> "
        "MoERunner._forward_impl (router.select_experts, routed and shared experts); the router "
        "writes state only with EPLB, routing replay or capture, which the resolver refuses",
        evidence="tests/test_vllm_moe.py::test_moe_models_sharded_on_vllms_gpu_dispatch",
        package="vllm", versions=VLLM_RELEASES),
    doc="an MoE layer fetched by name: routing and experts, only outputs written",
))

COLLECTIVES = register_pattern(WritePattern(
    name="vllm.collectives",
    ops=("vllm::all_reduce", "vllm::all_gather", "vllm::reduce_scatter"),
    caches=(),
    reads=("group_name",),
    recipe=Recipe.READ_ONLY,
    reviewed=Reviewed(
        "distributed/parallel_state.py: all_reduce / all_gather / reduce_scatter look the group up by "
        "name and return a new tensor",
        evidence="tests/test_vllm_moe.py::test_vllm_collectives_are_declared_write_free",
        package="vllm", versions=VLLM_RELEASES),
    doc="a collective over the named process group: returns a new tensor, writes no state",
))

SPARSE_ATTN_INDEXER = register_refusal(Refusal(
    "vllm.sparse_attn_indexer",
    ops=("vllm::sparse_attn_indexer",),
    why=("DeepSeek-V3.2's indexer stores its K rows into the indexer cache it takes as `kv_cache` "
         "(indexer_k_quant_and_cache at the slot mapping of the layer named by k_cache_prefix) without "
         "declaring the write; `topk_indices_buffer`, which it declares, is per-step scratch. No pattern "
         "covers it: vLLM 0.32 runs sparse attention on no CPU platform, so no real graph here backs one"),
    reviewed=Reviewed(
        "model_executor/layers/sparse_attn_indexer.py: sparse_attn_indexer (mutates_args "
        "topk_indices_buffer, candidate_blocks; ops.indexer_k_quant_and_cache(k, kv_cache, ...))",
        evidence="tests/test_vllm_moe.py::test_sparse_attn_indexer_is_refused_by_name",
        package="vllm", versions=VLLM_RELEASES),
))
