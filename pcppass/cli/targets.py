"""What ``pcppass audit MODEL`` audits: a built-in model by name, or ``module:factory``.

Here, above the analysis, because it builds the reference models (:mod:`pcppass.models`, which
attend through the engine's kernels); the analysis itself takes any model and its step inputs.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from pcppass.analysis.trace import StepInputs, TraceError, contract_step_inputs, follows_model_contract
from pcppass.models import MODEL_NAMES, build_model, model_config


def build_builtin(name: str, size: str, device: torch.device | str, **overrides: Any) -> torch.nn.Module:
    """A built-in model; on ``meta`` its weights are never materialised (full widths, 61 layers)."""
    if name not in MODEL_NAMES:
        raise TraceError(f"unknown model {name!r}: use one of {', '.join(MODEL_NAMES)} or module:factory")
    if torch.device(device).type != "meta":
        return build_model(name, size, device=device, **overrides)
    cfg = model_config(name, size, **overrides)
    module = importlib.import_module(type(cfg).__module__)
    model_cls = getattr(module, type(cfg).__name__.replace("Config", "Model"))
    with torch.device("meta"):
        return model_cls(cfg)


def load_target(
    spec: str, size: str = "tiny", *, device: torch.device | str = "cpu", num_rows: int = 6,
    **overrides: Any,
) -> tuple[Callable[..., Any], StepInputs]:
    """``name`` (built-in model) or ``module:factory`` -> (model, one step's inputs).

    A factory returns ``(model, StepInputs)``, ``(model, args)`` or ``(model, args, kwargs)``;
    a bare model that follows the contract gets :func:`contract_step_inputs`. ``overrides`` go to
    a built-in model's config (e.g. ``num_layers=61``).
    """
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise TraceError(f"cannot load factory {spec!r}: {exc}") from exc
        made = factory()
    else:
        made = build_builtin(spec, size, device, **overrides)
    if isinstance(made, torch.nn.Module):
        if not follows_model_contract(made):
            raise TraceError(f"{spec}: a bare module must follow the model contract "
                             f"(cache_groups, cache_specs); return (model, args) instead")
        return made, contract_step_inputs(made, num_rows, device)
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise TraceError(f"{spec} must return (model, StepInputs), (model, args) or (model, args, kwargs)")
    model, rest = made[0], made[1:]
    if isinstance(rest[0], StepInputs):
        return model, rest[0]
    args = rest[0] if isinstance(rest[0], tuple) else (rest[0],)
    return model, StepInputs(args, rest[1] if len(rest) > 1 else {})
