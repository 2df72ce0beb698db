"""What the tests of a router over a real local Ray cluster share: prompts of a test's own, and a bounded wait."""
from __future__ import annotations

import time

from kvledger.worker.engine.tokenizer import encode

#: Seconds any call to the cluster or the router may take.
TIMEOUT = 60
SYSTEM = "You are a terse assistant. Answer with one word only, please.\n"   # 63 bytes; with "Q" 8 blocks


def system(tag: str) -> str:
    """A system prompt as long as ``SYSTEM`` that is this test's own (``tag`` begins with its own letter)."""
    p = f"{tag}: {SYSTEM}"[:len(SYSTEM) - 1] + "\n"
    assert len(encode(p)) == len(encode(SYSTEM)), p
    return p


def wait_for(cond, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)   # another process's push: nothing local to wait on
