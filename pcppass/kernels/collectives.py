"""``pcppass::all_gather_watched``: the sync all-gather of a host (gloo) step, with a bounded wait.

``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor`` is how the rewrite emits every
collective (it traces, and Inductor knows it). On gloo its wait cannot be interrupted: a peer that
hangs with its sockets open (a stopped process, a lost host) holds it until the process-group
timeout, whatever the liveness watch knows. For a graph whose collectives run on the host,
:class:`pcppass.compiler.PcpBackend` swaps each functional all-gather for this op (same arguments,
same result), which issues the same all-gather and waits for it through
:func:`pcppass.runtime.liveness.wait_watched`: the wait ends with an error naming the peer once the
watch declares it dead or failed. The ``wait_tensor`` left after it finds no pending work and
returns its input. NCCL steps keep the functional collective: the watch aborts the communicator,
which ends it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pcppass.runtime.liveness import wait_watched


@torch.library.custom_op("pcppass::all_gather_watched", mutates_args=())
def all_gather_watched(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Every rank's ``input`` stacked along dim 0, as ``all_gather_into_tensor``; the wait ends
    when a peer is declared dead or failed (see the module docstring)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    out = input.new_empty((group_size * input.shape[0], *input.shape[1:]))
    work = dist.all_gather_into_tensor(out, input.contiguous(), group=group, async_op=True)
    wait_watched(work, group, "the sync all-gather")
    return out


@all_gather_watched.register_fake
def _(input, group_size, group_name):
    return input.new_empty((group_size * input.shape[0], *input.shape[1:]))
