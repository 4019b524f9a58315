"""Deterministic request streams and the draft proposer for speculative verify rows.

:func:`generate_workload` turns a :class:`WorkloadConfig` and its seed into the same requests on
every rank and every run (Python's ``random.Random``, no global state). The prefix-hit-rate knob
mirrors the benchmarks behind decode sharding (80-99% hit rates): every prompt starts with the
block-aligned ``floor(rate * len / block_size) * block_size`` tokens of one common prefix, the rest
is request-specific.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RequestSpec:
    """One request: prompt tokens, how many tokens to generate, when it arrives."""

    req_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0
    #: tokens per decode row: the last sampled token plus ``spec_width - 1`` draft tokens
    spec_width: int = 1


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = 8
    prompt_len: tuple[int, int] = (8, 32)  # inclusive range
    max_new_tokens: tuple[int, int] = (4, 12)  # inclusive range
    #: mean steps between consecutive arrivals (0: everything arrives at step 0)
    mean_arrival_gap: float = 0.0
    prefix_hit_rate: float = 0.0
    #: alignment of the shared prefix (the block size of the "full" cache groups)
    block_size: int = 16
    vocab_size: int = 256
    spec_width: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.prefix_hit_rate <= 1.0:
            raise ValueError(f"prefix_hit_rate must be in [0, 1], got {self.prefix_hit_rate}")
        if self.prompt_len[0] < 1 or self.prompt_len[0] > self.prompt_len[1]:
            raise ValueError(f"bad prompt_len range {self.prompt_len}")
        if self.max_new_tokens[0] < 1 or self.max_new_tokens[0] > self.max_new_tokens[1]:
            raise ValueError(f"bad max_new_tokens range {self.max_new_tokens}")
        if self.spec_width < 1:
            raise ValueError(f"spec_width must be >= 1, got {self.spec_width}")


def generate_workload(cfg: WorkloadConfig) -> list[RequestSpec]:
    rng = random.Random(cfg.seed)
    # Token 0 is the padding id; prompts avoid it so a padding row never looks like a prompt token.
    common = [rng.randrange(1, cfg.vocab_size) for _ in range(cfg.prompt_len[1])]
    out = []
    step = 0
    for i in range(cfg.num_requests):
        plen = rng.randint(*cfg.prompt_len)
        shared = int(cfg.prefix_hit_rate * plen) // cfg.block_size * cfg.block_size
        prompt = common[:shared] + [rng.randrange(1, cfg.vocab_size) for _ in range(plen - shared)]
        out.append(
            RequestSpec(
                req_id=i,
                prompt=tuple(prompt),
                max_new_tokens=rng.randint(*cfg.max_new_tokens),
                arrival_step=step,
                spec_width=cfg.spec_width,
            )
        )
        if cfg.mean_arrival_gap > 0:
            step += rng.randint(0, int(round(2 * cfg.mean_arrival_gap)))
    return out


def ngram_draft(tokens: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """Propose ``k`` draft tokens by prompt lookup: continue the latest earlier match of the tail.

    Tries the last ``max_ngram`` tokens down to the last one; with no earlier match, repeats the
    last token. Always returns exactly ``k`` tokens, so a decode row's width depends only on the
    request's width and remaining budget.
    """
    if k <= 0:
        return []
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), 0, -1):
        tail = list(tokens[n_tok - n :])
        for start in range(n_tok - n - 1, -1, -1):
            if list(tokens[start : start + n]) == tail:
                follow = list(tokens[start + n : start + n + k])
                return follow + [follow[-1]] * (k - len(follow))
    return [tokens[-1]] * k
