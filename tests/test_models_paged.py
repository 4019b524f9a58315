"""Paged incremental decode of every reference model == full recompute without a cache.

Setup per model (tiny config, float32): two concurrent requests of different prompt lengths
(11 and 7 tokens), prefilled in chunks of 3 and 5 positions (block size 4, indexer block size 8:
chunks end mid-block), then 16 greedy decode steps each, every step with one padding row (slot -1).
Blocks are handed out in a random order. The reference recomputes each finished sequence in one
pass with no cache (``model.reference_forward``), replaying the caches' quantisation round-trips.

Tolerance: both paths compute the same float32 math over the same values; they differ only in
reduction order (a paged row reduces over ``num_blocks * block_size`` gathered keys, masked ones
contributing exact zeros; the reference over the sequence) and in matmul batch shapes. Observed
differences are ~2e-6 on logits of magnitude ~4 (a few float32 ulps); ``LOGITS_ATOL = 2e-5``
leaves a 10x margin and is still ~100x below the effect of dropping an fp8 round-trip (checked
below), of reading one wrong cache row, or of a missing write. fp8 encodes see the same float32
inputs up to those ulps, so an e4m3 code can only flip when a value sits within an ulp of a rounding
boundary: seeded inputs, and no such flip occurs (the tight bound would catch it).
"""

from __future__ import annotations

import pytest
import torch
from paged_driver import PagedDriver, Request, generate

from pcppass.models import MODEL_NAMES, build_model

LOGITS_ATOL = 2e-5
PROMPT_LENS = (11, 7)
CHUNKS = [3, 5]
DECODE_STEPS = 16

CASES = [
    ("llama", {}),
    ("llama", {"kv_cache_dtype": "fp8"}),
    ("deepseek_v2", {}),
    ("deepseek_v2", {"kv_cache_dtype": "fp8_ds_mla"}),
    ("deepseek_v32", {}),  # fp8_ds_mla MLA cache + fp8 indexer cache
    ("deepseek_v4", {}),
]
# the same weights with an unquantised cache: its logits must differ from the quantised model's
UNQUANTISED = {
    ("llama", "fp8"): {"kv_cache_dtype": "auto"},
    ("deepseek_v2", "fp8_ds_mla"): {"kv_cache_dtype": "auto"},
    ("deepseek_v32", "fp8_ds_mla"): {"kv_cache_dtype": "auto"},
}


def _prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _case_id(case) -> str:
    name, overrides = case
    return "-".join([name, *map(str, overrides.values())])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_decode_matches_reference(case):
    name, overrides = case
    torch.manual_seed(0)
    model = build_model(name, "tiny", **overrides)
    prompts = _prompts()
    tokens, paged_logits, driver = generate(model, prompts, CHUNKS, DECODE_STEPS)

    for prompt, toks, logits in zip(prompts, tokens, paged_logits):
        assert len(toks) == len(prompt) + DECODE_STEPS
        ref = model.reference_forward(torch.tensor(toks[:-1]))
        assert ref.shape == logits.shape
        # greedy tokens of the cached run == argmax of the recompute at every generated position
        assert ref[len(prompt) - 1 :].argmax(-1).tolist() == toks[len(prompt) :]
        torch.testing.assert_close(logits, ref, rtol=0, atol=LOGITS_ATOL)

    # every cache received rows (a model whose attention bypasses a cache leaves it all zeros)
    for cache_name, cache in driver.caches.items():
        assert cache.view(torch.uint8).any(), f"{name}: cache {cache_name} was never written"

    # ring groups really wrapped: the longest request ran past one ring
    longest = max(len(t) - 1 for t in tokens)
    for group in driver.groups.values():
        if group.addressing == "ring":
            ring_len = group.ring_blocks(driver.max_step_positions) * group.block_size
            assert longest > ring_len, f"{name}: test never wraps ring group {group.name}"

    # the quantised cache matters at this tolerance: the unquantised model (same weights) differs
    dtype = overrides.get("kv_cache_dtype", getattr(model.config, "kv_cache_dtype", None))
    if (name, dtype) in UNQUANTISED:
        torch.manual_seed(0)
        plain = build_model(name, "tiny", **UNQUANTISED[(name, dtype)])
        plain_ref = plain.reference_forward(torch.tensor(tokens[0][:-1]))
        assert (plain_ref - paged_logits[0]).abs().max() > 10 * LOGITS_ATOL


def _boundary_step(model):
    """A driver with request 0 prefilled to position 14 and request 1 to 6, and the next step
    (request 0 at position 15, closing a group of 4 and of 8; request 1 at position 7)."""
    driver = PagedDriver(model, num_blocks=64, max_step_positions=5)
    gen = torch.Generator().manual_seed(2)
    reqs = [Request(torch.randint(0, 256, (16,), generator=gen).tolist(), 16),
            Request(torch.randint(0, 256, (8,), generator=gen).tolist(), 8)]
    with torch.no_grad():
        for work in ([(reqs[0], 5), (reqs[1], 3)], [(reqs[0], 5), (reqs[1], 4)], [(reqs[0], 5)]):
            ids, pos, meta = driver.build_step(work, padding_rows=1)
            model(ids, pos, meta, driver.caches)
            driver.commit(work)
    work = [(reqs[0], 1), (reqs[1], 1)]
    return driver, work


def _scramble(cache: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if cache.dtype == torch.uint8:
        return torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8)
    if cache.dtype == torch.float8_e4m3fn:
        return torch.randn(cache.shape, generator=gen).to(cache.dtype)
    return torch.randn(cache.shape, generator=gen, dtype=cache.dtype)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_cache_is_read(name):
    """Scrambling any one cache before a step changes that step's output: attention (and the
    compressors) read every cache, none is write-only, none is bypassed by the step's own
    activations. The step closes compression groups, so compressor state is read too."""
    torch.manual_seed(0)
    model = build_model(name, "tiny")
    driver, work = _boundary_step(model)
    ids, pos, meta = driver.build_step(work, padding_rows=1)
    with torch.no_grad():
        base = model(ids, pos, meta, {k: v.clone() for k, v in driver.caches.items()})
        gen = torch.Generator().manual_seed(3)
        for cache_name in driver.caches:
            caches = {k: v.clone() for k, v in driver.caches.items()}
            caches[cache_name] = _scramble(caches[cache_name], gen)
            out = model(ids, pos, meta, caches)
            assert not torch.equal(out[:-1], base[:-1]), f"{name}: output does not depend on cache {cache_name}"
