"""The one place that decides CUDA or CPU, NCCL or gloo, pinned or pageable host memory.

Everything else asks here, so a machine without CUDA falls back the same way in
every module (``pin_memory=True`` raises where CUDA is absent).
"""
from __future__ import annotations

from typing import Literal

import torch

DeviceChoice = Literal["auto", "cpu", "cuda"]


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(choice: str) -> torch.device:
    """Map a user's ``auto|cpu|cuda[:N]`` to a device; ``auto`` takes CUDA where it exists."""
    if choice == "auto":
        return torch.device("cuda" if cuda_available() else "cpu")
    if choice == "cpu":
        return torch.device("cpu")
    if choice.startswith("cuda"):
        if not cuda_available():
            raise ValueError(f"device {choice!r} was asked for but CUDA is not available here; use 'auto' or 'cpu'")
        return torch.device(choice)
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {choice!r}")


def host_pin_memory() -> bool:
    """Host buffers are pinned only where CUDA exists: pinning is for DMA to a GPU."""
    return cuda_available()


def dist_backend(device: torch.device) -> Literal["nccl", "gloo"]:
    """NCCL between GPUs, gloo between CPU ranks."""
    return "nccl" if device.type == "cuda" else "gloo"
