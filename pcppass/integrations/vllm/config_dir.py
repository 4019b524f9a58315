"""Model directories for ``pcppass audit --vllm``: config-only directories and shrunk depths.

A directory with no weight files (``config.json`` alone) loads with dummy weights
(:data:`~pcppass.integrations.vllm.loaders.DUMMY_FORMAT`): the graph vLLM compiles depends on the
architecture and its widths, not on the weights' values.

:func:`shrink_config` cuts a config to its first ``N`` layers, consistently: ``num_hidden_layers``
and every per-layer field the config carries (``layer_types``, ``hybrid_override_pattern``,
``layers_block_type``, ``attn_type_list``, ``no_rope_layers``, per-layer lists such as a list
``intermediate_size``, and the index lists ``mlp_only_layers``, ``full_attn_idxs``, ...). Fields
that place layers by period (``full_attention_interval``, ``sliding_window_pattern``,
``decoder_sparse_step``, ``first_k_dense_replace``, ``moe_layer_freq``, ``interleave_moe_layer_step``,
a layer index modulo 2 in vLLM's gpt-oss) stay valid for a prefix of the layers, and only for a
prefix: vLLM's model code decides many kinds from the layer index itself. So the kept layers are a
prefix, long enough to hold one layer of every kind the full model has (:func:`layer_kinds`); a
shorter ``N`` is raised to that length, and the result says so.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: files that hold weights (a directory without any loads with dummy weights)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
#: keys that hold the depth
DEPTH_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
#: per-layer fields: one entry (list item or character) per layer
PER_LAYER_KEYS = ("layer_types", "hybrid_override_pattern", "layers_block_type", "attn_type_list",
                  "no_rope_layers", "layers_num_experts", "block_types")
#: widths some heterogeneous configs give per layer (as a list of the depth's length)
PER_LAYER_WIDTH_KEYS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                        "sliding_window", "block_configs", "rope_theta")
#: fields listing layer indices
INDEX_KEYS = ("mlp_only_layers", "full_attn_idxs", "attn_layer_indices", "moe_layers",
              "sliding_window_layers", "swa_layers", "global_attn_layers")
#: nested text configs of multimodal models (their language model is what decodes)
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
#: NemotronH's block characters
NEMOTRON_BLOCKS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


class ConfigDirError(ValueError):
    """The directory cannot be audited as given (no config.json, an unusable depth)."""


def has_weights(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds weight files (else it is audited with dummy weights)."""
    return any(p.suffix in WEIGHT_SUFFIXES for p in Path(model_dir).iterdir() if p.is_file())


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigDirError(f"{model_dir}: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigDirError(f"{path}: not JSON ({exc})") from exc


def architectures(config: dict[str, Any]) -> list[str]:
    return list(config.get("architectures") or [])


def _text(config: Any) -> Any:
    for key in TEXT_CONFIG_KEYS:
        sub = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if sub is not None and _get(sub, "num_hidden_layers") is not None:
            return sub
    return config


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def depth(config: Any) -> int:
    """The number of decoder layers of a config (a dict, or a parsed ``PretrainedConfig``)."""
    text = _text(config)
    pattern = _get(text, "hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return len(pattern)
    for key in DEPTH_KEYS:
        value = _get(text, key)
        if isinstance(value, int):
            return value
    raise ConfigDirError("the config names no depth (num_hidden_layers)")


def _mixer(text: Any, i: int) -> str:
    pattern = _get(text, "hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return NEMOTRON_BLOCKS.get(pattern[i], f"block {pattern[i]!r}")
    for key in ("layer_types", "layers_block_type", "block_types"):
        types = _get(text, key)
        if isinstance(types, (list, tuple)) and len(types) > i:
            kind = str(types[i])
            break
    else:
        kinds = _get(text, "attn_type_list")  # MiniMax: 0 linear, 1 softmax attention
        kind = "attention"
        if isinstance(kinds, (list, tuple)) and kinds[i] == 0:
            kind = "linear_attention"
    nope = _get(text, "no_rope_layers")
    if isinstance(nope, (list, tuple)) and len(nope) > i and nope[i] == 0:
        kind += " (no rope)"
    return kind


def _experts(text: Any) -> int:
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        value = _get(text, key)
        if isinstance(value, int):
            return value
    return 0


def _ffn(text: Any, i: int) -> str | None:
    """"moe" or "dense" for layer ``i`` as vLLM's model code places them; None when the layer kind
    already says (NemotronH's blocks)."""
    if isinstance(_get(text, "hybrid_override_pattern"), str):
        return None
    experts = _experts(text)
    if experts <= 1 and not isinstance(_get(text, "layers_num_experts"), (list, tuple)):
        return "dense"
    per_layer = _get(text, "layers_num_experts")  # Jamba
    if isinstance(per_layer, (list, tuple)):
        return "moe" if per_layer[i] > 1 else "dense"
    dense_first = _get(text, "num_dense_layers")  # LFM2-MoE
    if isinstance(dense_first, int):
        return "dense" if i < dense_first else "moe"
    first_dense = _get(text, "first_k_dense_replace")  # DeepSeek-V2/V3, Kimi, GLM-4.5 ...
    if isinstance(first_dense, int):
        freq = _get(text, "moe_layer_freq", 1) or 1
        return "moe" if i >= first_dense and i % freq == 0 else "dense"
    step = _get(text, "decoder_sparse_step")  # Qwen2/3-MoE, Qwen3-Next
    if isinstance(step, int):
        only_mlp = _get(text, "mlp_only_layers") or []
        return "moe" if i not in only_mlp and step > 0 and (i + 1) % step == 0 else "dense"
    interleave = _get(text, "interleave_moe_layer_step")  # Llama 4
    if isinstance(interleave, int):
        return "moe" if interleave > 0 and (i + 1) % interleave == 0 else "dense"
    return "moe"


def layer_kinds(config: Any) -> list[str]:
    """One kind per layer: the mixer (``layer_types`` entry, NemotronH block, ...) and, where
    layers differ in it, ``moe`` or ``dense`` (read from a dict or a parsed config)."""
    text = _text(config)
    kinds = []
    for i in range(depth(config)):
        ffn = _ffn(text, i)
        kinds.append(_mixer(text, i) + (f" + {ffn}" if ffn else ""))
    return kinds


def parsed_layer_kinds(model_dir: str | Path) -> list[str]:
    """:func:`layer_kinds` of the config as vLLM parses it (fields transformers derives included)."""
    from vllm.transformers_utils.config import get_config

    return layer_kinds(get_config(str(model_dir), trust_remote_code=False))


def minimal_prefix(kinds: list[str]) -> int:
    """The shortest prefix holding one layer of every kind."""
    seen: set[str] = set()
    needed = set(kinds)
    for n, kind in enumerate(kinds, start=1):
        seen.add(kind)
        if seen == needed:
            return n
    return len(kinds)


@dataclass
class Shrink:
    """What :func:`shrink_config` did."""

    layers: int  # the depth kept
    original_layers: int
    requested: int  # the depth asked for (raised to ``layers`` when it would drop a kind)
    kinds_full: dict[str, int]  # kind -> layers of the full model
    kinds_kept: dict[str, int]  # kind -> layers kept
    keys: list[str] = field(default_factory=list)  # the config fields changed

    @property
    def raised(self) -> bool:
        return self.layers > self.requested

    def summary(self) -> str:
        kept = ", ".join(f"{kind} x{n}" for kind, n in self.kinds_kept.items())
        line = f"layers {self.layers} of {self.original_layers} (kept: {kept}; fields: {', '.join(self.keys)})"
        if self.raised:
            line += f"; raised from {self.requested} to keep one layer of every kind"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "original_layers": self.original_layers, "requested": self.requested,
                "kinds_full": self.kinds_full, "kinds_kept": self.kinds_kept, "fields": self.keys}


def _shrink_text(text: dict[str, Any], full: int, keep: int) -> list[str]:
    """Cut one (text) config dict to its first ``keep`` layers in place; the keys changed."""
    before = dict(text)
    for key in DEPTH_KEYS:
        if isinstance(text.get(key), int):
            text[key] = keep
    for key, value in before.items():
        if key in INDEX_KEYS and isinstance(value, list):
            text[key] = [i for i in value if isinstance(i, int) and i < keep]
        elif key in PER_LAYER_KEYS + PER_LAYER_WIDTH_KEYS and isinstance(value, (list, str)) \
                and len(value) == full:
            text[key] = value[:keep]
    return [key for key in text if text[key] != before.get(key)]


def shrink_config(config: dict[str, Any], layers: int,
                  kinds: list[str] | None = None) -> tuple[dict[str, Any], Shrink]:
    """A copy of ``config`` (a ``config.json`` dict) cut to its first ``layers`` layers (or the
    shortest prefix holding every kind, if longer), and what was done (see the module docstring).

    ``kinds``: the full model's :func:`layer_kinds`, read from the parsed config (where
    transformers derives ``layer_types`` from periodic fields a ``config.json`` may leave out);
    by default read from ``config`` itself."""
    if layers < 1:
        raise ConfigDirError(f"--layers must be at least 1, got {layers}")
    config = json.loads(json.dumps(config))
    full = depth(config)
    kinds = layer_kinds(config) if kinds is None else kinds
    if len(kinds) != full:
        raise ConfigDirError(f"{len(kinds)} layer kinds for a depth of {full}")
    keep = min(full, max(layers, minimal_prefix(kinds)))
    text = _text(config)
    changed = _shrink_text(text, full, keep)
    prefix = "" if text is config else next(k for k in TEXT_CONFIG_KEYS if config.get(k) is text) + "."
    shrink = Shrink(layers=keep, original_layers=full, requested=layers,
                    kinds_full=dict(Counter(kinds)), kinds_kept=dict(Counter(kinds[:keep])),
                    keys=[prefix + key for key in changed])
    return config, shrink


def write_config_dir(config: dict[str, Any], directory: str | Path) -> Path:
    """A model directory holding only ``config.json`` (audited with dummy weights)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
