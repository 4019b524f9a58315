"""Run a vLLM model (vLLM's own model code, attention and KV-update ops) under :mod:`pcppass.engine`.

:class:`VllmModel` follows pcppass's model contract (``docs/MODEL_CONTRACT.md``) around a model
vLLM loaded: the engine allocates one cache per attention layer in the layout vLLM's attention
backend reads (``[num_blocks, heads, block_size, 2 * head_size]`` for ``CPU_ATTN``,
``[num_blocks, 1, block_size, 576]`` for MLA) and, for a hybrid model's recurrent layers, one raw
page per state line (``[lines, 1, 1, page bytes]``, in a cache group whose block covers a whole
request, so the block number is the request's state line), and every step

1. binds the engine's caches to the layers (``layer.kv_cache``, vLLM's own ``bind_kv_cache``),
2. builds each backend's metadata from the step's meta (vLLM's metadata builders, one per kind of
   layer, over its group's block table),
3. runs vLLM's model inside vLLM's forward context (``set_forward_context``, with the per-layer
   slot mappings), where ``vllm::unified_kv_cache_update`` finds the cache and the slots.

:class:`VllmRunner` compiles vLLM's model with the pcppass backend for decode steps (the deferred
schedule: the KV rows of every layer, resolved by layer name, in one all-gather per step), and
runs mixed steps (with prefill rows) replicated: every rank runs every row of a mixed step (see
:class:`ReplicatedMixedEngine`), because the CPU MLA backend attends a prefill over the step's own
activations, never over rows another rank wrote into the cache.

Process groups, one process per rank (:func:`init_vllm_ranks`): pcppass's PCP group is the
default gloo group of P ranks; vLLM is initialised on that same group with TP = PP = PCP = DCP = 1
per rank: ``init_distributed_environment`` reuses the default group as vLLM's world group and
``ensure_model_parallel_initialized(1, 1)`` makes the P ranks an outer data-parallel-like
dimension (each rank's TP/PP/PCP/DCP groups hold itself alone). vLLM's own collectives on the
world group go through its device communicator, which a CPU world group lacks; pcppass only uses
``torch.distributed`` on the default group, which works.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from pcppass.checks import SyncChecks
from pcppass.compiler import Inner, OnUncovered, PcpBackend
from pcppass.contract import (
    QUERY_START_LOC, SEQ_LENS, TOKEN_TO_REQ, CacheGroupSpec, CacheSpec, slot_key, table_key,
)
from pcppass.engine.runner import Engine
from pcppass.errors import PcpError
from pcppass.integrations.vllm.engine_args import cpu_engine_args
from pcppass.integrations.vllm.loaders import use_moe_dispatch_op
from pcppass.sync.stats import SYNC_COUNTERS
from pcppass.sharded import ShardedRunner, StepSync


#: the engine's cache group of the attention layers (one block table for all of them)
GROUP = "attn"
#: the engine's cache group of the state layers: one block per request, covering its whole length
#: (vLLM's ``mamba_cache_mode="none"``), whose number is the request's state line
STATE_GROUP = "state"


def init_vllm_ranks(vllm_config: Any, rank: int, world: int, *, timeout_s: float = 300.0) -> None:
    """vLLM's distributed state on the default gloo group of ``world`` ranks (initialised here
    from ``MASTER_ADDR``/``MASTER_PORT`` unless it already is), TP = PP = 1 per rank."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized, init_distributed_environment,
    )

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world, rank, "env://", local_rank=rank, backend="gloo")
        ensure_model_parallel_initialized(1, 1)


def vllm_config_for(model_dir: str, **engine_args: Any) -> Any:
    """vLLM's config for ``model_dir``: no tokenizer, float32, the reference CPU MLA backend
    (:mod:`.engine_args`), and vLLM's own compilation off
    (pcppass compiles) with vLLM's custom ops in their native torch form, as vLLM's own compile
    traces them (``custom_ops=["none"]``), unless ``engine_args`` say otherwise.

    Not ``enforce_eager=True``: that also switches vLLM's custom ops to their C++ CPU kernels,
    one of which makes DeepSeek-V2's results depend on the batch (the first request of a batch
    moves by ~1e-2 in its logits, checked against HF transformers), so a request's tokens would
    depend on which other requests share its step."""
    from vllm.config import CompilationMode
    from vllm.engine.arg_utils import EngineArgs

    args = cpu_engine_args(model_dir, compilation_config={"mode": CompilationMode.NONE, "custom_ops": ["none"]})
    args.update(engine_args)
    return EngineArgs(**args).create_engine_config()


