"""Tiny random models vLLM loads from a directory, prompts, and subprocess helpers for the vLLM job.

The models are built here with transformers (random weights, fixed seed, no hub): a Llama with
grouped-query attention (4 heads, 2 KV heads, head size 32) and a DeepSeek-V2 with MLA (vLLM's CPU
MLA kernel takes only ``kv_lora_rank=512`` with a 64-wide RoPE part, so a 576-wide latent row).

vLLM's engine and its environment flags (``VLLM_USE_LAYERNAME`` is read at import) are
process-global, so each vLLM run is its own process: :func:`run_worker` starts
``tests/vllm_worker.py`` with the given environment and returns the JSON it prints last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# the prompts every vLLM test generates from, and how many tokens vLLM's reference generates
from pcppass.integrations.vllm.sharded_check import MAX_TOKENS, PROMPTS  # noqa: F401

HERE = Path(__file__).resolve().parent

#: vLLM on the CPU for the tests: its CPU platform, a small KV cache, the engine core in the
#: calling process (so a backend's reports can be read), no compile caches (a hit skips backends)
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_DISABLE_COMPILE_CACHE": "1",
    "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def build_llama(path: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=256, vocab_size=512,
                                   max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def build_deepseek_v2(path: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV2Config(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=2, vocab_size=512, max_position_embeddings=256,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)
    transformers.DeepseekV2ForCausalLM(cfg).save_pretrained(path)
    return path


def build_qwen3_moe(path: Path) -> Path:
    """Qwen3-MoE: 4 experts, top-2, MoE in every layer, no shared expert (``moe_forward``)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=256, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=512, max_position_embeddings=256)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


def build_mixtral(path: Path) -> Path:
    """Mixtral: 4 experts, top-2 in every layer."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, vocab_size=512,
        max_position_embeddings=256)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    return path


def build_deepseek_v2_moe(path: Path) -> Path:
    """DeepSeek-V2 with MoE in every layer and a shared expert (``moe_forward_shared``), MLA."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV2Config(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, vocab_size=512,
        max_position_embeddings=256, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32)
    transformers.DeepseekV2ForCausalLM(cfg).save_pretrained(path)
    return path


def build_mamba2(path: Path) -> Path:
    """Mamba2: two Mamba2 layers (``vllm::mamba_mixer2``), no attention."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(num_heads=4, head_dim=32, hidden_size=64, expand=2, state_size=16, n_groups=1,
                                    num_hidden_layers=2, vocab_size=512, conv_kernel=4, chunk_size=64,
                                    tie_word_embeddings=False)
    transformers.Mamba2ForCausalLM(cfg).save_pretrained(path)
    return path


def build_granite_moe_hybrid(path: Path) -> Path:
    """GraniteMoeHybrid: a Mamba2 layer, then an attention layer, MoE with a shared expert."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GraniteMoeHybridConfig(
        hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=64, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_n_groups=1,
        mamba_d_state=16, mamba_d_head=64, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
        position_embedding_type="rope")
    transformers.GraniteMoeHybridForCausalLM(cfg).save_pretrained(path)
    return path


def build_nemotron_h(path: Path, **state) -> Path:
    """NemotronH: a Mamba2 layer then an attention layer (``state`` overrides the Mamba2 sizes)."""
    import torch
    import transformers

    torch.manual_seed(0)
    sizes = dict(ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=32, n_groups=1, conv_kernel=4,
                 layers_block_type=["mamba", "attention"])
    sizes.update(state)
    cfg = transformers.NemotronHConfig(hidden_size=128, vocab_size=512, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=32, max_position_embeddings=256, intermediate_size=256, expand=1,
                                       chunk_size=64, **sizes)
    transformers.NemotronHForCausalLM(cfg).save_pretrained(path)
    return path


