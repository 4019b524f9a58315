"""vLLM's recurrent-state ops: one state line per request, fetched by layer name, two recipes.

vLLM (0.32) updates the state of its hybrid models' recurrent layers through ops that take the
layer name and find the layer's states (``layer.kv_cache``) and its batch's state lines (the
layer's attention metadata) in the forward context; they declare a write of their output only::

    vllm::mamba_mixer2(Tensor projected_states, Tensor(a!) output, PyObject layer_name) -> ()
    vllm::short_conv(Tensor hidden_states, Tensor(a!) output, str layer_name) -> ()
    vllm::cpu_gdn_attention_core(Tensor mixed_qkv, Tensor b, Tensor a, Tensor(a!) core_attn_out,
                                 PyObject layer_name) -> ()

Per decode token each writes every state of its request's line (Mamba2: the convolution window
and the SSM state; short conv: the window; gated delta net: the window and the delta-rule state).
Two recipes, chosen per layer by bytes per row (:mod:`pcppass.analysis.recipes`):

* COPY_ROWS of the owner's new state lines (the ``"vllm"`` resolver returns each state as row views
  indexed by state line, and the step's ``state_lines``): exact for any kernel;
* RERUN: the op's per-row inputs (``row_args``) travel in the step's one collective and every other
  rank re-runs the update for the other ranks' rows through the resolver's ``rerun`` hook, chosen
  only where the resolver says the kernel was verified batch-invariant
  (:data:`pcppass.integrations.vllm.state.VERIFIED_BATCH_INVARIANT`) and it moves fewer bytes.

Without ``pcppass.integrations.vllm`` imported these ops stay uncovered. Reviewed against vLLM
0.32's source: with another vLLM installed they are reported uncovered until reviewed again.
"""

from pcppass.registry import register_pattern
from pcppass.spec import ContextCache, Recipe, Reviewed, WritePattern

RESOLVER = "vllm"
VLLM_RELEASES = ">=0.32.0,<0.33"
#: the resolver's role of each row's state line
LINES = "state_lines"
EVIDENCE = "tests/test_vllm_hybrid.py::test_hybrids_sharded_two_ranks"


def _states(*names: str) -> tuple[ContextCache, ...]:
    return tuple(ContextCache("layer_name", cache=name, slots=LINES) for name in names)


def _vllm(source: str) -> Reviewed:
    return Reviewed(source=source, evidence=EVIDENCE, package="vllm", versions=VLLM_RELEASES)


MAMBA_MIXER2 = register_pattern(WritePattern(
    name="vllm.mamba_mixer2",
    ops=("vllm::mamba_mixer2",),
    caches=(),
    context=_states("conv_state", "ssm_state"),
    resolver=RESOLVER,
    row_args={"projected_states": 0},
    recipe=Recipe.COPY_ROWS,
    alternatives=(Recipe.RERUN,),
    reviewed=_vllm("model_executor/layers/mamba/mamba_mixer2.py: conv_ssm_forward -> causal_conv1d_update "
                   "and selective_state_update at state_indices_tensor_d (decode), causal_conv1d_fn and "
                   "ssm_state[state_indices_tensor_p] = final_states (prefill)"),
    doc="Mamba2 conv and SSM state line of each request, by layer name",
))

SHORT_CONV = register_pattern(WritePattern(
    name="vllm.short_conv",
    ops=("vllm::short_conv",),
    caches=(),
    context=_states("conv_state"),
    resolver=RESOLVER,
    row_args={"hidden_states": 0},
    recipe=Recipe.COPY_ROWS,
    alternatives=(Recipe.RERUN,),
    reviewed=Reviewed(source="model_executor/layers/mamba/short_conv.py: forward_native -> "
                             "causal_conv1d_update_cpu at state_indices_tensor_d (decode), "
                             "causal_conv1d_fn_cpu at state_indices_tensor_p",
                      evidence="tests/test_vllm_hybrid.py::test_state_updates_batch_invariance",
                      package="vllm", versions=VLLM_RELEASES),
    doc="LFM2 short-convolution window line of each request, by layer name",
))

CPU_GDN_ATTENTION_CORE = register_pattern(WritePattern(
    name="vllm.cpu_gdn_attention_core",
    ops=("vllm::cpu_gdn_attention_core",),
    caches=(),
    context=_states("conv_state", "ssm_state"),
    resolver=RESOLVER,
    row_args={"mixed_qkv": 0, "b": 0, "a": 0},
    recipe=Recipe.COPY_ROWS,
    alternatives=(Recipe.RERUN,),
    reviewed=_vllm("model_executor/layers/mamba/ops/cpu/gdn_attention.py: _cpu_gdn_attention_nonspec -> "
                   "causal_conv1d_update and fused_sigmoid_gating_delta_rule_update_cpu at "
                   "non_spec_state_indices_tensor (decode), chunk_gated_delta_rule_cpu (prefill)"),
    doc="Qwen3-Next gated delta net conv and recurrent state line of each request (CPU), by layer name",
))
