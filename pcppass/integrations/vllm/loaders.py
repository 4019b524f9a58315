"""vLLM load formats for audits: quick dummy weights, and the GPU path's MoE dispatch on the CPU.

Registered with vLLM's own ``register_model_loader`` when this module is imported:

* ``"pcppass_dummy"``: vLLM's ``dummy`` format (no weight files: a directory holding only
  ``config.json`` loads), each floating-point weight filled from one repeating tile of random values
  in vLLM's dummy range instead of one random draw per weight. vLLM's own fill draws ~60 M values
  a second on one core (25 s for Llama-3.1-8B's two vocabulary matrices); the tile is copied at
  memory speed. The graph vLLM compiles does not depend on the weights' values.
* ``"pcppass_auto"``: vLLM's default loader (the directory's weight files).

Both take ``model_loader_extra_config={"moe_dispatch": "op"}``: after the model is built and loaded
(before vLLM warms it up, which is when it compiles) every ``MoERunner`` is switched to the dispatch
vLLM selects on CUDA, ROCm and XPU, the opaque ``vllm::moe_forward`` / ``vllm::moe_forward_shared``
ops that fetch the layer by name, instead of the CPU's direct call (which Dynamo traces into
``_C.cpu_fused_moe``). Both dispatches run the same ``MoERunner._forward_impl``, so the tokens do
not change; the graph then holds the ops a GPU graph holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

#: ``load_format`` of a directory without weight files (``config.json`` alone)
DUMMY_FORMAT = "pcppass_dummy"
#: ``load_format`` of a directory with weights, when a load option is asked for
AUTO_FORMAT = "pcppass_auto"
#: ``model_loader_extra_config`` keys this module's loaders read (vLLM's loaders refuse unknown keys)
MOE_DISPATCH = "moe_dispatch"
MOE_DISPATCHES = ("auto", "op")

#: vLLM's dummy weight range and seed (``initialize_single_dummy_weight``)
_LOW, _HIGH, _SEED = -1e-3, 1e-3, 1234
#: the tile length: odd, so consecutive rows of a matrix see different shifts of the tile
_TILE = 4093


def _tile(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_SEED)
    values = torch.empty(_TILE, dtype=torch.float32).uniform_(_LOW, _HIGH, generator=generator)
    return values.to(device=device, dtype=dtype)


def fill_dummy(param: torch.Tensor, tiles: dict) -> None:
    """Fill one floating-point weight from the repeating tile (in place, any size)."""
    from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

    if (param.device.type == "meta" or not torch.is_floating_point(param) or not param.is_contiguous()
            or getattr(param, "dummy_weight_value", None) is not None or torch.finfo(param.dtype).bits < 16):
        initialize_single_dummy_weight(param)  # vLLM's own handling of these cases
        return
    key = (param.dtype, param.device)
    if key not in tiles:
        tiles[key] = _tile(*key)
    tile = tiles[key]
    flat = param.data.view(-1)
    whole = flat.numel() // _TILE
    with torch.no_grad():
        flat[: whole * _TILE].view(whole, _TILE).copy_(tile.expand(whole, _TILE))
        rest = flat.numel() - whole * _TILE
        if rest:
            flat[whole * _TILE:].copy_(tile[:rest])


def use_moe_dispatch_op(layer: nn.Module) -> None:
    """Run one ``MoERunner`` through ``vllm::moe_forward`` (``moe_forward_shared`` with shared
    experts), as ``MoERunner._select_forward`` does off the CPU."""
    shared = layer.shared_experts is not None
    layer._forward_entry = torch.ops.vllm.moe_forward_shared if shared else torch.ops.vllm.moe_forward


def force_moe_op_dispatch(model: nn.Module) -> int:
    """Switch every ``MoERunner`` of ``model`` to the dispatch op; returns how many."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runners = [module for module in model.modules() if isinstance(module, MoERunner)]
    for runner in runners:
        use_moe_dispatch_op(runner)
    return len(runners)


def _split_options(load_config: Any, **changes: Any) -> tuple[Any, str]:
    """The load config without this module's keys (vLLM's loaders check theirs) and with
    ``changes``, and the dispatch."""
    extra = dict(load_config.model_loader_extra_config or {})
    dispatch = extra.pop(MOE_DISPATCH, "auto")
    if dispatch not in MOE_DISPATCHES:
        raise ValueError(f"{MOE_DISPATCH} must be one of {', '.join(MOE_DISPATCHES)}, got {dispatch!r}")
    return dataclasses.replace(load_config, model_loader_extra_config=extra, **changes), dispatch


def _after_load(model: nn.Module, dispatch: str) -> nn.Module:
    if dispatch == "op":
        force_moe_op_dispatch(model)
    return model


_registered = False


def register_loaders() -> None:
    """Register :data:`DUMMY_FORMAT` and :data:`AUTO_FORMAT` with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm.model_executor.model_loader import DefaultModelLoader, DummyModelLoader, register_model_loader
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    @register_model_loader(DUMMY_FORMAT)
    class TiledDummyLoader(DummyModelLoader):
        """vLLM's dummy loader, weights filled from a repeating tile (see the module docstring)."""

        def __init__(self, load_config: Any) -> None:
            load_config, self.moe_dispatch = _split_options(load_config)
            super().__init__(load_config)

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            tiles: dict = {}
            for layer in model.modules():  # DummyModelLoader.load_weights, another fill
                info = get_layerwise_info(layer)
                if info.can_load():
                    self._process_online_quant_layer(layer, info)
                    continue
                for name, tensor in get_layer_tensors(layer).items():
                    if name not in layer._non_persistent_buffers_set:
                        fill_dummy(tensor, tiles)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            return _after_load(super().load_model(vllm_config, model_config, prefix), self.moe_dispatch)

    @register_model_loader(AUTO_FORMAT)
    class DispatchLoader(DefaultModelLoader):
        """vLLM's default loader, with :data:`MOE_DISPATCH` applied after loading."""

        def __init__(self, load_config: Any) -> None:
            # the default loader picks the weight files by its own format names
            load_config, self.moe_dispatch = _split_options(load_config, load_format="auto")
            super().__init__(load_config)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            return _after_load(super().load_model(vllm_config, model_config, prefix), self.moe_dispatch)
