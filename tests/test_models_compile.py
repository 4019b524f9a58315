"""Every reference model traces with ``torch.compile(fullgraph=True)`` (no graph break) and the
compiled step equals the eager step bitwise: hidden states and every cache."""

from __future__ import annotations

import pytest
import torch
from paged_driver import PagedDriver, Request

from pcppass.models import MODEL_NAMES, build_model


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_compiled_step_equals_eager(name):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(name, "tiny")
    driver = PagedDriver(model, num_blocks=64, max_step_positions=5)
    gen = torch.Generator().manual_seed(4)
    reqs = [Request(torch.randint(0, 256, (11,), generator=gen).tolist(), 11),
            Request(torch.randint(0, 256, (6,), generator=gen).tolist(), 6)]
    first = [(reqs[0], 5), (reqs[1], 5)]
    ids, pos, meta = driver.build_step(first, padding_rows=1)
    with torch.no_grad():
        model(ids, pos, meta, driver.caches)
    driver.commit(first)

    # a mixed step: a prefill chunk crossing a block boundary, a decode row, a padding row
    mixed = [(reqs[0], 3), (reqs[1], 1)]
    ids, pos, meta = driver.build_step(mixed, padding_rows=1)
    eager_caches = {k: v.clone() for k, v in driver.caches.items()}
    compiled_caches = {k: v.clone() for k, v in driver.caches.items()}
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        eager_out = model(ids, pos, meta, eager_caches)
        compiled_out = compiled(ids, pos, meta, compiled_caches)
    assert torch.equal(compiled_out, eager_out)
    for cache_name in eager_caches:
        assert torch.equal(_bits(compiled_caches[cache_name]), _bits(eager_caches[cache_name])), cache_name
        assert not torch.equal(_bits(compiled_caches[cache_name]), _bits(driver.caches[cache_name])), (
            f"{cache_name}: the compiled step wrote nothing"
        )
