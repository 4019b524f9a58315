"""The sharded-run harness of the vLLM tests: :mod:`pcppass.integrations.vllm.sharded_check`,
with :func:`check_sharded` asserting that a run has no failure.

:func:`run_sharded` is one rank's run (called through ``pcppass.engine.launch.launch``); the
library lists what a sharded run got wrong (an error, replicas not bitwise identical after every
step, tokens other than vLLM's own ``LLM.generate``, other than one sync collective per decode
step, decode rows that never moved between ranks), and the tests assert the list is empty.
"""

from __future__ import annotations

from pcppass.integrations.vllm.sharded_check import (  # noqa: F401  (the tests' harness)
    STAGGERED_MAX_TOKENS, ShardedCase, call_hook, first_divergence, moved_requests, reference_prefixes, run_cases,
    run_sharded, sharded_failures,
)


def check_sharded(label: str, ranks: list[dict], reference: list[list[int]]) -> None:
    failures = sharded_failures(ranks, reference)
    assert not failures, f"{label}: " + "; ".join(failures)
