"""The Triton row kernels on a GPU (skipped without CUDA).

* The cache-write ops capture in a CUDA graph (no host reads while capturing) and each replay
  writes the bytes an eager call writes for the inputs copied into the captured tensors (eager CUDA
  equals the CPU reference for the pure stores: test_kernels_cuda.py).
* ``sync_pack`` / ``sync_scatter_rows_all`` on CUDA give the CPU reference ops' bytes.
"""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from kernels_cases import CACHE_ARGS, CASES, OPS
from pcppass.engine.launch import free_port
from pcppass.sync import rows_cuda  # noqa: F401  (registers the CUDA sync kernels)
from pcppass.sync.rows import encode_layout
from pcppass.spec import ResolvedLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CAPTURED = {
    "reshape_and_cache_flash": [{}, {"kv_cache_dtype": "fp8", "cache_dtype": torch.float8_e4m3fn}],
    "concat_and_cache_mla": [{"kv_cache_dtype": "fp8_ds_mla"}],
    "indexer_k_quant_and_cache": [{}],
    "fused_norm_rope": [{}],
}


def _cuda(args):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.parametrize("name,kwargs", [(n, kw) for n, kws in CAPTURED.items() for kw in kws])
def test_cache_write_ops_capture_and_replay_reference_bytes(name, kwargs):
    first, second = CASES[name](**kwargs), CASES[name](**{**kwargs, "seed": 40})
    static = _cuda(first)
    OPS[name](**_cuda(first))  # warm-up (kernel compile, tables) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        OPS[name](**static)
    for args in (first, second):
        reference = _cuda(args)  # eager on the same device: norms reduce in the device's order
        OPS[name](**reference)
        for key, value in args.items():
            if isinstance(value, torch.Tensor):
                static[key].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        for cache in CACHE_ARGS[name]:
            got, want = static[cache].view(torch.uint8), reference[cache].view(torch.uint8)
            assert torch.equal(got, want), (name, cache)
            assert not torch.equal(got.cpu(), args[cache].view(torch.uint8)), (name, cache, "nothing written")


def test_batched_sync_ops_match_reference_on_cuda():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.group.WORLD.group_name
        layouts = [ResolvedLayout("paged_rows", 64, 656),
                   ResolvedLayout("block_split", 64, 132, segments=((0, 128, 128), (64 * 128, 4, 4)))]
        encoded = [x for lay in layouts for x in encode_layout(lay)]
        g = torch.Generator().manual_seed(0)

        def caches():
            return [torch.randint(0, 256, (9, 64, 656), dtype=torch.uint8, generator=g),
                    torch.randint(0, 256, (9, 64 * 132), dtype=torch.uint8, generator=g)]

        slots = [torch.tensor([70, -1, 200, 5, 511]), torch.tensor([64, 129, -1, 300, 7])]
        mine = [caches(), caches()]
        packed_cpu = [torch.ops.pcppass.sync_pack("ab" * 16, c, [s, s], encoded, [s]) for c, s in zip(mine, slots)]
        packed_gpu = [torch.ops.pcppass.sync_pack("ab" * 16, [x.cuda() for x in c], [s.cuda()] * 2, encoded,
                                                  [s.cuda()]) for c, s in zip(mine, slots)]
        for a, b in zip(packed_cpu, packed_gpu):
            assert torch.equal(a, b.cpu())
        gathered = torch.cat(packed_cpu)
        index = torch.ops.pcppass.sync_read_header(gathered, 2, "ab" * 16, 3, True)
        target = caches()
        expected = [c.clone() for c in target]
        torch.ops.pcppass.sync_scatter_rows_all(expected, gathered, index, [0, 1], [2, 2], encoded, group,
                                                "a\nb", False)
        got = [c.cuda() for c in target]
        gathered_gpu = torch.cat(packed_gpu)
        index_gpu = torch.ops.pcppass.sync_read_header(gathered_gpu, 2, "ab" * 16, 3, False)
        torch.ops.pcppass.sync_scatter_rows_all(got, gathered_gpu, index_gpu, [0, 1], [2, 2], encoded, group,
                                                "a\nb", False)
        for a, b in zip(expected, got):
            assert torch.equal(a, b.cpu())
    finally:
        dist.destroy_process_group()
