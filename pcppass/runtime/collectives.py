"""The all-gathers of a host (gloo) step, with a wait that ends when a peer is declared dead.

``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor`` is how the rewrite emits every
collective (it traces, and Inductor knows it). On gloo its wait cannot be interrupted: a peer that
hangs with its sockets open (a stopped process, a lost host) holds it until the process-group
timeout, whatever the liveness watch knows. For a graph whose collectives run on the host,
:class:`pcppass.compiler.PcpBackend` swaps the pair for these two ops (same arguments, same
result, the collective still started where the graph starts it and waited for where it waits):

* ``pcppass::all_gather_start``: issues the all-gather asynchronously and keeps its work;
* ``pcppass::all_gather_wait``: waits for it through :func:`pcppass.runtime.liveness.wait_watched`,
  which raises naming the peer once the watch declares it dead or failed, and returns the
  gathered rows (a copy: a custom op's output may not alias its input).

NCCL steps keep the functional collectives: the watch aborts the communicator, which ends them.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from pcppass.runtime.liveness import wait_watched

#: torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` (the old name now warns,
#: FutureWarning, at every call); torch 2.11 has only the old name.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> dist.Work | None:
    """Every rank's ``tensor`` (the same shape on all) into ``output``, rank by rank along dim 0:
    ``torch.distributed.all_gather_single`` where torch has it, ``all_gather_into_tensor`` before."""
    return _ALL_GATHER_SINGLE(output, tensor, group=group, async_op=async_op)


#: data pointer of a gathered buffer -> the collective filling it (started, not yet waited for)
_PENDING: dict[int, dist.Work] = {}


def _resolve(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


@torch.library.custom_op("pcppass::all_gather_start", mutates_args=())
def all_gather_start(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Start the all-gather of every rank's ``input`` along dim 0 (``all_gather_into_tensor``);
    the result is valid once :func:`all_gather_wait` returned it."""
    out = input.new_empty((group_size * input.shape[0], *input.shape[1:]))
    work = all_gather_single(out, input.contiguous(), group=_resolve(group_name), async_op=True)
    _PENDING[out.data_ptr()] = work
    return out


@all_gather_start.register_fake
def _(input, group_size, group_name):
    return input.new_empty((group_size * input.shape[0], *input.shape[1:]))


@torch.library.custom_op("pcppass::all_gather_wait", mutates_args=())
def all_gather_wait(gathered: torch.Tensor, group_name: str) -> torch.Tensor:
    """Wait for the all-gather that fills ``gathered`` (see the module docstring)."""
    work = _PENDING.pop(gathered.data_ptr(), None)
    if work is not None:
        wait_watched(work, _resolve(group_name), "the sync all-gather")
    return gathered.clone()


@all_gather_wait.register_fake
def _(gathered, group_name):
    return torch.empty_like(gathered)


# ---------------------------------------------------------------------------------------------
# Host-side gathers of pcppass's own checks (the state digest, the row-count agreement), waited
# for under the liveness watch like the graph's: a hung peer ends them in seconds on gloo.
# ---------------------------------------------------------------------------------------------


def all_gather_watched(tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> torch.Tensor:
    """``[world, *tensor.shape]``: every rank's ``tensor`` (the same shape on all ranks)."""
    world = dist.get_world_size(group)
    flat = tensor.contiguous().reshape(-1)
    every = flat.new_empty((world * flat.numel(),))
    wait_watched(all_gather_single(every, flat, group=group, async_op=True), group, what)
    return every.view(world, *tensor.shape)


def all_gather_object_watched(obj: Any, group: dist.ProcessGroup | None, device: torch.device,
                              what: str) -> list[Any]:
    """Every rank's picklable ``obj`` (``dist.all_gather_object``, whose waits cannot be watched):
    the sizes, then the bytes padded to the largest."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = all_gather_watched(torch.tensor([data.numel()], device=device), group, what).reshape(-1).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:data.numel()] = data
    every = all_gather_watched(padded.to(device), group, what).cpu()
    return [pickle.loads(every[r, :n].numpy().tobytes()) for r, n in enumerate(sizes)]
