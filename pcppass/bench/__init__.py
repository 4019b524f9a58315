"""Benchmarks of pcppass on GPUs (``pcppass bench``), apart from the library itself.

* :mod:`.step`: one decode step replicated vs decode-sharded (per-site sync, pcppass's deferred
  sync, no sync), eager and from CUDA graphs; :mod:`.step_report` its tables and plot;
* :mod:`.kernels`: each paged attention kernel's time and achieved bandwidth against its floor;
* :mod:`.serve`: the engine end to end on a serving workload, replicated vs sharded;
  :mod:`.serve_report` its summary, tables and plot;
* :mod:`.sync_micro`: the sync of a deep step alone through the real ``pcppass::sync_*`` ops;
* shared: :mod:`.timing` (CUDA events, graph replays), :mod:`.inputs` (paged decode inputs,
  ownership, replica comparison), :mod:`.environment` (device, versions), :mod:`.sync_info`
  (checks and transport of a compiled step), :mod:`.results` (JSON, markdown, plot files).
"""
