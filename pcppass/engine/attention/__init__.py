"""Paged attention kernels for the reference models' GPU paths (Triton).

The models' CPU paths gather every visible cache row and attend in plain torch (the reference);
on CUDA they call these kernels, which read the paged caches through the block table directly:

* GQA decode and prefill over ``[nb, bs, Hk, D]`` K/V caches (bf16 or fp8 with per-tensor scales);
* MLA in the latent space over ``[nb, bs, L + R]`` or ``fp8_ds_mla`` rows, dense (DeepSeek-V2) or
  over each row's selected positions (DeepSeek-V3.2 sparse attention);
* the DeepSeek-V3.2 lightning indexer on the fp8 block-split indexer cache, then a top-k that
  selects without sorting the context.

:mod:`.launch` holds the launchers (usable on CPU tensors under ``TRITON_INTERPRET=1``: tests),
:mod:`.ops` the custom ops the models call, :mod:`.triton_kernels` the kernels. docs/KERNELS.md and
docs/BENCH.md give the bytes each kernel must read and what it reaches on an H200.
"""

from pcppass.engine.attention import launch, ops

__all__ = ["launch", "ops"]
