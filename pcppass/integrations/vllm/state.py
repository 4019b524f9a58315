"""vLLM's recurrent-state layers: their state lines, their compile-time shapes, and a re-run of their
state update for other ranks' rows.

A state layer (vLLM's ``MambaBase``: Mamba2, LFM2's short convolution, Qwen3-Next's gated delta
net) keeps one state line per request. ``layer.kv_cache`` is a tuple of tensors
``[num_lines, *shape]`` (views into one page per line: vLLM's ``MambaBase.bind_kv_cache``), and the
layer's op finds its batch's lines in the layer's attention metadata (``attn_metadata[layer]``):

============================  ====================================  ==========================
op (``layer_name``: handle)    states (``layer.kv_cache``)            per-row inputs
============================  ====================================  ==========================
``vllm::mamba_mixer2``        conv ``[k-1, conv_dim]`` (or            ``projected_states``
(``MambaMixer2``)             ``[conv_dim, k-1]``), SSM               ``[T, inter + conv_dim +
                              ``[heads, head_dim, d_state]``          heads]``
``vllm::short_conv``          conv ``[L-1, dim]``                     ``hidden_states [T, dim]``
(``ShortConv``)
``vllm::cpu_gdn_attention_    conv ``[k-1, conv_dim]``, SSM           ``mixed_qkv [T, 2 key_dim
core`` (``QwenGatedDelta-     ``[v_heads, v_dim, k_dim]``             + value_dim]``, ``b``,
NetAttention``, CPU)                                                  ``a`` ``[T, v_heads]``
============================  ====================================  ==========================

Each writes ``output`` (a temporary) and, per decode token, every state of its request's line: the
convolution window shifted by one token, the SSM state advanced one step. Lines come from the
metadata: ``state_indices_tensor_d`` (decode requests, first) and ``state_indices_tensor_p``
(prefill requests) for Mamba2 and short conv, ``non_spec_state_indices_tensor`` with
``non_spec_query_start_loc`` for GDN; line 0 is vLLM's null block (padding).

:func:`resolve` returns each state as a row view ``[num_lines, 1, *shape]`` (``PagedRows``: row
``s`` is line ``s``) and ``state_lines``: per token of the step, the line its request's state ends
in (at the request's last token, -1 elsewhere). That is COPY_ROWS, exact for any kernel.
:func:`rerun` is the RERUN alternative: the layer's own metadata builder builds a decode-only batch
of the given lines, and the op runs on those rows' inputs with a scratch output. It is exact where
the kernel's update of a row does not depend on the other rows of its batch: verified bitwise on
vLLM's CPU kernels (:data:`VERIFIED_BATCH_INVARIANT`), never assumed elsewhere.

Refused (:class:`~.context.UnsupportedLayer`): another layer class or metadata builder than the
reviewed ones, prefix caching for state layers (``mamba_cache_mode`` ``"align"``: the runner copies
state blocks outside the graph and prefill checkpoints write several lines per request),
speculative decoding (several lines per request), ReplaySSM (ring buffers beside the states).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from pcppass.integrations.vllm.layers import UnsupportedLayer, layer_named
from pcppass.registry import HandleEffect

_LAYERS = "vllm.model_executor.layers.mamba"
_BACKENDS = "vllm.v1.attention.backends"
#: the name the patterns give the state-line slots role
LINES = "state_lines"
#: vLLM's null block (``vllm.v1.attention.backends.utils.NULL_BLOCK_ID``): padding, never a line
NULL_LINE = 0
#: the re-run batch's sequence length: a decode row with one earlier token (any value > 1 reads
#: as "has prior state" to the builders; the decode kernels do not read it)
RERUN_SEQ_LEN = 2


@dataclass(frozen=True)
class StateOp:
    """One reviewed state op: its layer and metadata builder (class paths), the names of the
    layer's states (``layer.kv_cache`` in order), its per-row inputs and the output a re-run
    discards (``scratch(layer, inputs, rows)`` allocates it)."""

    layer: str
    builder: str
    states: tuple[str, ...]
    inputs: tuple[str, ...]
    output: str
    scratch: Callable[[Any, Mapping[str, torch.Tensor], int], torch.Tensor]


def _mamba2_output(layer: Any, inputs: Mapping[str, torch.Tensor], rows: int) -> torch.Tensor:
    x = inputs["projected_states"]
    return x.new_empty((rows, layer.num_heads // layer.tp_size * layer.head_dim))


def _short_conv_output(layer: Any, inputs: Mapping[str, torch.Tensor], rows: int) -> torch.Tensor:
    x = inputs["hidden_states"]
    return x.new_empty((rows, *x.shape[1:]))


def _gdn_output(layer: Any, inputs: Mapping[str, torch.Tensor], rows: int) -> torch.Tensor:
    x = inputs["mixed_qkv"]
    return x.new_zeros((rows, layer.num_v_heads // layer.tp_size, layer.head_v_dim))


#: the state ops reviewed in vLLM 0.32 (``patterns/vllm_state.py`` covers them)
STATE_OPS: dict[str, StateOp] = {
    "vllm::mamba_mixer2": StateOp(
        f"{_LAYERS}.mamba_mixer2.MambaMixer2", f"{_BACKENDS}.mamba2_attn.Mamba2AttentionMetadataBuilder",
        ("conv_state", "ssm_state"), ("projected_states",), "output", _mamba2_output),
    "vllm::short_conv": StateOp(
        f"{_LAYERS}.short_conv.ShortConv", f"{_BACKENDS}.short_conv_attn.ShortConvAttentionMetadataBuilder",
        ("conv_state",), ("hidden_states",), "output", _short_conv_output),
    "vllm::cpu_gdn_attention_core": StateOp(
        f"{_LAYERS}.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention",
        f"{_BACKENDS}.gdn_attn.GDNAttentionMetadataBuilder",
        ("conv_state", "ssm_state"), ("mixed_qkv", "b", "a"), "core_attn_out", _gdn_output),
}

#: where a re-run of each op was verified to reproduce the owner's state bytes: the op's state
#: update run on a batch of rows and row by row gives the same bytes, on vLLM's real CPU kernels
#: at the tiny test widths and at production ones (:func:`kernel_path` names what ran). The test
#: is the evidence; any other kernel path (GPUs, other CPUs) copies rows. Not short_conv: its op
#: runs the layer's projections too (in_proj before the window, out_proj after), so a re-run
#: would repeat two GEMMs per row of every other rank, and the window's input comes out of a GEMM
#: whose invariance to the batch size at production widths nobody checked.
VERIFIED_BATCH_INVARIANT: dict[str, frozenset[str]] = {
    "vllm::mamba_mixer2": frozenset({"cpu x86 AVX512 avx512_bf16"}),
    "vllm::short_conv": frozenset(),
    "vllm::cpu_gdn_attention_core": frozenset({"cpu x86 AVX512 avx512_bf16"}),
}
#: the test that verifies :data:`VERIFIED_BATCH_INVARIANT` on the machine it runs on
BATCH_INVARIANCE_EVIDENCE = "tests/test_vllm_hybrid.py::test_state_updates_batch_invariance"


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _unsupported(message: str) -> Exception:
    return UnsupportedLayer(message)


def is_state_layer(layer: Any) -> bool:
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    return isinstance(layer, MambaBase)


def state_op_of(layer: Any, name: str) -> tuple[str, StateOp]:
    """The reviewed op of a state layer (its class, exactly: a subclass may update differently)."""
    path = class_path(type(layer))
    for op_name, op in STATE_OPS.items():
        if op.layer == path:
            return op_name, op
    raise _unsupported(f"{name} is a {path}: no reviewed state op updates it (reviewed layers: "
                       f"{', '.join(sorted(op.layer for op in STATE_OPS.values()))})")


def check_state_layer(layer: Any, name: str, op_name: str | None = None) -> StateOp:
    """The layer's reviewed :class:`StateOp` (for ``op_name`` when given), or raise saying why not."""
    found, op = state_op_of(layer, name)
    if op_name is not None and found != op_name:
        raise _unsupported(f"{name} is a {op.layer}, updated by {found}, not {op_name}")
    builder = layer.get_attn_backend().get_builder_cls()
    if class_path(builder) != op.builder:
        raise _unsupported(f"{name}: metadata builder {class_path(builder)} was never reviewed (reviewed: {op.builder})")
    mode = getattr(layer.cache_config, "mamba_cache_mode", "none")
    if mode != "none":
        raise _unsupported(f"{name}: mamba_cache_mode {mode!r} (prefix caching for state layers: the runner copies "
                           f"state blocks outside the graph and prefill checkpoints write several lines per "
                           f"request); run with enable_prefix_caching=False")
    if getattr(layer, "num_spec", 0):
        raise _unsupported(f"{name}: speculative decoding keeps {layer.num_spec + 1} state lines per request")
    if getattr(layer, "use_replayssm", False):
        raise _unsupported(f"{name}: ReplaySSM keeps ring buffers beside the states")
    shapes = list(layer.get_state_shape())
    if len(shapes) != len(op.states):
        raise _unsupported(f"{name}: {len(shapes)} states, the reviewed op writes {len(op.states)}")
    return op


