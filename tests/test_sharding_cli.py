"""``pcppass run``: the verification table, its exit codes and a clean stderr (2 gloo ranks, tiny Llama)."""

from __future__ import annotations

import pytest

from pcppass.cli import main


@pytest.mark.timeout(240)
def test_run_verifies_and_exit_codes(capfd):
    assert main(["run", "--model", "llama", "--world", "2", "--steps", "6", "--requests", "4"]) == 0
    out, err = capfd.readouterr()
    assert "greedy tokens equal to single rank" in out and "yes" in out
    assert "collectives per decode step" in out
    # the ranks' processes print nothing above the table (torch 2.13 warns at every call of a
    # collective it renamed: the engine calls the current name)
    assert "Warning" not in err, err
    # the only write family of the model removed: the backend refuses, the command says so
    code = main(["run", "--model", "llama", "--world", "2", "--steps", "2", "--requests", "2",
                 "--unregister", "reshape_and_cache_flash"])
    assert code == 2
    assert "refused to shard llama" in capfd.readouterr().out
    # proceeding anyway: the divergence is found and named
    code = main(["run", "--model", "llama", "--world", "2", "--steps", "4", "--requests", "4",
                 "--unregister", "reshape_and_cache_flash", "--on-uncovered", "unsafe_ignore"])
    assert code == 1
    out = capfd.readouterr().out
    assert "differs across ranks" in out and "DIFFER" in out
