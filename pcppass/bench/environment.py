"""What a published number was measured on: device, versions, date, the multicast-off settings."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

import torch

#: NVLink multicast stays off on the shared GPU hosts (it can take their GPUs out of service)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def keep_multicast_off() -> None:
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            env["nccl"] = None
    else:
        env["device"] = "cpu"
    env["env"] = {k: os.environ.get(k) for k in SAFE_ENV}
    return env


def default_tag(kind: str, world: int) -> str:
    device = torch.cuda.get_device_name(0).replace(" ", "-") if torch.cuda.is_available() else "cpu"
    return f"{kind}_{device}_P{world}_{datetime.date.today().isoformat()}"
