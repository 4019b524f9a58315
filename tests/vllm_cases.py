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

HERE = Path(__file__).resolve().parent

#: prompts (token ids) every vLLM test generates from
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 7, 18, 28], [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122],
           [5, 6], [400, 401, 402, 403, 404, 405]]
MAX_TOKENS = 8

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


BUILDERS = {"llama": build_llama, "deepseek_v2": build_deepseek_v2}
#: MoE models (built and referenced by their own fixtures: only the MoE tests pay for them)
MOE_BUILDERS = {"qwen3_moe": build_qwen3_moe, "mixtral": build_mixtral, "deepseek_v2_moe": build_deepseek_v2_moe}


def vllm_env(*, layername: bool = True, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_ENV)
    env.update(OMP_NUM_THREADS="2", VLLM_USE_LAYERNAME="1" if layername else "0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def start_worker(task: str, model_dir: Path, *, layername: bool = True, timeout_s: float = 300,
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
