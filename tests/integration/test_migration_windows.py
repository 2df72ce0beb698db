"""A migration between rank actors of a model with attention windows, over their process group: every window's
blocks that a request past the prefix reads go from the source's pools into the target's, and the target's answer
equals the one computed from scratch. A module of its own: its two ranks take the CPUs the pools tests' hold."""
from __future__ import annotations

import dataclasses

import pytest
from migration_helpers import HEADS, TIMEOUT, T, mixed_cache, prompt, served_as_scratch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.worker.wire.request import Request

WINDOWS = (8, None, 12)   # layer 0 slides over 8 tokens, layer 1 sees all, layer 2 slides over 12: three windows


@pytest.fixture(scope="module")
def windowed_pair(ray_session):
    cache = dataclasses.replace(mixed_cache(), attention_windows=WINDOWS)
    c = Cluster.start(ClusterConfig(num_ranks=2, device="cpu", cache=cache, name_prefix="kvledger-windows-rank",
                                    group_timeout_s=30, call_timeout_s=TIMEOUT))
    yield c
    c.shutdown()


def test_a_windowed_prefix_migrates_over_the_process_group_into_every_windows_pools(windowed_pair):
    """Each window sends the blocks the target lacks of those a query past the prefix reads: the full window its
    whole prefix past what the target holds, a sliding window its last blocks only; the target's answer reuses
    them all and equals the one computed from scratch."""
    c = windowed_pair
    p = prompt(6 * T + 1, seed=5)
    (scratch,) = c.client(0).serve([Request(1, p, 3)], logits=True).outcomes
    c.client(1).serve([Request(2, p[:2 * T + 1])])   # the target shares two blocks already
    m = c.migrator.migrate(p, src=0, dst=1)
    per_block = [h * 2 * T * 8 * 4 for h in HEADS]   # one layer per window
    # positions 2..5: the full window all four, the 8-token window 4..5, the 12-token window 3..5
    assert (m.matched_blocks, m.sent_blocks, m.bytes) == (6, 4, 2 * per_block[0] + 4 * per_block[1] + 3 * per_block[2])
    served_as_scratch(c, p, scratch)
