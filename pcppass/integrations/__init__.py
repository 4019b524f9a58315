"""Engine integrations: each subpackage wires pcppass into one serving engine.

A subpackage imports its engine at import time and fails with an ``ImportError`` saying what to
install when the engine is missing; nothing else in pcppass imports them.

* :mod:`pcppass.integrations.vllm`: vLLM's KV-update ops (the resolver of their context-addressed
  caches), a backend for vLLM's own ``compilation_config``, and an adapter that runs a vLLM model
  under :mod:`pcppass.engine` on P ranks with decode rows sharded.
"""
