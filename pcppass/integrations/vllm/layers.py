"""vLLM's registered layers by name, and the refusal of a layer whose cache layout is not known.

Below :mod:`.context`, :mod:`.state` and :mod:`.effects`, which all look layers up by name and
refuse the ones they cannot describe exactly; kept apart so those three import it, not each other.
"""

from __future__ import annotations

from typing import Any


class UnsupportedLayer(ValueError):
    """A layer whose KV cache layout the resolver does not know to be exact."""


def layer_named(name: str) -> Any:
    """The layer vLLM registered under ``name`` (attention, MoE, state layers), in the current
    forward context or, while vLLM compiles, its static forward context."""
    from vllm.config import get_current_vllm_config
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if is_forward_context_available():
        layers = get_forward_context().no_compile_layers
    else:
        layers = get_current_vllm_config().compilation_config.static_forward_context
    if name not in layers:
        raise KeyError(f"no vLLM layer named {name!r} in the current context")
    return layers[name]
