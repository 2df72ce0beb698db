"""The attention-window rule the ledger admits by and the router probes by: which blocks a query reads.

A query at position ``p`` of a layer with a window of ``w`` tokens attends to
the keys at positions ``p - w < q <= p`` (itself included, ``w`` keys at most);
under full attention (``w = None``) to every earlier key. Kept here, in the
wire package, so the worker and the router share one definition.
"""
from __future__ import annotations


def first_needed_block(window: int | None, pos: int, tokens_per_block: int) -> int:
    """The first block that a query at ``pos``, or any later one, reads through ``window`` (0: full attention)."""
    return 0 if window is None else max(0, (pos - window + 1) // tokens_per_block)
