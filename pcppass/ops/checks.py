"""Input validation shared by the cache-write ops.

Every op validates all of its arguments before it writes a single byte, so a rejected call leaves
every cache untouched. Two kinds of checks:

* structural checks (dtypes, ranks, sizes, string options): run in the real implementation AND in
  the fake implementation, so a bad call fails while torch.compile traces it. Sizes may be
  symbolic there: a size mismatch is reported only when it is statically known
  (:func:`statically_known_true`), never by guarding on a symbol.
* value checks (slots in range, no duplicate slots, positions in range): data-dependent, so they run
  in the real implementation only. They read the device on the host, so they are skipped while a
  CUDA graph is being captured on the current stream, and inside ``value_checks(False)`` (a
  benchmark's or a serving loop's choice; validate the inputs before the step instead).

Errors name the op, the argument and the first caller frame outside torch and this package.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, NoReturn, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

_TORCH_DIR = os.path.dirname(torch.__file__)
_KERNELS_DIR = os.path.dirname(os.path.abspath(__file__))

#: Floating dtypes a cache may hold as plain (unquantised) values.
PLAIN_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Dtypes a cache may hold fp8 e4m3 values in: the float8 dtype itself, or its raw bits.
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)


_VALUE_CHECKS = [True]


@contextlib.contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Run the block with the ops' data-dependent value checks on or off (on by default)."""
    _VALUE_CHECKS.append(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS.pop()


def value_checks_active(t: torch.Tensor) -> bool:
    """Whether the value checks of an op on ``t``'s device run now: on, and not capturing a CUDA
    graph (a host read is refused inside a capture)."""
    if not _VALUE_CHECKS[-1]:
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


class KernelInputError(ValueError):
    """A cache-write op was called with arguments it cannot honour; nothing was written."""


def _caller_location() -> str:
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_TORCH_DIR) and not path.startswith(_KERNELS_DIR):
            return f" (called from {frame.f_code.co_filename}:{frame.f_lineno})"
        frame = frame.f_back
    return ""


def fail(op: str, arg: str, problem: str) -> NoReturn:
    raise KernelInputError(f"pcppass::{op}: argument '{arg}' {problem}{_caller_location()}")


def known_unequal(a, b) -> bool:
    """True when two (possibly symbolic) sizes are certainly different; never adds a guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a != b
    return statically_known_true(a != b)


def known_greater(a, b) -> bool:
    """True when ``a > b`` certainly holds for (possibly symbolic) sizes; never adds a guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a > b
    return statically_known_true(a > b)


def check_dtype(op: str, arg: str, t: torch.Tensor, allowed: Sequence[torch.dtype], because: str = "") -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        reason = f" ({because})" if because else ""
        fail(op, arg, f"must have dtype in ({names}){reason}, got {t.dtype}")


def check_float(op: str, arg: str, t: torch.Tensor) -> None:
    check_dtype(op, arg, t, PLAIN_FLOAT_DTYPES)


def check_shape(op: str, arg: str, t: torch.Tensor, expected: Sequence[object], what: str) -> None:
    """``expected`` entries are sizes or ``None`` (any size); ``what`` spells the expected shape."""
    if t.dim() != len(expected):
        fail(op, arg, f"must be {what} ({len(expected)}-d), got shape {list(t.shape)}")
    for actual, want in zip(t.shape, expected):
        if want is not None and known_unequal(actual, want):
            fail(op, arg, f"must be {what}, got shape {list(t.shape)}")


def check_same_device(op: str, reference_arg: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.device != reference.device:
            fail(op, name, f"is on {t.device} but '{reference_arg}' is on {reference.device}")


def check_slot_mapping(op: str, arg: str, slots: torch.Tensor, rows: object, rows_from: str) -> None:
    """int64, 1-d, one slot per source row (vLLM: int32 slots were misread by Ascend kernels)."""
    if slots.dtype != torch.int64:
        fail(op, arg, f"must be int64 (vLLM slot convention), got {slots.dtype}")
    if slots.dim() != 1:
        fail(op, arg, f"must be 1-d [T], got shape {list(slots.shape)}")
    if known_unequal(slots.shape[0], rows):
        fail(op, arg, f"has {slots.shape[0]} slots but '{rows_from}' has {rows} rows")


def check_choice(op: str, arg: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        fail(op, arg, f"must be one of {list(choices)}, got {value!r}")


def check_scale(op: str, arg: str, scale: torch.Tensor) -> None:
    if not scale.dtype.is_floating_point:
        fail(op, arg, f"must be a floating tensor, got {scale.dtype}")
    if known_unequal(scale.numel(), 1):
        fail(op, arg, f"must hold one per-tensor scale, got shape {list(scale.shape)}")


def check_rope_table(op: str, arg: str, cos_sin_cache: torch.Tensor, rot_dim_max: object, what: str) -> None:
    """``[max_position, rot_dim]`` = ``cat(cos, sin)`` with an even ``rot_dim <= rot_dim_max``."""
    check_float(op, arg, cos_sin_cache)
    check_shape(op, arg, cos_sin_cache, (None, None), "[max_position, rot_dim]")
    rot_dim = cos_sin_cache.shape[1]
    if known_unequal(rot_dim % 2, 0) or known_greater(rot_dim, rot_dim_max):
        fail(op, arg, f"must have an even rot_dim <= {rot_dim_max} ({what}), got {rot_dim}")


def check_slot_values(op: str, arg: str, slots: torch.Tensor, num_slots: int) -> None:
    """Value check (real implementation only): every slot is -1-style padding or a distinct slot
    below ``num_slots``. Duplicates are refused because two rows racing for one slot has no
    deterministic result on a GPU."""
    if not value_checks_active(slots):
        return
    live = slots[slots >= 0]
    if live.numel() == 0:
        return
    top = int(live.max())
    if top >= num_slots:
        fail(op, arg, f"holds slot {top} but the cache has only {num_slots} slots")
    unique = torch.unique(live)
    if unique.numel() != live.numel():
        dup = int(unique[torch.bincount(torch.searchsorted(unique, live)) > 1][0])
        fail(op, arg, f"holds slot {dup} more than once; concurrent writes to one slot are not deterministic")


def check_index_values(op: str, arg: str, values: torch.Tensor, low: int, high: int, what: str) -> None:
    """Value check (real implementation only): ``low <= values < high``."""
    if not value_checks_active(values) or values.numel() == 0:
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < low or hi >= high:
        bad = lo if lo < low else hi
        fail(op, arg, f"holds {bad}, outside [{low}, {high}) ({what})")
