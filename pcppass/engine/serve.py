"""A serving loop: a client that keeps ``concurrency`` requests in flight on an :class:`Engine`.

Like a benchmark client with a concurrency limit (``vllm bench serve --max-concurrency``): requests
are submitted in a fixed order, the next one as soon as one finishes, and timed on the host clock
after every engine step (the step ends when its sampled tokens are on the host, so the clock sees
the device's work):

* TTFT: submission to the step that produced the request's first token;
* TPOT: ``(finish - first token) / (output tokens - 1)``;
* E2E: submission to finish.

Every rank runs the same loop (the engine's steps are collective), so submission order, admission
and the steps are identical on all ranks; the caller reads the clock of one.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from pcppass.engine.runner import Engine, StepRecord
from pcppass.engine.workload import RequestSpec


@dataclass
class RequestTiming:
    req_id: int
    prompt_len: int
    submitted_s: float
    cached_prompt: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None
    output_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.submitted_s

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.submitted_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass
class StepTiming:
    index: int
    step_kind: str
    tokens: int
    decode_rows: int
    seconds: float


@dataclass
class ServeRun:
    """What one run of the loop measured."""

    requests: list[RequestTiming]
    steps: list[StepTiming]
    #: request ids in submission order, and in admission order (the scheduler's)
    submitted: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    started_s: float = 0.0
    finished_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.finished_s - self.started_s

    def metrics(self) -> dict[str, float]:
        """req/s, output tok/s, mean and p99 TTFT / TPOT / E2E (ms), actual prefix-hit rate."""
        done = [r for r in self.requests if r.finished_s is not None]
        out_tokens = sum(r.output_tokens for r in done)
        tpots = [r.tpot_s for r in done if r.tpot_s is not None]
        res = {"completed": len(done), "duration_s": self.duration_s,
               "request_throughput": len(done) / self.duration_s if self.duration_s > 0 else 0.0,
               "output_throughput": out_tokens / self.duration_s if self.duration_s > 0 else 0.0,
               "output_tokens": out_tokens,
               "prefix_hit_rate": sum(r.cached_prompt for r in done) / max(1, sum(r.prompt_len for r in done)),
               "steps": len(self.steps),
               "decode_steps": sum(s.step_kind == "decode" for s in self.steps)}
        for name, values in (("ttft", [r.ttft_s for r in done]), ("tpot", tpots), ("e2e", [r.e2e_s for r in done])):
            if values:
                res[f"mean_{name}_ms"] = 1000 * statistics.fmean(values)
                res[f"p99_{name}_ms"] = 1000 * percentile(values, 99)
        return res


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default)."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class ServingLoop:
    """Drive ``engine`` with ``requests`` (in this order), at most ``concurrency`` in flight.

    ``on_step(record, loop)`` is called after every step (progress display). ``max_steps`` bounds
    the run: exceeding it raises (a request that never finishes is a bug, not a result).
    """

    def __init__(self, engine: Engine, requests: Sequence[RequestSpec], concurrency: int,
                 clock: Callable[[], float] = time.perf_counter,
                 on_step: Callable[[StepRecord, "ServingLoop"], None] | None = None, max_steps: int = 1_000_000):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        ids = [r.req_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        self.engine, self.concurrency, self.clock = engine, concurrency, clock
        self.pending = deque(requests)
        self.on_step, self.max_steps = on_step, max_steps
        self.timings: dict[int, RequestTiming] = {}
        self.in_flight: set[int] = set()
        self.completed = 0

    def _submit(self, spec: RequestSpec, now: float) -> None:
        # Arrives at the current step: the scheduler may admit it in the very next step.
        spec = replace(spec, arrival_step=self.engine.scheduler.step_index)
        self.engine.add_request(spec)
        self.timings[spec.req_id] = RequestTiming(spec.req_id, len(spec.prompt), now)
        self.in_flight.add(spec.req_id)

    def run(self) -> ServeRun:
        run = ServeRun([], [], started_s=self.clock())
        seen: set[int] = set()
        for _ in range(self.max_steps):
            while self.pending and len(self.in_flight) < self.concurrency:
                spec = self.pending.popleft()
                self._submit(spec, self.clock())
                run.submitted.append(spec.req_id)
            if not self.in_flight:
                break
            t0 = self.clock()
            record = self.engine.step()
            now = self.clock()
            if record is None:
                raise RuntimeError(f"engine idle with requests in flight: {sorted(self.in_flight)}")
            for req_id, *_ in record.rows:  # a request's first row is in the step that admits it
                if req_id not in seen:
                    seen.add(req_id)
                    run.admitted.append(req_id)
            run.steps.append(StepTiming(record.index, record.step_kind, sum(r[3] for r in record.rows),
                                        sum(r[1] == "decode" for r in record.rows), now - t0))
            self._account(record, now)
            if self.on_step is not None:
                self.on_step(record, self)
        else:
            raise RuntimeError(f"requests still in flight after {self.max_steps} steps: {sorted(self.in_flight)}")
        run.finished_s = self.clock()
        run.requests = [self.timings[i] for i in run.submitted]
        return run

    def _account(self, record: StepRecord, now: float) -> None:
        sched = self.engine.scheduler
        for req_id, tokens in record.gained.items():
            timing = self.timings[req_id]
            if timing.first_token_s is None and tokens:
                timing.first_token_s = now
            timing.output_tokens += len(tokens)
        for req in sched.running:
            self.timings[req.req_id].cached_prompt = req.num_cached_prompt
        for req_id in record.finished:
            timing = self.timings[req_id]
            timing.finished_s = now
            timing.cached_prompt = sched.finished[req_id].num_cached_prompt
            self.in_flight.discard(req_id)
            self.completed += 1
