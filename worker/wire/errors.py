"""Errors a rank raises that its callers handle, on either side of a process boundary.

Each keeps its constructor arguments in ``args`` so pickling (Ray sends a
remote exception as a pickle) rebuilds the same type with the same message and
fields on the caller's side.
"""
from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """The primary tier cannot supply the blocks asked for; the ledger is unchanged."""

    def __init__(self, needed: int, available: int, what: str) -> None:
        super().__init__(needed, available, what)
        self.needed = needed
        self.available = available
        self.what = what

    def __str__(self) -> str:
        return f"{self.what}: needs {self.needed} free primary blocks, {self.available} available"


class RankNotReadyError(RuntimeError):
    """The rank has no ledger yet: it (re)started and the block counts were not agreed since."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it finished (``RankWorker.abort``): it left the queue, or the running batch
    with its written KV stored for reuse."""

    def __init__(self, rank: int, request_id: int) -> None:
        super().__init__(rank, request_id)
        self.rank, self.request_id = rank, request_id

    def __str__(self) -> str:
        return f"request {self.request_id} was aborted on rank {self.rank}"