def build_lfm2(path: Path) -> Path:
    """LFM2: a short-convolution layer (``vllm::short_conv``), then attention. vLLM reads LFM2's
    ``conv_dim`` and ``block_*`` keys, which transformers' config does not write."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Lfm2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, conv_L_cache=3,
                                  layer_types=["conv", "full_attention"], block_multiple_of=64,
                                  block_auto_adjust_ff_dim=False, initializer_range=0.2)
    cfg.conv_dim, cfg.block_dim, cfg.block_ff_dim = 128, 128, 256
    transformers.Lfm2ForCausalLM(cfg).save_pretrained(path)
    return path


def build_qwen3_next(path: Path, **linear) -> Path:
    """Qwen3-Next in bfloat16 (vLLM's CPU gated delta net takes only bfloat16 and 128-wide
    heads): a gated delta net layer, then attention, MoE with a shared expert (``linear``
    overrides the delta net's sizes and layers). Weights drawn wider than transformers' default,
    so that no two logits of the greedy tokens lie within a bfloat16 rounding of each other."""
    import torch
    import transformers

    torch.manual_seed(0)
    sizes = dict(linear_num_key_heads=1, linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"])
    sizes.update(linear)
    cfg = transformers.Qwen3NextConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=len(sizes["layer_types"]), num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, vocab_size=512, max_position_embeddings=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, initializer_range=0.2,
        dtype="bfloat16", **sizes)
    transformers.Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def build_nemotron_h_8b_state(path: Path) -> Path:
    """One Mamba2 layer with NemotronH-8B's state sizes (128 heads of 64, 8 groups, state 128)."""
    return build_nemotron_h(path, ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64, n_groups=8,
                            layers_block_type=["mamba"])


def build_qwen3_next_80b_state(path: Path) -> Path:
    """One gated delta net layer with Qwen3-Next-80B-A3B's sizes (16 key and 32 value heads of 128)."""
    return build_qwen3_next(path, linear_num_key_heads=16, linear_num_value_heads=32, layer_types=["linear_attention"])


BUILDERS = {"llama": build_llama, "deepseek_v2": build_deepseek_v2}
#: MoE models (built and referenced by their own fixtures: only the MoE tests pay for them)
MOE_BUILDERS = {"qwen3_moe": build_qwen3_moe, "mixtral": build_mixtral, "deepseek_v2_moe": build_deepseek_v2_moe}
#: hybrid models with recurrent-state layers (built and referenced by their own fixtures)
HYBRID_BUILDERS = {"nemotron_h": build_nemotron_h, "qwen3_next": build_qwen3_next, "lfm2": build_lfm2,
                   "mamba2": build_mamba2, "granite_moe_hybrid": build_granite_moe_hybrid}
#: the hybrids the vLLM job shards (Mamba2 and gated delta net; every vLLM reference run costs the
#: job most of a minute)
HYBRID_SHARDED = ("nemotron_h", "qwen3_next")
#: one state layer at a production model's widths (the batch-invariance check)
WIDE_STATE_BUILDERS = {"nemotron_h_8b_state": build_nemotron_h_8b_state,
                       "qwen3_next_80b_state": build_qwen3_next_80b_state}
#: vLLM engine arguments a model needs beyond the defaults: bfloat16 for the CPU gated delta net;
#: every hybrid without prefix caching (vLLM's prefix caching for state layers is refused)
HYBRID_ENGINE_ARGS = {name: {"enable_prefix_caching": False} for name in (*HYBRID_BUILDERS, *WIDE_STATE_BUILDERS)}
for _name in ("qwen3_next", "qwen3_next_80b_state"):
    HYBRID_ENGINE_ARGS[_name]["dtype"] = "bfloat16"


def vllm_env(*, layername: bool = True, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_ENV)
    env.update(OMP_NUM_THREADS="2", VLLM_USE_LAYERNAME="1" if layername else "0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def start_worker(task: str, model_dir: Path | None, *, layername: bool = True, timeout_s: float = 300,
                 **options) -> subprocess.Popen:
    """Start ``tests/vllm_worker.py`` on ``task`` (see there); :func:`finish_worker` waits."""
    args = json.dumps({"task": task, "model_dir": str(model_dir), **options})
    proc = subprocess.Popen([sys.executable, str(HERE / "vllm_worker.py"), args],
                            env=vllm_env(layername=layername), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    proc.timeout_s = timeout_s  # type: ignore[attr-defined]
    return proc


def finish_worker(proc: subprocess.Popen) -> dict:
    """The JSON the worker printed last; its output in the error when it failed."""
    try:
        out, _ = proc.communicate(timeout=proc.timeout_s)  # type: ignore[attr-defined]
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"vLLM worker timed out:\n{out[-6000:]}") from None
    marker = "PCPPASS_RESULT "
    lines = [line for line in out.splitlines() if line.startswith(marker)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"vLLM worker exited {proc.returncode}:\n{out[-6000:]}")
    return json.loads(lines[-1][len(marker):])


def run_worker(task: str, model_dir: Path, **kwargs) -> dict:
    return finish_worker(start_worker(task, model_dir, **kwargs))


class BackgroundReferences:
    """vLLM runs started in the background, all in one worker process (``generate_each``):
    :meth:`results` waits for it once and keeps what each run returned, :meth:`tokens` their tokens."""

    def __init__(self, runs: dict[str, dict]) -> None:
        self._proc = start_worker("generate_each", None, runs=runs, timeout_s=1500)
        self._results: dict[str, dict] | None = None

    def results(self) -> dict[str, dict]:
        if self._results is None:
            self._results = finish_worker(self._proc)
        return self._results

    def tokens(self) -> dict[str, list[list[int]]]:
        return {name: result["tokens"] for name, result in self.results().items() if "tokens" in result}

    def stop(self) -> None:
        """Kill the worker if nobody waited for it (a failed or deselected test)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate()
