"""The model contract: how a model declares its caches and receives one step's inputs.

Any ``torch.nn.Module`` that follows this contract runs in :mod:`pcppass.engine` (single rank or
decode-sharded over P ranks) without importing anything else from pcppass:

* ``model.cache_groups() -> list[CacheGroupSpec]``: the slot-addressing groups (one block table and
  one slot mapping per group per step).
* ``model.cache_specs() -> list[CacheSpec]``: every persistent state tensor, by name, with its
  group, per-block shape and dtype. The engine allocates ``[num_blocks, *block_shape]`` for each.
* ``model.forward(input_ids, positions, meta, caches) -> hidden`` with ``hidden: [T, hidden_size]``
  for the ``T`` rows of the step (padding rows included), where ``meta`` is a :class:`StepMeta`
  dict of tensors and ``caches`` maps cache names to the allocated tensors. Attention must read K/V
  through the caches (never from the step's own activations), so a rank's output depends only on
  its replica.
* ``model.compute_logits(hidden_rows) -> [n, vocab]`` for the rows the engine samples.

Slot convention (vLLM): int64, ``slot = block_number * block_size + offset``, ``-1`` = skip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Addressing = Literal["full", "ring", "compressed"]


@dataclass(frozen=True)
class CacheGroupSpec:
    """A slot-addressing group: which positions of a request get a slot, and where.

    * ``full``: every position ``p`` -> ``table[p // bs] * bs + p % bs``; blocks shareable across
      requests with a common prefix.
    * ``ring``: a per-request ring of ``ring_len = len(table_row) * bs`` positions, ``q = p % ring_len``
      -> ``table[q // bs] * bs + q % bs``. The engine sizes the ring as ``window`` plus the most
      positions one request can add in one step (so a step never overwrites a position that a row of
      the same step still reads): sliding-window caches and compressor state.
    * ``compressed``: only positions closing a compression group (``(p + 1) % ratio == 0``) get a
      slot, for compressed index ``c = p // ratio`` -> ``table[c // bs] * bs + c % bs``; -1 elsewhere.
    """

    name: str
    block_size: int
    addressing: Addressing = "full"
    window: int = 0  # ring: positions a row may read back (sliding window, compressor span)
    ratio: int = 1  # compressed

    def ring_blocks(self, max_step_positions: int) -> int:
        """Blocks of one request's ring, given the most positions a request adds in one step."""
        return -(-(self.window + max_step_positions) // self.block_size)

    def blocks_for(self, num_positions: int, max_step_positions: int) -> int:
        """Blocks a request with ``num_positions`` cached positions needs in this group."""
        if self.addressing == "ring":
            return self.ring_blocks(max_step_positions) if num_positions > 0 else 0
        n = num_positions if self.addressing == "full" else num_positions // self.ratio
        return -(-n // self.block_size)

    def slot(self, table_row: list[int], position: int) -> int:
        """The slot of ``position`` for a request whose block table row is ``table_row``."""
        bs = self.block_size
        if self.addressing == "full":
            idx = position
        elif self.addressing == "ring":
            idx = position % (len(table_row) * bs)
        else:
            if (position + 1) % self.ratio:
                return -1
            idx = position // self.ratio
        return table_row[idx // bs] * bs + idx % bs


@dataclass(frozen=True)
class CacheSpec:
    """One persistent state tensor: ``[num_blocks, *block_shape]`` of ``dtype`` in ``group``."""

    name: str
    group: str
    block_shape: tuple[int, ...]
    dtype: torch.dtype

    def bytes_per_block(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


StepMeta = dict  # str -> torch.Tensor; the keys are documented below.
STEP_META_DOC = """One step's inputs besides ``input_ids`` and ``positions`` (all int64 unless noted).

    ``T`` local rows (padding included, ``T >= 2``), ``R`` local requests. The engine pads ``R`` to
    ``T`` so every per-row and per-request dim of a step has one size (one symbol under dynamic
    shapes); padding requests have ``seq_lens == 0`` and an all-zero block table row. Block 0 of
    every group is the null block: never allocated, never written, what 0-filled table columns
    point at.

    * ``slot_mapping.<group>``: ``[T]`` slot of each row in that group (-1 for padding rows).
    * ``block_table.<group>``: ``[R, max_blocks]`` int64 block numbers (0-filled past the end).
    * ``token_to_req``: ``[T]`` local request index of each row (0 for padding rows).
    * ``seq_lens``: ``[R]`` cached positions each request can attend to after this step's writes,
      i.e. ``position of its last local row + 1`` (0 for padding requests).
    * ``query_start_loc``: ``[R + 1]`` row offsets of each request's rows.
    * ``is_padding``: ``[T]`` bool.
"""


def slot_key(group: str) -> str:
    return f"slot_mapping.{group}"


def table_key(group: str) -> str:
    return f"block_table.{group}"


#: Meta keys besides the per-group ``slot_key(group)`` / ``table_key(group)``.
TOKEN_TO_REQ = "token_to_req"
SEQ_LENS = "seq_lens"
QUERY_START_LOC = "query_start_loc"
IS_PADDING = "is_padding"

#: Block 0 of every group: never allocated or written (see STEP_META_DOC).
NULL_BLOCK = 0

#: ``"decode"``: every row of the step (on every rank) is a decode row; ``"mixed"``: some rank runs
#: prefill rows. Global to the step, so all ranks run the same graph.
StepKind = Literal["decode", "mixed"]

