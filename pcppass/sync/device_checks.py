"""Run-time checks done on the device, read on the host without waiting for the device.

On CUDA the sync kernels check what the reference ops check on the host (slot ranges, one owner
per slot, every rank's sync header, and, for peer stores, that every peer reached the barrier), but
a kernel cannot raise. It records what it found in a small *status* array in page-locked host
memory mapped into the device's address space: kernels write it with plain stores, the host reads
it with plain loads, no synchronisation and nothing a CUDA graph cannot replay. Before each step
the backend's wrapper calls :func:`raise_pending`: an error recorded by an earlier step (usually
the previous one; whenever the device got that far) raises there, with the op, the state and the
rank it concerns. :func:`synchronize_and_raise` waits for the device first (tests, end of run).

What the kernels do when they find an error keeps every replica identical:

* a slot outside ``[-1, num_slots)`` is never written, on any rank;
* a slot written by two ranks in one step is zeroed on every replica;
* if any rank's sync header (graph fingerprint, segment sizes) differs, no rank applies that
  all-gather's rows.

Slot-mapping inputs are range-checked on the device too
(:class:`pcppass.sync.input_checks.DeviceSlotChecks`, one launch for every input), before the step's first write in stream order: on CUDA nothing is read back.

Status words (int64; 0 = nothing recorded)
=========  ==============================================================================
word       meaning
=========  ==============================================================================
HEADER     1 + the rank whose sync header differs from this rank's
RANGE      1 + the label of the cache written at a slot out of range; RANGE_SLOT, RANGE_RANK
CONFLICT   1 + the label of the cache whose slot two ranks wrote; CONFLICT_SLOT, CONFLICT_RANK
TIMEOUT    1 + the peer that did not reach the sync barrier in time; EPOCH (the barrier's number)
INPUT      1 + the label of the slot input out of range; INPUT_VALUE
OUT_OF_STEP  1 + a peer that ran more syncs than this rank; EPOCH
=========  ==============================================================================
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from pcppass.errors import PcpInputError, PcpSyncError

HEADER, RANGE, RANGE_SLOT, RANGE_RANK = 0, 1, 2, 3
CONFLICT, CONFLICT_SLOT, CONFLICT_RANK = 4, 5, 6
TIMEOUT, EPOCH, INPUT, INPUT_VALUE, OUT_OF_STEP = 7, 8, 9, 10, 11
WORDS = 16

_lock = threading.Lock()
_labels: list[str] = []
_label_ids: dict[str, int] = {}
_status: dict[torch.device, torch.Tensor] = {}


def label(text: str) -> int:
    """The id kernels report ``text`` by (interned: one id per distinct text)."""
    with _lock:
        found = _label_ids.get(text)
        if found is None:
            found = _label_ids[text] = len(_labels)
            _labels.append(text)
        return found


def label_text(label_id: int) -> str:
    return _labels[label_id] if 0 <= label_id < len(_labels) else f"<label {label_id}>"


def status(device: torch.device | str) -> torch.Tensor:
    """The status words the kernels on ``device`` write: host memory, page-locked and mapped for
    CUDA devices (a kernel argument resolves to its device address), plain memory for the CPU
    (Triton's interpreter)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        found = _status.get(device)
        if found is None:
            if device.type == "cuda":
                with torch.cuda.device(device):
                    found = torch.zeros(WORDS, dtype=torch.int64, pin_memory=True)
            else:
                found = torch.zeros(WORDS, dtype=torch.int64)
            _status[device] = found
        return found


def _message(words: list[int]) -> tuple[type[Exception], str]:
    problems = []
    kind: type[Exception] = PcpSyncError
    if words[INPUT]:
        kind = PcpInputError
        problems.append(f"{label_text(words[INPUT] - 1)} holds slot {words[INPUT_VALUE]}, outside the "
                        "cache's range (checked on the device before the step wrote)")
    if words[HEADER]:
        problems.append(f"rank {words[HEADER] - 1}'s sync header differs from this rank's (graph fingerprint or "
                        "segment sizes): the ranks run different step graphs; no rank applied those rows")
    if words[RANGE]:
        problems.append(f"{label_text(words[RANGE] - 1)}: rank {_rank(words[RANGE_RANK])} wrote slot "
                        f"{words[RANGE_SLOT]}, outside the cache; no replica stored that row")
    if words[CONFLICT]:
        problems.append(f"{label_text(words[CONFLICT] - 1)}: slot {words[CONFLICT_SLOT]} was written by rank "
                        f"{words[CONFLICT_RANK]} and another rank in the same step; every row must have one "
                        "owner per step (every replica zeroed that row, so they stay identical)")
    if words[TIMEOUT]:
        problems.append(f"rank {words[TIMEOUT] - 1} did not reach peer-store sync #{words[EPOCH]} in time: it "
                        "stopped, hangs, or runs a different step graph; this rank's replicas may lack its rows")
    if words[OUT_OF_STEP]:
        problems.append(f"rank {words[OUT_OF_STEP] - 1} ran more peer-store syncs than this rank (at sync "
                        f"#{words[EPOCH]}): the ranks run different step graphs")
    text = "pcppass device checks: " + "; ".join(problems)
    return kind, text


def _rank(word: int) -> str:
    return "this rank" if word < 0 else str(word)


def pending(device: torch.device | str) -> Exception | None:
    """The error recorded on ``device`` so far (None), read without waiting for the device. The
    status is cleared: each error is reported once."""
    words_t = status(device)
    words = words_t.tolist()
    if not any(words):
        return None
    words_t.zero_()
    kind, text = _message(words)
    return kind(text)


def raise_pending(device: torch.device | str) -> None:
    """Raise the error the device recorded so far, if any (no synchronisation)."""
    error = pending(device)
    if error is not None:
        raise error


def synchronize_and_raise(device: torch.device | str) -> None:
    """Wait for ``device`` to finish its work, then :func:`raise_pending`."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    raise_pending(device)


# ---------------------------------------------------------------------------------------------
# Slot-mapping inputs: what the device checks accept (pcppass.sync.input_checks launches them)
# ---------------------------------------------------------------------------------------------


def is_slot_tensor(value: Any) -> bool:
    """A tensor of integers of any width (what a slot mapping may be; bool is not one)."""
    return (isinstance(value, torch.Tensor) and value.dtype != torch.bool
            and not value.dtype.is_floating_point and not value.dtype.is_complex)


#: the integer dtypes the input kernel reads, by code (row_kernels_triton.input_kernel)
SLOT_DTYPE_CODES = {torch.int64: 0, torch.int32: 1, torch.int16: 2, torch.int8: 3, torch.uint8: 4}