# ---------------------------------------------------------------------------------------------
# The resolver's parts: states as row views, the lines of a step, the compile-time description
# ---------------------------------------------------------------------------------------------


def state_views(layer: Any, name: str, states: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """Each state as ``[num_lines, 1, *shape]``: one paged row per line."""
    op = check_state_layer(layer, name)
    return {role: state.unsqueeze(1) for role, state in zip(op.states, states)}


def _lines_at_last_tokens(query_start_loc: torch.Tensor, lines: torch.Tensor, tokens: int,
                          first_token: int = 0) -> torch.Tensor:
    """Per token, the line of the request whose last token it is (-1 elsewhere)."""
    out = torch.full((tokens,), -1, dtype=torch.int64)
    ends = query_start_loc.to(torch.int64).cpu()[1:1 + lines.numel()] - 1 + first_token
    out[ends] = lines.to(torch.int64).cpu()
    return out


def state_lines(metadata: Any) -> torch.Tensor:
    """Per token of the step, the state line its request's state ends in (-1 elsewhere and for
    vLLM's null block), from a state layer's attention metadata."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    if isinstance(metadata, GDNAttentionMetadata):
        if metadata.spec_sequence_masks is not None:
            raise _unsupported("speculative decoding rows in a gated delta net batch")
        tokens = metadata.num_actual_tokens
        count = metadata.num_decodes + metadata.num_prefills
        lines = _lines_at_last_tokens(metadata.non_spec_query_start_loc,
                                      metadata.non_spec_state_indices_tensor[:count], tokens)
    else:  # vLLM's BaseMambaAttentionMetadata: decode requests (one token each) first
        decodes, tokens = metadata.num_decodes, metadata.num_decode_tokens + metadata.num_prefill_tokens
        if metadata.num_decode_tokens != decodes:
            raise _unsupported("decode requests with several tokens (speculative decoding)")
        lines = torch.full((tokens,), -1, dtype=torch.int64)
        if decodes:
            lines[:decodes] = metadata.state_indices_tensor_d[:decodes, 0].to(torch.int64).cpu()
        if metadata.num_prefills:
            prefill = _lines_at_last_tokens(metadata.query_start_loc_p, metadata.state_indices_tensor_p,
                                            tokens, first_token=decodes)
            lines = torch.where(prefill >= 0, prefill, lines)
    lines[lines == NULL_LINE] = -1
    return lines


def resolve_state(layer: Any, name: str) -> dict[str, torch.Tensor]:
    """Run time: the state views and ``state_lines`` of the step (none before the states exist;
    no lines when the step has no metadata for the layer: the op wrote nothing)."""
    from vllm.forward_context import get_forward_context

    states = layer.kv_cache
    if not states or not isinstance(states[0], torch.Tensor) or states[0].numel() == 0:
        return {}
    out = state_views(layer, name, tuple(states))
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        raise _unsupported(f"{name}: micro-batched steps (a list of metadata)")
    found = metadata.get(name) if isinstance(metadata, dict) else None
    if found is not None:
        out[LINES] = state_lines(found).to(states[0].device)
    return out


def describe_state(layer: Any, name: str) -> dict[str, torch.Tensor]:
    """Compile time: one line of each state, as meta tensors of the run-time row views."""
    op = check_state_layer(layer, name)
    return {role: torch.empty((1, 1, *shape), dtype=dtype, device="meta")
            for role, shape, dtype in zip(op.states, layer.get_state_shape(), layer.get_state_dtype())}


# ---------------------------------------------------------------------------------------------
# Effect: writes every state of its rows' lines; a re-run is exact where verified
# ---------------------------------------------------------------------------------------------


def platform_path() -> str:
    """The platform, and on a CPU its architecture, ISA level and the features vLLM's CPU kernels
    choose their code by (AMX tiles; AVX-512 BF16: the gated delta net's convolution runs vLLM's
    C++ kernel with it, torch's without)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return f"{current_platform.device_type}"
    arch = current_platform.get_cpu_architecture().name.lower()
    parts = ["cpu", arch, torch.backends.cpu.get_cpu_capability()]
    if torch.cpu._is_amx_tile_supported():
        parts.append("amx")
    if torch.cpu._is_avx512_bf16_supported():
        parts.append("avx512_bf16")
    return " ".join(parts)


def kernel_path(op_name: str, layer: Any) -> str:
    """What runs the op's state update here: :func:`platform_path`, and for Mamba2 a selective
    state update backend other than the CPU's own (vLLM turns TRITON into CPU on a CPU)."""
    path = platform_path()
    if op_name == "vllm::mamba_mixer2":
        from vllm.config.mamba import MambaBackendEnum

        backend = layer.mamba_config.backend
        if backend not in (MambaBackendEnum.TRITON, MambaBackendEnum.CPU):
            path += f" ssu-{backend.value}"
    return path


def rerun_exact(op_name: str, layer: Any) -> str | None:
    """Why a re-run of ``op_name`` reproduces the owner's state bytes here; None where unverified."""
    path = kernel_path(op_name, layer)
    if path not in VERIFIED_BATCH_INVARIANT.get(op_name, frozenset()):
        return None
    return f"its state update on {path} was verified batch-invariant ({BATCH_INVARIANCE_EVIDENCE})"


def state_effect(op_name: str) -> Callable[[Any, str], HandleEffect]:
    """``effect`` of a state op: it writes every state of its rows' lines."""

    def decide(layer: Any, name: str) -> HandleEffect:
        if not is_state_layer(layer):
            raise _unsupported(f"{name} is a {type(layer).__name__}, not a vLLM state layer")
        op = check_state_layer(layer, name, op_name)
        _remember_config(name)
        return HandleEffect(True, f"{type(layer).__name__} writes its {' and '.join(op.states)} line of each "
                                  f"request", rerun_exact=rerun_exact(op_name, layer))

    return decide


# ---------------------------------------------------------------------------------------------
# The re-run: a decode-only batch of the given lines, through the layer's own builder and op
# ---------------------------------------------------------------------------------------------

#: the vLLM config each state layer was compiled under (a re-run builds its metadata with it when
#: no config is current)
_configs: dict[str, Any] = {}
#: layer name -> (the config it was built with, the builder)
_builders: dict[str, tuple[Any, Any]] = {}


def _remember_config(name: str) -> None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None:
        _configs[name] = config


def _config_for(name: str) -> Any:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none() or _configs.get(name)
    if config is None:
        raise _unsupported(f"{name}: no vLLM config to build a re-run's metadata with")
    return config


def builder_for(layer: Any, name: str, device: torch.device) -> Any:
    """The layer's own metadata builder (one per layer and config)."""
    config = _config_for(name)
    built = _builders.get(name)
    if built is None or built[0] is not config:
        spec = layer.get_kv_cache_spec(config)
        built = _builders[name] = (config, layer.get_attn_backend().get_builder_cls()(spec, [name], config, device))
    return built[1]


def decode_metadata(layer: Any, name: str, lines: torch.Tensor) -> Any:
    """The layer's metadata for a decode-only batch: one token per row, row ``i`` in line ``lines[i]``."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    rows = lines.numel()
    qsl = torch.arange(rows + 1, dtype=torch.int32)
    seq = torch.full((rows,), RERUN_SEQ_LEN, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=rows, num_actual_tokens=rows,
        max_query_len=1, max_seq_len=RERUN_SEQ_LEN, block_table_tensor=lines.to(torch.int32).cpu()[:, None],
        slot_mapping=torch.full((rows,), -1, dtype=torch.int64), seq_lens_cpu_upper_bound=seq,
        is_prefilling=torch.zeros(rows, dtype=torch.bool))
    device = layer.kv_cache[0].device
    return builder_for(layer, name, device).build(0, common)


@contextlib.contextmanager
def metadata_of(name: str, metadata: Any) -> Iterator[None]:
    """The current forward context with ``metadata`` for layer ``name`` (restored after)."""
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    saved = context.attn_metadata
    context.attn_metadata = {**(saved or {}), name: metadata}
    try:
        yield
    finally:
        context.attn_metadata = saved


def _handle_value(op_name: str, name: str) -> Any:
    """The layer name as the op's schema takes it (a string, or vLLM's ``LayerName``)."""
    from vllm.utils.torch_utils import _encode_layer_name

    packet = getattr(torch.ops.vllm, op_name.split("::", 1)[1])
    schema = packet.default._schema
    arg = next(a for a in schema.arguments if a.name == "layer_name")
    return name if str(arg.type) == "str" else _encode_layer_name(name)


def rerun(op_name: str, name: str, rows: Mapping[str, torch.Tensor], lines: torch.Tensor) -> None:
    """The ``"vllm"`` resolver's ``rerun``: run ``op_name``'s update of layer ``name`` for the rows
    whose line is >= 0, as one decode-only batch, every output discarded."""
    from pcppass.errors import PcpSyncError

    layer = layer_named(name)
    op = check_state_layer(layer, name, op_name)
    if tuple(sorted(rows)) != tuple(sorted(op.inputs)):
        raise PcpSyncError(f"re-run of {op_name} on {name}: inputs {sorted(rows)}, the op takes {list(op.inputs)}")
    keep = (lines >= 0).nonzero().flatten()
    picked = lines[keep]
    limit = layer.kv_cache[0].shape[0]
    if bool(((picked <= NULL_LINE) | (picked >= limit)).any()):
        raise PcpSyncError(f"re-run of {op_name} on {name}: state lines {picked.tolist()} outside "
                           f"(0, {limit})")
    inputs = {arg: rows[arg].index_select(0, keep.to(rows[arg].device)).contiguous() for arg in op.inputs}
    arguments = dict(inputs)
    arguments[op.output] = op.scratch(layer, inputs, picked.numel())
    arguments["layer_name"] = _handle_value(op_name, name)
    with metadata_of(name, decode_metadata(layer, name, picked)):
        getattr(torch.ops.vllm, op_name.split("::", 1)[1])(**arguments)
