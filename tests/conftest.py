"""Test collection shared by every test module."""

import importlib.util

# tests/test_vllm_*.py run in the vLLM job of .ci/run, whose own venv has vLLM installed (an
# install failure fails that job, and a run that collects no test fails too); an environment
# without vLLM does not collect them.
if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_vllm_*.py"]
