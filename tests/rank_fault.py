"""Kill one rank of a decode-sharded engine with SIGKILL in the middle of a step, and watch its peers.

The model is the tiny Llama with one extra op at the end of its forward,
``faulttest::die_if_armed``: on the victim rank, in the armed step, it records the time and sends
itself SIGKILL. The victim has then written its own cache rows but not joined the step's sync
collective, which its peers are about to enter (deferred sync of a decode step, or the immediate
syncs and the engine's hidden-row all-gather of a mixed step). Each surviving rank reports what it
raised and how long after the SIGKILL, then stays alive ``linger_s`` (as a server would).

Used by ``tests/test_fault_rank_death.py`` (gloo) and, on a machine with 2 GPUs, as a script::

    python tests/rank_fault.py --backend nccl --out fault_nccl.json

which prints and writes a JSON summary (outcome per rank, exit codes, ranks still hanging).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue as queue_mod
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pcppass.checks import SyncChecks
from pcppass.engine.launch import free_port
from pcppass.runtime import liveness

#: process-group timeout in the gloo cases: far above the bound the test asserts
GLOO_PG_TIMEOUT_S = 120.0
#: the peers must have raised within this long after the victim's SIGKILL
GLOO_BOUND_S = 10.0
#: a peer stays alive this long after its error, as a server would: a peer that fails only
#: because another peer's process exited would fail after this, past the bound
LINGER_S = 12.0
#: every surviving process must have exited within this long after the last answer
EXIT_BOUND_S = LINGER_S + 20.0

_ARMED = {"on": False, "record": "", "fault": "sigkill"}


class InjectedFault(RuntimeError):
    """The victim's own error in ``fault="raise"`` cases (not a pcppass error)."""


