"""How the rewrite moves rows: the transport it picks, what the peer-store transport emits, and the
deferred collective started right after the last write.

* ``AutoTransport`` (the backend's default) takes the all-gather transport on gloo / CPU and says
  why (``transports_of``); ``PcpBackend(transport="peer")`` refuses such a step at compile time.
* The peer-store transport (forced here: this machine has no symmetric memory) emits ONE
  ``sync_peer_store`` for the step, no all-gather and no scatter, reads re-run inputs back from
  its mailbox (``sync_read_header`` + ``sync_unpack``), and is refused when a re-run site comes
  before a row-copy site.
* Deferred schedule: ``sync_pack`` and the all-gather come right after the last write site,
  before the compute that follows it; ``wait_tensor`` and the scatter stay at the end.
* The device form of the input validation keeps every input, range and message.
"""

from __future__ import annotations


import pytest
import torch

from pcppass.analysis import find_state_writes
from pcppass.rewrite import peer_store
from pcppass.rewrite.insert import insert_sync
from pcppass.rewrite.plan import plan_sync
from pcppass.sync.input_checks import DeviceSlotChecks
from pcppass.runtime.validate import InputValidator
from test_rewrite_pass import _counts, _dynamo_graph, _inputs, step
from sync_cases import group_name  # noqa: F401  (a fixture)

OPS = torch.ops.pcppass


def rewritten(fn, inputs, group, transport, schedule="deferred"):
    def rewrite(gm):
        plan = plan_sync([w for w in find_state_writes(gm) if w.covered])
        insert_sync(gm, plan, schedule=schedule, group_name=group, world_size=2, transport=transport)
        return gm, plan

    return _dynamo_graph(fn, inputs, rewrite)


def test_auto_transport_takes_the_all_gather_on_gloo_and_says_why(group_name):
    gm, _ = rewritten(step, _inputs(), group_name, peer_store.AutoTransport)
    assert _counts(gm)["all_gather"] == 1
    assert peer_store.transports_of(gm) == "all-gather (process group backend gloo (peer stores need NCCL GPUs))"
    with pytest.raises(Exception, match="PlanError: pcppass: peer stores cannot sync this step: process group backend gloo"):
        rewritten(step, _inputs(), group_name, peer_store.PeerStoreTransport)


def copy_rows_only(x, slots, k_cache, v_cache, idx):
    scale = torch.ones(())
    k = x.view(-1, 2, 4)
    torch.ops.pcppass.reshape_and_cache_flash(k, k * 2, k_cache, v_cache, slots, "auto", scale, scale)
    torch.ops.pcppass.indexer_k_quant_and_cache(x.repeat(1, 16), idx, slots, 128, "ue8m0")
    return (x * 2).sum() + k_cache.float().sum()


def test_peer_store_transport_emits_one_op_and_no_scatter(group_name, monkeypatch):
    monkeypatch.setattr(peer_store, "peer_store_refusal", lambda segments, group: None)
    inputs = (torch.randn(3, 8), torch.tensor([1, -1, 6]), torch.zeros(4, 4, 2, 4), torch.zeros(4, 4, 2, 4),
              torch.zeros(4, 4 * 132, dtype=torch.uint8))
    gm, _ = rewritten(copy_rows_only, inputs, group_name, peer_store.AutoTransport)
    (node,) = gm.graph.find_nodes(op="call_function", target=OPS.sync_peer_store.default)
    assert _counts(gm) == {"pack": 0, "all_gather": 0, "wait": 0, "header": 0, "scatter": 0, "snapshot": 0,
                           "verdict": 0, "unpack": 0, "clone": 0}
    fp, caches, slots, layouts, payloads, segments, group, labels, verify, conflicts, reruns = node.args
    assert len(caches) == 3 and len(fp) == 64 and group == group_name and (verify, conflicts, reruns) == (True,
                                                                                                      True, False)
    assert segments == [3, 3, 3] and payloads == [slots[0]]
    assert peer_store.transports_of(gm) == "peer stores"
    # the op runs last: after every read of the step
    assert list(gm.graph.nodes)[-2] is node


def copy_then_rerun(x, slots, k_cache, v_cache, memory):
    scale = torch.ones(())
    k = x.view(-1, 2, 4)
    torch.ops.pcppass.reshape_and_cache_flash(k, k * 2, k_cache, v_cache, slots, "auto", scale, scale)
    h = x * 3.0
    torch.ops.passtest.write_memory(h, memory, slots)
    return h.sum(1) + k_cache.float().sum()


def test_peer_stores_take_reruns_from_the_mailbox_unless_a_copy_follows_a_rerun(group_name, monkeypatch):
    from pcppass.sync import peer

    monkeypatch.setattr(peer, "group_refusal", lambda group: None)
    monkeypatch.setattr(peer, "cache_refusal", lambda cache: None)
    gm, _ = rewritten(copy_then_rerun, _inputs(), group_name, peer_store.AutoTransport)
    (node,) = gm.graph.find_nodes(op="call_function", target=OPS.sync_peer_store.default)
    assert node.args[-1] is True  # the mailbox comes back: the re-run reads every rank's inputs
    counts = _counts(gm)
    assert (counts["all_gather"], counts["header"], counts["unpack"]) == (0, 1, 2)
    (header,) = gm.graph.find_nodes(op="call_function", target=OPS.sync_read_header.default)
    assert header.args[0] is node
    gm, _ = rewritten(step, _inputs(), group_name, peer_store.AutoTransport)  # copy, re-run, copy
    assert "a re-run site precedes a row-copy site" in peer_store.transports_of(gm)


def test_deferred_collective_starts_right_after_the_last_write(group_name):
    gm, plan = rewritten(step, _inputs(), group_name, peer_store.AutoTransport)
    nodes = list(gm.graph.nodes)
    where = {n: i for i, n in enumerate(nodes)}
    last_write = max(where[s.node] for s in plan.sites)
    (pack,) = gm.graph.find_nodes(op="call_function", target=OPS.sync_pack.default)
    (gather,) = gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.all_gather_into_tensor.default)
    (wait,) = gm.graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.wait_tensor.default)
    compute = [n for n in nodes[last_write + 1:] if n.op == "call_function" and "pcppass" not in str(n.target)
               and n.meta.get("pcppass_transport") is None and n.target not in (torch.clone,)]
    assert where[pack] < where[gather] < min(where[n] for n in compute) < where[wait]
    assert all(where[n] > where[wait] for n in gm.graph.find_nodes(
        op="call_function", target=OPS.sync_scatter_rows_all.default))


def test_device_slot_checks_keep_the_host_validators_inputs_and_messages(group_name):
    def rewrite(gm):
        plan = plan_sync([w for w in find_state_writes(gm) if w.covered])
        return InputValidator.from_plan(gm, plan, rank=1)

    validator = _dynamo_graph(step, _inputs(), rewrite)
    device = DeviceSlotChecks.of(validator)
    assert [r.input_index for r in device.ranges] == [c.input_index for c in validator.checks]
    assert [r.lowest for r in device.ranges] == [c.lowest_slot for c in validator.checks]
    assert all(r.what.startswith("rank 1: ") and "slot mapping" in r.what for r in device.ranges)
    assert device.evaluate(device.ranges[0].limit, _inputs()) == 16
