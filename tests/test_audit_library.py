"""``pcppass.audit``: the library form of ``pcppass audit`` (a report object), and the package's
``__all__`` importing cleanly."""

from __future__ import annotations

import subprocess
import sys

import torch

import pcppass
from pcppass.analysis import AuditReport, Uncovered, audit
from pcppass.analysis.trace import capture_graph
from pcppass.cli.targets import build_builtin

import audit_fixtures


def test_star_import_of_the_package_works():
    code = "from pcppass import *; import pcppass; assert audit is pcppass.analysis.audit; print(len(dir()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_audit_of_a_model_with_an_unknown_op():
    model, inputs = audit_fixtures.unknown_op_model()
    report = pcppass.audit(model, inputs, name="unknown")
    assert isinstance(report, AuditReport) and not report.ok
    (w,) = report.uncovered
    assert report.writes == [w] and report.covered == []
    assert w.reason is Uncovered.UNKNOWN_MUTATING_OP and "audit_fixtures.py" in w.source
    payload = report.to_dict()
    assert (payload["model"], payload["ok"], payload["covered"], payload["uncovered"]) == (
        "unknown", False, 0, 1)
    assert payload["writes"][0]["op"] == "pcppass_test::scale_rows_into"
    assert "0 covered, 1 uncovered" in report.describe()


def test_audit_of_a_contract_model_builds_its_own_step():
    model = build_builtin("llama", "tiny", "cpu")
    report = audit(model)
    assert report.ok and len(report.covered) == 2 * model.config.num_layers
    assert report.graph is not None and report.dynamic is None


def test_audit_of_plain_arguments_and_of_a_traced_graph():
    class Store(torch.nn.Module):
        def forward(self, x, idx, cache):
            cache.index_copy_(0, idx, x)
            return x.sum()

    args = (torch.randn(3, 4), torch.tensor([0, 2, 5]), torch.zeros(8, 4))
    report = audit(Store(), args)
    assert report.ok and report.writes[0].bytes_per_row == 16
    again = audit(report.graph)  # a Dynamo graph, as a backend receives it
    assert again.ok and [w.op for w in again.writes] == ["aten::index_copy_"]
    assert again.graph is report.graph


def test_dynamic_audit_through_the_library():
    model, inputs = audit_fixtures.opaque_write_model()
    report = audit(model, inputs, dynamic_steps=1)
    assert not report.ok and report.dynamic is not None
    (change,) = report.dynamic.changes
    assert change.rows == [1, 6, 9, 14]
    assert report.to_dict()["unexplained_changes"][0]["rows"] == [1, 6, 9, 14]


def test_graph_break_with_a_dynamic_run_is_not_ok():
    model, inputs = audit_fixtures.graph_break_model()
    report = audit(model, inputs, dynamic_steps=1)
    assert report.trace_error is not None and "graph break" in report.trace_error
    assert report.graph is None and not report.ok