@torch.library.custom_op("faulttest::die_if_armed", mutates_args=())
def die_if_armed(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` unchanged; when armed, record the time in the death file and SIGKILL this process
    (``fault="raise"``: raise :class:`InjectedFault` instead, the process stays alive)."""
    if _ARMED["on"]:
        with open(_ARMED["record"], "w") as f:
            f.write(repr(time.time()))
            f.flush()
            os.fsync(f.fileno())
        if _ARMED["fault"] == "raise":
            _ARMED["on"] = False
            raise InjectedFault("injected fault on the victim rank")
        os.kill(os.getpid(), signal.SIGKILL)
    return hidden.clone()


@die_if_armed.register_fake
def _(hidden):
    return torch.empty_like(hidden)


def build_dying_llama(device: str = "cpu") -> torch.nn.Module:
    from pcppass.models import build_model

    model = build_model("llama", "tiny", device=device)
    plain_forward = type(model).forward

    def forward(self, input_ids, positions, meta, caches):
        return torch.ops.faulttest.die_if_armed(plain_forward(self, input_ids, positions, meta, caches))

    model.forward = forward.__get__(model)
    return model


@dataclass
class FaultCase:
    world: int
    victim: int
    #: the victim dies in the first step of this kind from step ``after`` on
    step_kind: str
    after: int = 4
    backend: str = "gloo"
    pg_timeout_s: float = GLOO_PG_TIMEOUT_S
    linger_s: float = LINGER_S
    #: "sigkill": the victim dies; "raise": it raises an error of its own and stays alive
    fault: str = "sigkill"
    #: the survivors sleep this long before the armed step (the victim dies at its start):
    #: they are not in a collective when the liveness watch declares the victim dead
    pause_s: float = 0.0
    #: rank 0 sleeps this long before step ``after - 1`` while its peers wait for it in that
    #: step's collectives: a slow peer, alive, whose heartbeat goes on (never declared dead)
    stall_s: float = 0.0
    liveness_timeout_s: float = SyncChecks.liveness_timeout_s
    liveness_interval_s: float = SyncChecks.liveness_interval_s


@dataclass
class RankOutcome:
    rank: int
    steps_done: int
    error: str | None = None
    message: str = ""
    #: seconds from the victim's SIGKILL to this rank's exception
    after_death_s: float | None = None
    armed_step: int | None = None
    kinds: list[str] = field(default_factory=list)
    #: whether the liveness watch had declared a peer dead or failed when the armed step began
    declared_before_step: bool | None = None


def _rank_main(rank: int, case: FaultCase, port: int, death_file: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = "cpu"
    if case.backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(case.backend, rank=rank, world_size=case.world,
                            timeout=datetime.timedelta(seconds=case.pg_timeout_s))
    outcome = RankOutcome(rank, 0)
    try:
        from pcppass.engine.workload import RequestSpec
        from pcppass.registry import load_builtin_patterns
        from pcppass.sharded import ShardedRunner, sharded_engine

        load_builtin_patterns()
        model = build_dying_llama(device)
        checks = SyncChecks(liveness_timeout_s=case.liveness_timeout_s, liveness_interval_s=case.liveness_interval_s)
        runner = ShardedRunner(model, inner="eager", checks=checks)
        engine = sharded_engine(model, runner, world=case.world, rank=rank, device=device, num_blocks=48,
                                max_num_seqs=8)
        gen = torch.Generator().manual_seed(5)
        for i in range(8):
            engine.add_request(RequestSpec(req_id=i, prompt=tuple(torch.randint(1, 100, (6,), generator=gen).tolist()),
                                           max_new_tokens=8, arrival_step=2 * i))
        for index in range(40):
            step = engine.scheduler.schedule()
            outcome.kinds.append(step.step_kind)
            if index >= case.after and step.step_kind == case.step_kind and outcome.armed_step is None:
                outcome.armed_step = index
                if rank == case.victim:
                    _ARMED.update(on=True, record=death_file, fault=case.fault)
                else:
                    time.sleep(case.pause_s)
                    watch = liveness.watch_of(None)
                    outcome.declared_before_step = watch is not None and watch.verdict is not None
            if index == case.after - 1 and rank == 0:
                time.sleep(case.stall_s)
            engine.execute(step)
            outcome.steps_done += 1
    except Exception as exc:
        raised = time.time()
        outcome.error, outcome.message = type(exc).__name__, str(exc)[:2000]
        if os.path.exists(death_file):
            with open(death_file) as f:
                outcome.after_death_s = raised - float(f.read())
    except BaseException:
        outcome.error, outcome.message = "BaseException", traceback.format_exc()[-2000:]
    results.put(asdict(outcome))
    time.sleep(case.linger_s)


def run_fault_case(case: FaultCase, deadline_s: float) -> dict:
    """Start the ranks, wait for the survivors' outcomes (at most ``deadline_s``), then for their
    exit; every process still alive after that is killed and reported as hung."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        death_file = os.path.join(tmp, "death")
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, case, port, death_file, results), daemon=True)
                 for r in range(case.world)]
        start = time.monotonic()
        for p in procs:
            p.start()
        outcomes: dict[int, dict] = {}
        exited: dict[int, float] = {}  # rank -> wall-clock time its process was first seen gone

        def poll_exits() -> None:
            for r, p in enumerate(procs):
                if r not in exited and not p.is_alive():
                    exited[r] = time.time()

        # a victim that raises (fault="raise") reports its own error too
        survivors = case.world if case.fault == "raise" else case.world - 1
        while len(outcomes) < survivors and time.monotonic() - start < deadline_s:
            try:
                o = results.get(timeout=0.5)
                outcomes[o["rank"]] = o
            except queue_mod.Empty:
                pass
            poll_exits()
            if len(exited) == case.world:
                break
        answered = time.monotonic()
        while len(exited) < case.world and time.monotonic() - answered < EXIT_BOUND_S:
            time.sleep(0.2)
            poll_exits()
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
        for p in procs:
            p.join(timeout=5.0)
        death = None
        if os.path.exists(death_file):
            with open(death_file) as f:
                death = float(f.read())
        return {"case": asdict(case), "outcomes": {str(r): o for r, o in sorted(outcomes.items())},
                "exitcodes": [p.exitcode for p in procs], "hung": hung,
                # seconds from the victim's SIGKILL to each process being seen gone (0.2-0.5 s polls)
                "exit_after_death_s": {str(r): round(t - death, 2) if death else None
                                       for r, t in sorted(exited.items())},
                "wall_s": round(time.monotonic() - start, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--step-kind", default="decode", choices=("decode", "mixed"))
    parser.add_argument("--pg-timeout", type=float, default=30.0)
    parser.add_argument("--deadline", type=float, default=90.0)
    parser.add_argument("--linger", type=float, default=0.0)
    parser.add_argument("--fault", default="sigkill", choices=("sigkill", "raise"))
    parser.add_argument("--liveness-timeout", type=float, default=SyncChecks.liveness_timeout_s)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    case = FaultCase(args.world, args.victim, args.step_kind, backend=args.backend, pg_timeout_s=args.pg_timeout,
                     linger_s=args.linger, fault=args.fault, liveness_timeout_s=args.liveness_timeout)
    summary = run_fault_case(case, args.deadline)
    summary.update(torch=torch.__version__, cuda=torch.version.cuda,
                   device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   env={k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL"))})
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    sys.exit(0)


if __name__ == "__main__":
    main()
