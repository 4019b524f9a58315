"""Slot-mapping inputs of a CUDA step checked on the device, before its first write.

The launch is :func:`pcppass.sync.row_kernels.check_inputs`; what it finds lands in the status
words of :mod:`pcppass.sync.device_checks` and is raised by the next ``raise_pending``. Kept out of
``device_checks`` because the kernels themselves report through those words (``row_kernels``
imports ``device_checks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from pcppass.errors import PcpInputError
from pcppass.sync import row_kernels
from pcppass.sync.device_checks import is_slot_tensor, label, raise_pending


@dataclass(frozen=True)
class SlotRange:
    """One slot-mapping input: graph input ``input_index`` must hold integers, ``rows`` of them
    (None: any number), each in ``[lowest, limit)``; ``limit`` and ``rows`` are evaluated per call
    from the arguments' shapes by ``evaluate``."""

    input_index: int
    what: str
    lowest: int
    limit: Any
    rows: Any = None


class DeviceSlotChecks:
    """Checks slot-mapping inputs of a CUDA step with no host read: dtype and length from the
    tensors' metadata (raises at once), values by one kernel launch for all inputs (recorded in
    the status, raised by the next :func:`raise_pending`)."""

    def __init__(self, ranges: Sequence[SlotRange], evaluate: Callable[[Any, Sequence[Any]], int | None]):
        self.ranges = list(ranges)
        self.evaluate = evaluate

    @classmethod
    def of(cls, validator) -> "DeviceSlotChecks":
        """The device form of a host :class:`pcppass.runtime.validate.InputValidator` (same
        inputs, ranges and messages; an aten index write's lowest slot is 0: -1 is its last row)."""
        rank = f"rank {validator.rank}: " if validator.rank is not None else ""
        ranges = []
        for c in validator.checks:
            aten = f" ({c.aten_family} follows Python indexing: -1 is the last row)" if c.aten_family else ""
            ranges.append(SlotRange(c.input_index, f"{rank}{c.op} writing {c.state} ({c.source}): slot mapping "
                                    f"{c.input_name}{aten}", c.lowest_slot, c.num_slots, c.rows))
        return cls(ranges, validator.symbols.evaluate)

    def __call__(self, args: Sequence[Any]) -> None:
        checks = []
        for rng in self.ranges:
            slots = args[rng.input_index]
            if not is_slot_tensor(slots):
                got = slots.dtype if isinstance(slots, torch.Tensor) else type(slots).__name__
                raise PcpInputError(f"{rng.what} must be an integer tensor (int64, int32, ...), got {got}")
            rows = self.evaluate(rng.rows, args) if rng.rows is not None else None
            if rows is not None and slots.numel() != rows:
                raise PcpInputError(f"{rng.what} has {slots.numel()} slots for {rows} rows")
            limit = self.evaluate(rng.limit, args)
            if limit is not None and slots.numel():
                checks.append((slots, rng.lowest, limit, label(rng.what)))
        if checks:
            row_kernels.check_inputs(checks)


def checking(compiled: Callable, device: torch.device | str,
             slot_checks: DeviceSlotChecks | None = None) -> Callable:
    """``compiled`` preceded by :func:`raise_pending` (errors of earlier steps) and the device slot
    checks of this step's inputs."""
    device = torch.device(device)

    def run(*args: Any) -> Any:
        raise_pending(device)
        if slot_checks is not None:
            slot_checks(args)
        return compiled(*args)

    return run
