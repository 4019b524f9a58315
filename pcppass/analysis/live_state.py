"""Every tensor a step could change: the state the dynamic audit watches.

State is not only what the step receives. vLLM's KV caches live in a per-step context the op looks
up by layer name; a model may keep a cache in a module-global dict, a plain attribute of a helper
object, or a closure. So besides the tensors reachable from the step's arguments and the model's
buffers and parameters (named by their path), every live tensor Python can see (``gc``) is
watched, named by what holds it (``module.CONTEXT['layer.0']``, ``Holder.cache``, ``closure of
f``). What cannot be watched is said, never silently skipped: tensors whose storage cannot be read,
state beyond a byte budget, and script objects (TorchBind) whose state lives in C++.
"""

from __future__ import annotations

import gc
import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from pcppass.analysis.trace import StepInputs

#: Default cap on the bytes of state snapshotted per step (every watched storage is copied).
DEFAULT_MAX_BYTES = 8 << 30


@dataclass
class Watched:
    """One storage the audit snapshots: a tensor viewing it (the largest found) and its name."""

    key: StorageWeakRef
    tensor: torch.Tensor
    name: str | None  # path from the step's arguments / the model; None: found among live tensors

    @property
    def nbytes(self) -> int:
        return self.tensor.untyped_storage().nbytes()

    def label(self) -> str:
        return self.name if self.name is not None else holder_name(self.tensor)


@dataclass
class WatchList:
    storages: list[Watched] = field(default_factory=list)
    #: why some state could not be watched (empty when everything Python can see is watched)
    blind_spots: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.storages)


# ------------------------------------------------------------------------------- named roots


