"""The replica sync the rewrite emits and a step runs: the sync ops (``pcppass::sync_*``) and their
plain-torch references (:mod:`.rows`), the CUDA pack / scatter / peer-store kernels
(:mod:`.rows_cuda`, :mod:`.row_kernels`, :mod:`.peer_store`), the owners check (:mod:`.owners`),
the context re-run (:mod:`.rerun_context`), symmetric-memory peers (:mod:`.peer`), the device
status words (:mod:`.device_checks`), the counters (:mod:`.stats`) and the compile fingerprint
(:mod:`.fingerprint`)."""
