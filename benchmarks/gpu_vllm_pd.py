"""Prefill and decode across two vLLM servers with NIXL on a GPU machine: the path the CPU build cannot run here.

vLLM's CPU build runs only the example shared-storage connector (``tests/vllm/test_router_vllm_pd.py``);
``NixlConnector`` needs a GPU. Where one is lent, this script starts two servers on it (``kv_both`` each, a
NIXL side channel and a share of the GPU's memory each), puts the router in front (``--vllm-prefill`` the
first, ``--vllm`` the second, ``--split-mode always``), then:

1. asks the prefill server directly for a remote decode: its answer's ``kv_transfer_params`` must name where
   its blocks are (``remote_engine_id``, ``remote_block_ids``): what the router hands the decode server;
2. computes a prompt from scratch on the decode server (greedy), then empties its prefix cache;
3. sends the prompt through the router: prefilled on the first server, decoded on the second from the blocks
   NIXL pulled (its ``cached_tokens``), with the tokens of step 2.

It prints one JSON line and exits 1 if a check failed, 0 with ``{"skipped": ...}`` where no CUDA vLLM or GPU
is there. Usage::

    VLLM_PYTHON=/path/to/cuda-vllm-venv/bin/python python benchmarks/gpu_vllm_pd.py [--model PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx
from gpu_vllm_tier import cuda_setup, prompt
from vllm_engines import VllmServer, free_port

from kvledger.router.config import RouterConfig
from kvledger.router.kv_connector import PREFILL_PARAMS
from kvledger.router.service import RouterService

BLOCK = 16
NIXL = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})


def start(python: Path, model: Path, work: Path) -> VllmServer:
    """A server with NIXL on half the GPU; its side channel on a port of its own (read from the environment)."""
    work.mkdir()
    server = VllmServer(python, model, work, block_size=BLOCK,
                        args=("--kv-transfer-config", NIXL, "--gpu-memory-utilization", "0.4"))
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    server.start()
    return server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a checkpoint path (default: the suite's tiny random Llama)")
    args = ap.parse_args()
    setup = cuda_setup(args.model, "kvledger-gpu-pd-")
    if setup is None:
        return 0
    python, work, model = setup
    servers = [start(python, model, work / name) for name in ("prefill", "decode")]
    try:
        for server in servers:
            server.wait_ready()
        prefill, decode = servers
        name = prefill.model_name
        with httpx.Client(timeout=120.0) as http:
            asked = http.post(f"{prefill.url}/v1/completions", json={
                "model": name, "prompt": prompt(3, 20 * BLOCK), "max_tokens": 1,
                "kv_transfer_params": PREFILL_PARAMS}).json().get("kv_transfer_params") or {}
            tokens = prompt(5, 20 * BLOCK + 3)
            want = http.post(f"{decode.url}/v1/completions", json={
                "model": name, "prompt": tokens, "max_tokens": 8, "temperature": 0,
                "return_token_ids": True}).json()["choices"][0]["token_ids"]
            http.post(f"{decode.url}/reset_prefix_cache").raise_for_status()
        service = RouterService(None, RouterConfig(tokens_per_block=BLOCK, vllm=(decode.url,),
                                                   vllm_prefill=(prefill.url,), split_mode="always"))
        try:
            got = service.complete(tokens, max_tokens=8, fields={"temperature": 0})
        finally:
            service.close()
    finally:
        for server in servers:
            server.stop()
    result = {"prefill_answered": sorted(asked), "split": got.phases.prefill_rank is not None,
              "cached_tokens": got.cached_tokens, "same_tokens": got.output_tokens == want,
              "prefill_s": got.phases.prefill_s}
    result["ok"] = bool(asked.get("remote_block_ids")) and result["split"] and \
        got.cached_tokens >= 20 * BLOCK and result["same_tokens"]
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
