"""vLLM's host tier through the router on a GPU machine: the real path the CPU build cannot run here.

vLLM's CPU offloading needs a CUDA (or XPU) device ("CPU Offloading is currently only supported on CUDA-alike
and XPU GPUs" on the CPU build), so this script is the check where one is lent. It starts a vLLM server with
offloading on (``--kv-offloading-size``, self-describing events) and a KV pool small enough to evict, puts a
router in front of it, then:

1. serves prompt A, and floods the device with other prompts until the index shows A on the host tier only;
2. serves A again: vLLM onboards it from host memory (its cached tokens say so), and the engine's metrics give
   the router a measured onboard time per block (``/v1/cluster`` shows ``onboard_s_per_block``).

``--dp N`` starts the server with ``--data-parallel-size N`` (N GPUs): each engine core is then a rank of its
own, and the check runs on each. It prints one JSON line per engine core and exits 1 if a check failed, 0 with
``{"skipped": ...}`` where no CUDA vLLM or GPU is there. Usage::

    VLLM_PYTHON=/path/to/cuda-vllm-venv/bin/python python benchmarks/gpu_vllm_tier.py [--model PATH] [--dp 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO / "tests"))   # the real vLLM harness the suite uses
from vllm_engines import VllmServer, write_tiny_checkpoint  # noqa: E402

from kvledger.router.config import RouterConfig  # noqa: E402
from kvledger.router.engine import Generation  # noqa: E402
from kvledger.router.service import RouterService  # noqa: E402

BLOCK = 16
WAIT_S = 120.0
SELF_DESCRIBING = '{"kv_connector_extra_config": {"self_describing_kv_events": true}}'


def cuda_python() -> Path | None:
    """``$VLLM_PYTHON`` if it imports vLLM and sees a GPU."""
    python = os.environ.get("VLLM_PYTHON")
    if not python:
        return None
    probe = subprocess.run([python, "-c", "import torch, vllm; assert torch.cuda.is_available()"],
                           capture_output=True, timeout=300)
    return Path(python) if probe.returncode == 0 else None


def cuda_setup(model: str | None, prefix: str) -> tuple[Path, Path, Path] | None:
    """The CUDA vLLM's python, a fresh work folder and the checkpoint (``model``, else the tiny one written there);
    ``None``, with the ``skipped`` line printed, where there is no CUDA vLLM."""
    python = cuda_python()
    if python is None:
        print(json.dumps({"skipped": "no CUDA vLLM: set VLLM_PYTHON to a venv whose vllm sees a GPU"}))
        return None
    work = Path(tempfile.mkdtemp(prefix=prefix))
    return python, work, Path(model) if model else write_tiny_checkpoint(work / "tiny", python)


def prompt(first: int, n: int) -> list[int]:
    return [first, *(3 + (first * 31 + i * 7) % 256 for i in range(n - 1))]


def check_core(service: RouterService, rank: int, first: int, blocks: int) -> dict:
    """Steps 1 and 2 of the module docstring on one engine core; what was seen."""
    engine = service.engines.engine(rank)
    a = prompt(first, 20 * BLOCK + 1)
    generate = engine.generate
    generate(Generation(1, a, 1))
    deadline, flood = time.monotonic() + WAIT_S, 0
    while service.probe(a)[rank].host_tokens < 20 * BLOCK and time.monotonic() < deadline:   # bounded: WAIT_S
        flood += 1
        generate(Generation(1 + flood, prompt(first + flood, blocks * BLOCK // 2), 1))
        time.sleep(0.2)
    seen = service.probe(a)[rank]
    again = generate(Generation(10_000, a, 1))
    service.refresh_loads(force=True)
    load = engine.load()
    return {"rank": rank, "dp_rank": engine.info().data_parallel_rank, "flood_prompts": flood,
            "probe_before": {"matched": seen.matched_tokens, "device": seen.device_tokens, "host": seen.host_tokens},
            "cached_tokens_again": again.cached_tokens, "onboard_s_per_block": load.onboard_s_per_block,
            "ok": seen.host_tokens == 20 * BLOCK and again.cached_tokens >= 20 * BLOCK
            and load.onboard_s_per_block is not None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a checkpoint path (default: the suite's tiny random Llama)")
    ap.add_argument("--dp", type=int, default=1, help="--data-parallel-size (one GPU each)")
    ap.add_argument("--blocks", type=int, default=64, help="device KV blocks per engine core (small: it must evict)")
    args = ap.parse_args()
    setup = cuda_setup(args.model, "kvledger-gpu-tier-")
    if setup is None:
        return 0
    python, work, model = setup
    server = VllmServer(python, model, work, block_size=BLOCK, data_parallel_size=args.dp,
                        args=("--num-gpu-blocks-override", str(args.blocks), "--kv-offloading-size", "1",
                              "--kv-transfer-config", SELF_DESCRIBING))
    server.start()
    try:
        server.wait_ready()
        service = RouterService(None, RouterConfig(tokens_per_block=BLOCK, vllm=(server.url,), policy="kv"))
        try:
            results = [check_core(service, rank, 5 + 40 * i, args.blocks)
                       for i, rank in enumerate(sorted(service.engines.added()))]
        finally:
            service.close()
    finally:
        server.stop()
    for r in results:
        print(json.dumps(r))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
