"""The ledger across processes: block keys pickled into another interpreter, and ranks agreeing their window
block counts over a real gloo group (spawned processes, so these are integration tests)."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys

import torch

from kvledger.worker.ledger import CacheConfig
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.block_key import BlockKey

T = 4


def test_a_block_key_from_another_process_finds_its_equal():
    """Keys keep their Python hash for the tree's lookups; that hash differs per process (strings are salted), so a
    key that crossed a process boundary must hash anew, or its equal in this process's tree would not be found."""
    code = ("import pickle, sys; from kvledger.worker.wire.block_key import BlockKey; "
            "k = BlockKey((1, 2, 3, 4), None, 7, (('img', 0),), 'salt'); hash(k); "
            "sys.stdout.buffer.write(pickle.dumps(k))")
    here = BlockKey((1, 2, 3, 4), None, 7, (("img", 0),), "salt")
    children = {here: "node"}
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        there = pickle.loads(out)
        assert there == here and children.get(there) == "node"


def _agree(rank: int, primary_blocks: int, ports: mp.Queue, out: mp.Queue) -> None:
    """One rank of two: form a gloo group on 127.0.0.1 and agree every window's block counts."""
    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu",
                      attention_windows=(8, None), window_shares=(1, 3), num_primary_blocks=primary_blocks,
                      num_secondary_blocks=4)
    w = RankWorker(rank, 2, cfg)
    port = w.open_store("127.0.0.1", 30) if rank == 0 else ports.get(timeout=60)
    if rank == 0:
        ports.put(port)
    w.join_group("127.0.0.1", port, 30)
    try:
        out.put((rank, w.local_block_counts(), w.agree_block_counts(), w.manager.window_block_counts))
    finally:
        w.leave_group()


def test_ranks_agree_every_windows_block_counts_by_the_min_all_reduce() -> None:
    ctx = mp.get_context("spawn")
    ports, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_agree, args=(rank, blocks, ports, out)) for rank, blocks in ((0, 40), (1, 24))]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    # a quarter of the bytes to window 0, three quarters to window 1 (each block holds one layer of two)
    assert [local for _, local, _, _ in got] == [(20, 2, 60, 6), (12, 2, 36, 6)]
    assert all(agreed == (12, 2, 36, 6) and windows == ((12, 2), (36, 6)) for _, _, agreed, windows in got)
