"""The examples run as a user would run them, and say what they claim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)
def test_shard_your_model_example():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "shard_your_model.py")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every rank refuses" in proc.stdout and "mylab::store_kv writes L['caches']['k']" in proc.stdout
    assert "tokens equal to one rank, every cache identical after every step" in proc.stdout
    assert "decode steps used [1] collective(s)" in proc.stdout