def load_model(vllm_config: Any) -> nn.Module:
    """vLLM's model for ``vllm_config`` (weights from its model directory), on the CPU."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    # vLLM's CPU worker does the same: the loader calls torch.accelerator.empty_cache()
    _set_torch_accelerator_to_noop()
    with set_current_vllm_config(vllm_config):
        return get_model(vllm_config=vllm_config)


@dataclass(frozen=True)
class _Layer:
    name: str
    module: nn.Module
    spec: Any  # vLLM's KV cache spec of the layer
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    group: str = GROUP


def _state_layer(name: str, module: nn.Module, vllm_config: Any) -> _Layer:
    """A state layer's cache: one raw page per line, ``[lines, 1, 1, page bytes]`` int8, which
    vLLM's own ``MambaBase.bind_kv_cache`` unpacks into the layer's states."""
    from pcppass.integrations.vllm.state import check_state_layer

    check_state_layer(module, name)
    spec = module.get_kv_cache_spec(vllm_config)
    max_len = vllm_config.model_config.max_model_len
    if spec.block_size < max_len:
        raise PcpError(f"vLLM layer {name}: a state block of {spec.block_size} tokens, shorter than a request "
                       f"({max_len}): one state line per request needs mamba_cache_mode 'none'")
    return _Layer(name, module, spec, (1, 1, spec.page_size_bytes), torch.int8, STATE_GROUP)


def _use_cpu_state_update_kernels(vllm_config: Any, layers: list[_Layer]) -> None:
    """vLLM's Mamba selective-state-update backend, chosen as vLLM's worker chooses it when it
    allocates the caches (the CPU kernel on a CPU platform)."""
    from vllm.model_executor.layers.mamba.ops.ssu_dispatch import initialize_mamba_ssu_backend
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([layer.name], layer.spec) for layer in layers if layer.group == STATE_GROUP]
    if groups:
        initialize_mamba_ssu_backend(vllm_config.mamba_config, KVCacheConfig(0, [], groups),
                                     use_replayssm=vllm_config.cache_config.use_replayssm)


class VllmModel(nn.Module):
    """A vLLM model under pcppass's model contract (see the module docstring)."""

    def __init__(self, vllm_config: Any, model: nn.Module, *, moe_dispatch_op: bool = False) -> None:
        super().__init__()
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
        from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layer_kv_cache_shape_bytes

        from pcppass.integrations.vllm.state import is_state_layer

        self.vllm_config = vllm_config
        self.model = model
        layers = vllm_config.compilation_config.static_forward_context
        self._layers: list[_Layer] = []
        #: MoE layers: no cache; they run inside the step (the forward context finds them by name)
        self.moe_layers: list[str] = []
        for name, module in layers.items():
            if isinstance(module, MoERunner):
                self.moe_layers.append(name)
                if moe_dispatch_op:
                    use_moe_dispatch_op(module)
                continue
            if is_state_layer(module):
                self._layers.append(_state_layer(name, module, vllm_config))
                continue
            if not isinstance(module, (Attention, MLAAttention)):
                raise PcpError(f"vLLM layer {name} is a {type(module).__name__}: only full attention, "
                               "MLA, MoE and reviewed state layers run under pcppass.engine")
            spec = module.get_kv_cache_spec(vllm_config)
            if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None):
                raise PcpError(f"vLLM layer {name}: KV cache spec {type(spec).__name__} is not full attention")
            heads, block, width = compute_layer_kv_cache_shape_bytes(spec, 1)[1:]
            itemsize = torch.empty((), dtype=spec.dtype).element_size()
            self._layers.append(_Layer(name, module, spec, (heads, block, width // itemsize), spec.dtype))
        #: block size of each cache group present (attention layers, state layers)
        self.block_sizes: dict[str, int] = {}
        for group in (GROUP, STATE_GROUP):
            sizes = {layer.spec.block_size for layer in self._layers if layer.group == group}
            if len(sizes) > 1:
                raise PcpError(f"vLLM layers of group {group} use block sizes {sorted(sizes)}: one group needs one")
            if sizes:
                self.block_sizes[group] = sizes.pop()
        self.is_mla = any(isinstance(layer.module, MLAAttention) for layer in self._layers)
        #: state layers (one state line per request): prefix caching cannot share their blocks
        self.has_state = STATE_GROUP in self.block_sizes
        self._builders = self._metadata_builders()
        _use_cpu_state_update_kernels(vllm_config, self._layers)
        self._bound: dict[str, int] = {}

    def _metadata_builders(self) -> list[tuple[str, Any, list[str]]]:
        """``(group, builder, layer names)``: the attention layers share their backend's builder;
        state layers get one per builder class (each kind of state layer builds its own metadata)."""
        by_class: dict[type, list[_Layer]] = {}
        for layer in self._layers:
            backend = layer.module.attn_backend if layer.group == GROUP else layer.module.get_attn_backend()
            by_class.setdefault(backend.get_builder_cls(), []).append(layer)
        return [(members[0].group,
                 cls(members[0].spec, [layer.name for layer in members], self.vllm_config, torch.device("cpu")),
                 [layer.name for layer in members])
                for cls, members in by_class.items()]

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self._layers]

    @property
    def attention_layer_names(self) -> list[str]:
        return [layer.name for layer in self._layers if layer.group == GROUP]

    @property
    def block_size(self) -> int | None:
        """The attention layers' block size (None: a model without attention layers)."""
        return self.block_sizes.get(GROUP)

    # -- the model contract ------------------------------------------------------------------

    def cache_groups(self) -> list[CacheGroupSpec]:
        return [CacheGroupSpec(group, size) for group, size in self.block_sizes.items()]

    def cache_specs(self) -> list[CacheSpec]:
        return [CacheSpec(layer.name, layer.group, layer.block_shape, layer.dtype) for layer in self._layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: dict[str, torch.Tensor],
                caches: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step run eagerly (vLLM's model as it is)."""
        with self.step_context(meta, caches):
            return self.model(input_ids, positions)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_rows)

    # -- one step ----------------------------------------------------------------------------

    def bind(self, caches: dict[str, torch.Tensor]) -> None:
        """Bind the engine's caches to vLLM's layers (only when they changed)."""
        for layer in self._layers:
            cache = caches[layer.name]
            if self._bound.get(layer.name) != id(cache):
                layer.module.bind_kv_cache(cache)
                self._bound[layer.name] = id(cache)

    @contextlib.contextmanager
    def step_context(self, meta: dict[str, torch.Tensor], caches: dict[str, torch.Tensor]) -> Iterator[None]:
        """vLLM's config and forward context for one step of the engine."""
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        self.bind(caches)
        with set_current_vllm_config(self.vllm_config):
            per_layer: dict[str, Any] | None = {}
            for group, builder, names in self._builders:
                common = self.common_metadata(meta, group)
                if common is None:  # all padding: no metadata, the ops write nothing
                    per_layer = None
                    break
                metadata = builder.build(0, common)
                per_layer.update((name, metadata) for name in names)
            rows = int(meta[TOKEN_TO_REQ].shape[0])
            slots = {name: meta[slot_key(GROUP)] for name in self.attention_layer_names}
            with set_forward_context(per_layer, self.vllm_config, num_tokens=rows, slot_mapping=slots):
                yield

    def common_metadata(self, meta: dict[str, torch.Tensor], group: str = GROUP) -> Any:
        """vLLM's ``CommonAttentionMetadata`` of the step's real requests in ``group`` (None: all
        padding). A state group's block table holds each request's state line.

        The engine pads requests to the row count; padding requests (no rows) are dropped here,
        padding rows keep slot -1 (vLLM's kernels skip them) and lie past ``num_actual_tokens``.
        A request is prefilling when it has several rows or none before this step (a one-token
        chunk that continues a prompt counts as a decode, as vLLM's state builders treat it).
        """
        from vllm.v1.attention.backend import CommonAttentionMetadata

        seq_lens = meta[SEQ_LENS]
        num_reqs = int((seq_lens > 0).sum())
        if num_reqs == 0:
            return None
        qsl = meta[QUERY_START_LOC][: num_reqs + 1].to(torch.int32)
        seq = seq_lens[:num_reqs].to(torch.int32)
        query_lens = qsl[1:] - qsl[:-1]
        if self.is_mla and bool(((seq > query_lens) & (query_lens > 1)).any()):
            raise PcpError("vLLM's CPU MLA backend attends a prefill over the step's own rows only: "
                           "a prefill chunk with cached context (chunked prefill, prefix caching) "
                           "would miss it. Give the engine a token budget that fits every prompt "
                           "and disable prefix caching.")
        num_tokens = int(qsl[-1])
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=num_reqs,
            num_actual_tokens=num_tokens, max_query_len=int(query_lens.max()),
            max_seq_len=int(seq.max()),
            block_table_tensor=meta[table_key(group)][:num_reqs].to(torch.int32),
            slot_mapping=meta[slot_key(group)][:num_tokens],
            seq_lens_cpu_upper_bound=seq,
            is_prefilling=(query_lens > 1) | (seq == query_lens),
        )


class ReplicatedMixedEngine(Engine):
    """:class:`~pcppass.engine.runner.Engine` whose mixed steps run replicated: every rank runs
    every row of a step with prefill rows (so they write identical bytes and need no sync), and
    decode-only steps keep round-robin ownership (sharded)."""

    def plan(self, step):
        # the ownership policy of this step (the engine reads it when it lays the step out)
        self.policy = "replicated" if step.step_kind == "mixed" else "round_robin"
        return super().plan(step)


class VllmRunner:
    """``runner(input_ids, positions, meta, caches, step_kind) -> hidden`` for the engine.

    Decode steps run vLLM's model compiled with :class:`pcppass.compiler.PcpBackend` (deferred
    schedule); mixed steps, which the engine runs replicated, run it compiled by ``inner`` alone.
    ``on_uncovered``: ``"raise"``, or ``"unsafe_ignore"`` for negative controls (the engine shards
    decode whatever the backend decides, so ``"replicate"`` is refused).
    """

    def __init__(self, model: VllmModel, *, inner: Inner = "inductor", on_uncovered: OnUncovered = "raise",
                 group: dist.ProcessGroup | None = None, checks: SyncChecks = SyncChecks()) -> None:
        if on_uncovered == "replicate":
            raise ValueError("VllmRunner shards decode: on_uncovered must be 'raise' (or 'unsafe_ignore' "
                             "in a negative control); run a replicated engine to keep decode replicated")
        self.model = model
        # The engine pads every rank's rows to one count (pcppass.engine.layout): the per-step
        # row-count agreement would find nothing.
        checks = replace(checks, row_counts=False)
        # whole_step: compiled with fullgraph=True, so the graph is the whole step
        self.decode_backend = PcpBackend(group=group, schedule="deferred", inner=inner,
                                         on_uncovered=on_uncovered, checks=checks, name="decode",
                                         whole_step=True)
        self._graphs = {
            "decode": torch.compile(model.model, backend=self.decode_backend, fullgraph=True),
            "mixed": torch.compile(model.model, backend=inner, fullgraph=True),
        }
        self.step_syncs: list[StepSync] = []

    def __call__(self, input_ids, positions, meta, caches, step_kind: str) -> torch.Tensor:
        for t in (input_ids, positions):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        SYNC_COUNTERS.take()
        with self.model.step_context(meta, caches):
            # pcppass's own refusal (coverage, fingerprints) rather than Dynamo's wrapper
            hidden = ShardedRunner._run(self._graphs[step_kind], input_ids, positions)
        counts = SYNC_COUNTERS.take()
        self.step_syncs.append(StepSync(step_kind, int(input_ids.shape[0]), counts.collectives,
                                        counts.bytes_sent, counts.bytes_gathered))
        return hidden


def sharded_vllm_engine(model: VllmModel, runner: VllmRunner, *, world: int, rank: int,
                        group: dist.ProcessGroup | None = None, **config: Any) -> Engine:
    """An engine over ``model`` whose decode steps are sharded round-robin over ``world`` ranks
    through ``runner`` and whose mixed steps run replicated (:class:`ReplicatedMixedEngine`)."""
    # prefix caching is off for MLA on CPU (vLLM's CPU MLA backend) and for state layers (one
    # state line per request: a shared prefix block would share a request's state)
    config.setdefault("enable_prefix_caching", not (model.is_mla or model.has_state))
    return ReplicatedMixedEngine(model, world=world, rank=rank, group=group, policy="round_robin",
                                 partition_prefill=False, runner=runner, **config)
