"""This rank's membership of the ``torch.distributed`` group: rendezvous, join and leave, the MIN all-reduce.

Rank 0 opens a TCP store on an OS-chosen port, every rank joins through it
with the backend ``kvledger.worker.device`` picks (NCCL between GPUs, gloo
between CPUs), each generation of the group under its own key prefix so a
re-formed group never reads a stale key. The MIN all-reduce of block counts is
what makes every rank's ledger the same size.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from kvledger.worker.device import dist_backend


class ProcessGroup:
    """The default ``torch.distributed`` process group of this process, as one rank of ``world_size``."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend = dist_backend(device)
        self._store: dist.TCPStore | None = None

    @property
    def joined(self) -> bool:
        return dist.is_initialized()

    def open_store(self, host: str, timeout_s: float) -> int:
        """Rank 0: open the rendezvous store on an OS-chosen free port; returns the port."""
        if self.rank != 0:
            raise RuntimeError(f"only rank 0 opens the store, this is rank {self.rank}")
        self._store = dist.TCPStore(host, 0, self.world_size, is_master=True,
                                    timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        return self._store.port

    def join(self, host: str, port: int, timeout_s: float, generation: int = 0) -> str:
        """Join the group at ``host:port`` (leaving any earlier one); returns the backend."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if host in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo's sockets on loopback
        timeout = timedelta(seconds=timeout_s)
        if self.rank != 0:
            self._store = dist.TCPStore(host, port, self.world_size, is_master=False, timeout=timeout)
        assert self._store is not None, "rank 0 joins after open_store"
        store = dist.PrefixStore(f"g{generation}", self._store)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size,
                                timeout=timeout)
        return self.backend

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None

    def all_reduce_min(self, values: tuple[int, ...]) -> tuple[int, ...]:
        """The element-wise minimum of ``values`` over every rank of the group."""
        dev = self.device if self.backend == "nccl" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return tuple(int(v) for v in t.tolist())