def _walk(obj: object, path: str, out: list[tuple[str, torch.Tensor]], depth: int, seen: set[int]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        return
    if depth > 4 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{path}[{k!r}]", out, depth + 1, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out, depth + 1, seen)
    elif isinstance(obj, torch.nn.Module):
        return  # modules are covered through named_buffers / named_parameters
    elif hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            _walk(v, f"{path}.{k}", out, depth + 1, seen)


def named_roots(model: Any, inputs: StepInputs) -> list[tuple[str, torch.Tensor]]:
    """Tensors reachable from the step's arguments, and the model's buffers and parameters."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    try:
        target = model.forward if isinstance(model, torch.nn.Module) else model
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        names = []
    for i, a in enumerate(inputs.args):
        _walk(a, names[i] if i < len(names) else f"arg{i}", found, 0, seen)
    for k, v in inputs.kwargs.items():
        _walk(v, k, found, 0, seen)
    if isinstance(model, torch.nn.Module):
        found += [(f"buffer {n}", b) for n, b in model.named_buffers()]
        found += [(f"parameter {n}", p) for n, p in model.named_parameters()]
    return found


# ------------------------------------------------------------------------------- live tensors


#: The dense parts of a sparse tensor, by layout (their storages hold its bytes).
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def _plain_parts(t: torch.Tensor, name: str | None) -> list[tuple[str | None, torch.Tensor]]:
    """The dense tensors holding ``t``'s bytes: itself, a wrapper subclass's inner tensors (its
    own storage holds nothing), or a sparse tensor's indices and values."""
    if t.layout in _SPARSE_PARTS:
        return [(f"{name}.{part}()" if name is not None else None, getattr(t, part)())
                for part in _SPARSE_PARTS[t.layout]]
    if not is_traceable_wrapper_subclass(t):
        return [(name, t)]
    inner_names, _ = t.__tensor_flatten__()
    return [
        part for inner in inner_names
        for part in _plain_parts(getattr(t, inner), f"{name}.{inner}" if name is not None else None)
    ]


def _storage_key(t: torch.Tensor) -> StorageWeakRef | None:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def live_tensors(collect: bool = True) -> list[torch.Tensor]:
    """Every real tensor object alive in this process (fake and meta tensors excluded).

    ``collect`` first frees garbage (a dropped graph's example values is not state; a full
    collection costs a few hundred ms in a large process, so callers skip it where garbage is
    harmless).
    """
    if collect:
        gc.collect()
    objects = gc.get_objects()
    # type(o), not isinstance: proxies and objects with a __class__ property must not be asked
    tensor_types = {t for t in set(map(type, objects)) if issubclass(t, torch.Tensor)}
    tensors = [o for o in objects if type(o) in tensor_types]
    return [t for t in tensors if not is_fake(t) and t.device.type != "meta"]


def watch_list(model: Any, inputs: StepInputs, max_bytes: int = DEFAULT_MAX_BYTES,
               collect: bool = True) -> WatchList:
    """Every storage the step could change, named where a path reaches it; what cannot be watched.

    The step's row inputs (``inputs.dynamic``) are per-step data, not state: excluded. Garbage
    is collected first when ``collect`` (watching a garbage tensor costs only its snapshot).
    """
    row_inputs = {_storage_key(t) for t, _ in inputs.dynamic}
    by_key: dict[StorageWeakRef, Watched] = {}
    unreadable: list[str] = []
    candidates = named_roots(model, inputs) + [(None, t) for t in live_tensors(collect)]
    for name, tensor in candidates:
        for part_name, part in _plain_parts(tensor, name):
            key = _storage_key(part)
            if key is None:
                unreadable.append(part_name or f"{type(part).__qualname__} {tuple(part.shape)} {part.layout}")
            elif key not in row_inputs:
                _add(by_key, key, part, part_name)
    watch = WatchList()
    if unreadable:
        shown = ", ".join(dict.fromkeys(unreadable[:5]))
        watch.blind_spots.append(f"{len(unreadable)} live tensor(s) without a readable storage: {shown}")
    skipped: list[Watched] = []
    total = 0
    for w in sorted(by_key.values(), key=lambda w: (w.name is None, w.nbytes)):  # named first
        if total + w.nbytes > max_bytes:
            skipped.append(w)
            continue
        total += w.nbytes
        watch.storages.append(w)
    if skipped:
        watch.blind_spots.append(
            f"{len(skipped)} storage(s) of {sum(w.nbytes for w in skipped)} B beyond the {max_bytes} B "
            f"snapshot budget were not watched (e.g. {skipped[0].label()})")
    return watch


def _add(by_key: dict[StorageWeakRef, Watched], key: StorageWeakRef, tensor: torch.Tensor,
         name: str | None) -> None:
    """One entry per storage: named if any path names it, viewed through its largest tensor."""
    known = by_key.get(key)
    if known is None:
        by_key[key] = Watched(key, tensor, name)
        return
    if known.name is None:
        known.name = name
    if tensor.numel() > known.tensor.numel():
        known.tensor = tensor


# ------------------------------------------------------------------------------- names


def _module_named(namespace: dict) -> str | None:
    for name, module in list(sys.modules.items()):
        if getattr(module, "__dict__", None) is namespace:
            return name
    return None


def _key_in(container: object, value: object) -> object:
    if isinstance(container, dict):
        return next((k for k, v in container.items() if v is value), None)
    return next((i for i, v in enumerate(container) if v is value), None)


def _closure_owner(cell: types.CellType) -> str | None:
    for ref in gc.get_referrers(cell):
        if isinstance(ref, tuple):
            for fn in gc.get_referrers(ref):
                if isinstance(fn, types.FunctionType) and fn.__closure__ is ref:
                    return fn.__qualname__
    return None


def _instance_of(namespace: dict) -> object:
    """The object whose ``__dict__`` is ``namespace``, if any."""
    for ref in gc.get_referrers(namespace):
        if getattr(ref, "__dict__", None) is namespace:
            return ref
    return None


def _module_path(module: torch.nn.Module, depth: int = 32) -> str:
    """``Root.child.grandchild`` of a module, through its parents' ``_modules`` dicts: the name a
    reader finds in the model (``LlamaForCausalLM.model.layers.0.self_attn.attn``), where a class
    name alone would not tell one layer from the next."""
    for children in gc.get_referrers(module) if depth else ():
        if not isinstance(children, dict) or (key := _key_in(children, module)) is None:
            continue
        for namespace in gc.get_referrers(children):  # the parent's __dict__ holds its _modules
            if isinstance(namespace, dict) and namespace.get("_modules") is children:
                parent = _instance_of(namespace)
                if isinstance(parent, torch.nn.Module):
                    return f"{_module_path(parent, depth - 1)}.{key}"
    return type(module).__qualname__


def _owner_name(owner: object) -> str:
    return _module_path(owner) if isinstance(owner, torch.nn.Module) else type(owner).__qualname__


def _path_to(obj: object, ignore: tuple, depth: int = 3) -> str | None:
    """How Python reaches ``obj``: ``module.NAME[key]``, ``Class.attr``, ``closure of f``."""
    referrers = gc.get_referrers(obj)  # a module's globals first: the name a reader knows
    for ref in sorted(referrers, key=lambda r: not (isinstance(r, dict) and _module_named(r) is not None)):
        if any(ref is own for own in ignore) or isinstance(ref, types.FrameType):
            continue
        if isinstance(ref, (dict, list)):
            key = _key_in(ref, obj)
            if key is None:
                continue
            module = _module_named(ref) if isinstance(ref, dict) else None
            if module is not None:
                return f"{module}.{key}"
            owner = _instance_of(ref) if isinstance(ref, dict) else None
            if owner is not None:
                return f"{_owner_name(owner)}.{key}"
            outer = _path_to(ref, ignore, depth - 1) if depth else None
            if outer is not None:
                return f"{outer}[{key!r}]"
        elif isinstance(ref, types.CellType):
            owner = _closure_owner(ref)
            if owner is not None:
                return f"closure of {owner}"
        elif not isinstance(ref, (tuple, torch.Tensor, type)) and hasattr(ref, "__dict__"):
            attr = _key_in(vars(ref), obj)
            if attr is not None:
                return f"{_owner_name(ref)}.{attr}"
    return None


def holder_name(t: torch.Tensor, ignore: tuple = ()) -> str:
    """What holds a tensor no path from the step reaches: a module global, a dict, an attribute,
    a closure; else its shape and dtype. ``ignore``: the caller's own containers."""
    return _path_to(t, ignore) or f"live tensor {tuple(t.shape)} {t.dtype}"
