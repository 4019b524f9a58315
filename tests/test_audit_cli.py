"""`pcppass audit`: table / JSON output, exit codes, and the dynamic audit naming opaque rows."""

from __future__ import annotations

import json

import pytest

from pcppass.cli import main


def _json(capsys, argv):
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def test_builtin_model_all_covered(capsys):
    code, out = _json(capsys, ["audit", "deepseek_v32", "--json"])
    assert code == 0 and out["uncovered"] == 0 and out["covered"] == 4
    row = out["writes"][0]
    assert row["pattern"] == "fused_norm_rope" and row["recipe"] == "copy_rows"
    assert row["source"].startswith("models/deepseek_v32.py:") or "deepseek_v32.py:" in row["source"]


def test_table_output_names_state_op_and_source(capsys):
    assert main(["audit", "audit_fixtures:unknown_op_model"]) == 1
    text = capsys.readouterr().out
    assert "L['caches']['kv']" in text and "pcppass_test::scale_rows_into" in text
    assert "audit_fixtures.py:" in text and "unknown mutating op" in text


def test_unknown_op_exit_1_with_source_line(capsys):
    code, out = _json(capsys, ["audit", "audit_fixtures:unknown_op_model", "--json"])
    assert code == 1
    (row,) = out["writes"]
    assert row["reason"] == "unknown mutating op" and row["op"] == "pcppass_test::scale_rows_into"
    assert row["source"].rsplit(":", 1)[0].endswith("audit_fixtures.py")


def test_opaque_write_static_flag_and_dynamic_rows(capsys):
    code, out = _json(capsys, ["audit", "audit_fixtures:opaque_write_model", "--json", "--dynamic",
                               "--steps", "1"])
    assert code == 1
    (row,) = out["writes"]
    assert row["reason"] == "op declares no mutation but takes a cache-like handle"
    (change,) = out["unexplained_changes"]
    # slots [1, 6, 9, 14, -1] of a [4, 4, 8] cache: the four live rows, named as slots
    assert change == {"state": "caches['kv']", "step": 0, "unit": "slot", "rows": [1, 6, 9, 14]}


def test_dynamic_audit_clean_on_reference_model(capsys):
    code, out = _json(capsys, ["audit", "llama", "--json", "--dynamic", "--steps", "1"])
    assert code == 0 and out["unexplained_changes"] == []


def test_dynamic_audit_sees_eager_write_outside_the_graph(capsys):
    code, out = _json(capsys, ["audit", "audit_fixtures:eager_write_model", "--json", "--dynamic",
                               "--steps", "1"])
    assert out["uncovered"] == 0 and code == 1
    (change,) = out["unexplained_changes"]
    assert change["state"] == "caches['kv']" and change["rows"] == [3]


@pytest.mark.parametrize("argv,needle", [
    (["audit", "no_such_model"], "unknown model"),
    (["audit", "no_such_module:factory"], "cannot load factory"),
    (["audit", "audit_fixtures:graph_break_model"], "graph break"),
])
def test_usage_and_trace_errors_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err
