"""Start the deferred sync's collective as soon as the step's last state write is done.

Under the deferred schedule the sync is emitted at the end of the step. Its all-gather only needs
the rows (written by the last write site) and the payloads (snapshots taken right after their
sites), so it can start right after the last site, while the rest of the step (the last layers'
attention and MLP, the final norm) runs: a functional collective runs on the communicator's
stream until its ``wait_tensor``, which stays at the end, before the scatter. Before::

    site_60(...)                       # last write into state
    ... layer 60 attention, MLP ...
    packed   = pcppass.sync_pack(...)
    gathered = all_gather_into_tensor(packed, ...)
    gathered = wait_tensor(gathered)
    ... scatter ...

After::

    site_60(...)
    packed   = pcppass.sync_pack(...)                 # moved up
    gathered = all_gather_into_tensor(packed, ...)    # moved up: runs alongside the compute below
    ... layer 60 attention, MLP ...
    gathered = wait_tensor(gathered)
    ... scatter ...

Only reads of the caches follow the last write site, and the pack only reads them, so moving it
there changes no value. The peer-store op stays where it is: it runs on the step's own stream, and
its barrier must follow every read of the step.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx

from pcppass.rewrite.plan import SyncSite

_STARTS = (torch.ops.pcppass.sync_pack.default, torch.ops._c10d_functional.all_gather_into_tensor.default)


def start_exchange_early(graph: torch.fx.Graph, sites: Sequence[SyncSite], emitted: Sequence[torch.fx.Node]) -> int:
    """Move the emitted pack and all-gather nodes (and the emitted nodes they read) right after
    the last of ``sites`` or of their inputs, whichever comes later. Returns how many moved."""
    if not sites:
        return 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    last_write = max(order[site.node] for site in sites)
    emitted_set = set(emitted)
    moving: set[torch.fx.Node] = set()
    stack = [n for n in emitted if n.target in _STARTS]
    while stack:
        node = stack.pop()
        if node in moving or order[node] <= last_write:
            continue
        moving.add(node)
        stack.extend(n for n in node.all_input_nodes if n in emitted_set)
    anchor = next(n for n in graph.nodes if order[n] == last_write)
    for node in sorted(moving, key=order.__getitem__):
        inputs = [order[n] for n in node.all_input_nodes if n not in moving]
        target = max([order[anchor], *inputs])
        after = next(n for n in graph.nodes if order[n] == target) if target != order[anchor] else anchor
        after.append(node)
        order = {n: i for i, n in enumerate(graph.nodes)}
        anchor = node
    return len(moving)
