"""Decode-shard a model pcppass has never seen: its own cache-write op, one pattern, two CPU ranks.

    python examples/shard_your_model.py

1. ``mylab::store_kv`` writes K and V rows into paged caches by slot (vLLM's convention, -1 skips).
2. Before its pattern is registered, every rank refuses to shard the model (``PcpCoverageError``
   names the op, the caches and the source line): a sharded run would leave replicas missing rows.
3. One ``register_pattern`` call covers it; the model then runs decode-sharded over 2 gloo ranks
   through ``pcppass.engine`` and every cache is bitwise identical on both ranks after every step,
   with greedy tokens equal to a single-rank run.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import pcppass
from pcppass.engine import CacheGroupSpec, CacheSpec, Engine, RequestSpec
from pcppass.contract import slot_key, table_key
from pcppass.engine.launch import launch

BLOCK = 4


@torch.library.custom_op("mylab::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    live = slots >= 0
    s = slots[live]
    k_cache[s // BLOCK, s % BLOCK] = k[live].to(k_cache.dtype)
    v_cache[s // BLOCK, s % BLOCK] = v[live].to(v_cache.dtype)


@store_kv.register_fake
def _(k, v, k_cache, v_cache, slots):
    return None


STORE_KV = pcppass.WritePattern(
    name="mylab.store_kv",
    ops=("mylab::store_kv",),
    caches=(pcppass.CacheRole("k_cache", slots="slots", layout=pcppass.PagedRows()),
            pcppass.CacheRole("v_cache", slots="slots", layout=pcppass.PagedRows())),
    row_args={"k": 0, "v": 0, "slots": 0},
    recipe=pcppass.Recipe.COPY_ROWS,
)


class TinyLM(nn.Module):
    """One causal attention layer over paged bf16 K/V, following docs/MODEL_CONTRACT.md."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(vocab, hidden, generator=g), requires_grad=False)
        self.qkv = nn.Parameter(torch.randn(hidden, 3 * hidden, generator=g) / math.sqrt(hidden),
                                requires_grad=False)
        self.heads, self.head_dim = heads, hidden // heads

    def cache_groups(self):
        return [CacheGroupSpec("attn", BLOCK)]

    def cache_specs(self):
        shape = (BLOCK, self.heads, self.head_dim)
        return [CacheSpec("k", "attn", shape, torch.bfloat16), CacheSpec("v", "attn", shape, torch.bfloat16)]

    def forward(self, input_ids, positions, meta, caches):
        T, H, D = input_ids.shape[0], self.heads, self.head_dim
        x = self.embed[input_ids] + torch.sin(positions[:, None].float() / 7)
        q, k, v = (x @ self.qkv).view(T, 3, H, D).unbind(1)
        torch.ops.mylab.store_kv(k, v, caches["k"], caches["v"], meta[slot_key("attn")])
        # Attention reads K/V back from the paged caches, never from this step's activations.
        table = meta[table_key("attn")][meta["token_to_req"]]
        pos = torch.arange(table.shape[1] * BLOCK)
        read = table[:, pos // BLOCK] * BLOCK + pos % BLOCK
        keys = caches["k"].view(-1, H, D)[read].float()
        values = caches["v"].view(-1, H, D)[read].float()
        scores = torch.einsum("thd,tlhd->thl", q, keys) / math.sqrt(D)
        scores = scores.masked_fill((pos[None, :] > positions[:, None])[:, None, :], float("-inf"))
        return x + torch.einsum("thl,tlhd->thd", scores.softmax(-1), values).reshape(T, H * D)

    def compute_logits(self, hidden_rows):
        return hidden_rows @ self.embed.T


REQUESTS = [RequestSpec(req_id=i, prompt=tuple((7 * i + j) % 64 for j in range(5 + 2 * i)), max_new_tokens=8)
            for i in range(6)]
ENGINE = dict(num_blocks=64, max_model_len=64, max_num_batched_tokens=32)


def run_rank(rank: int, world: int, with_pattern: bool):
    from pcppass.registry import unregister_pattern
    from pcppass.sharded import ShardedRunner, sharded_engine

    # Spawned ranks import this file afresh: register (or not) here.
    if with_pattern:
        pcppass.register_pattern(STORE_KV, replace=True)
    else:
        unregister_pattern(STORE_KV.name)
    model = TinyLM()
    runner = ShardedRunner(model, inner="eager")
    try:
        engine = sharded_engine(model, runner, world=world, rank=rank, record_digests=True, **ENGINE)
    except pcppass.PcpCoverageError as exc:
        return "refused", str(exc)
    engine.add_requests(REQUESTS)
    digests = []
    while (record := engine.step()) is not None:
        digests.append(record.digests)
    decode_collectives = sorted({s.collectives for s in runner.step_syncs if s.step_kind == "decode"})
    return engine.outputs(), digests, decode_collectives


def main() -> None:
    # 1. Not covered yet: the backend refuses rather than letting replicas drift apart.
    refused = launch(run_rank, 2, False, timeout_s=300)
    print("without a pattern, every rank refuses:\n", refused[0][1], "\n")

    # 2. Covered: the single-rank reference, then the same workload decode-sharded on 2 gloo ranks.
    pcppass.register_pattern(STORE_KV, replace=True)
    reference = Engine(TinyLM(), **ENGINE)
    reference.add_requests(REQUESTS)
    expected = reference.run()
    (out0, dig0, coll0), (out1, dig1, _) = launch(run_rank, 2, True, timeout_s=300)
    assert out0 == out1 == expected, "tokens differ from the single-rank run"
    assert dig0 == dig1, "replicas diverged"
    print(f"{len(dig0)} steps on 2 ranks: tokens equal to one rank, every cache identical after "
          f"every step, decode steps used {coll0} collective(s) for all state sync")


if __name__ == "__main__":
    main()
