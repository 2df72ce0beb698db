"""The bench's named workloads (``replay.workloads``): what each shares, and in what order it asks."""
from __future__ import annotations

from collections import Counter

import pytest

from kvledger.replay.workloads import WorkloadConfig, documents, power_law, unique, workload

C = WorkloadConfig(block_size=32, prefixes=6, prefix_tokens=320, questions=5, question_tokens=40, seed=3)


def test_documents_ask_each_first_question_first_then_the_rest_shuffled():
    t = documents(C)
    heads = [r.hash_ids[:10] for r in t.requests]
    assert len(t.requests) == 30 and len(set(heads[:6])) == 6
    assert Counter(heads) == {h: 5 for h in heads[:6]}
    assert all(r.input_length == 360 and len(r.hash_ids) == 12 for r in t.requests)
    assert len({r.hash_ids[10:] for r in t.requests}) == 30   # every question its own
    times = [r.timestamp_s for r in t.requests]
    assert times == sorted(times) and times[0] == 0.0
    assert documents(C) == t and documents(WorkloadConfig(seed=4)) != documents(WorkloadConfig(seed=5))


def test_power_law_favours_the_head_and_unique_shares_nothing():
    big = WorkloadConfig(prefixes=20, questions=20, seed=1)
    counts = Counter(r.hash_ids[0] for r in power_law(big).requests)
    ranked = [c for _, c in counts.most_common()]
    assert ranked[0] > 4 * ranked[-1]
    blocks = [b for r in unique(C).requests for b in r.hash_ids]
    assert len(blocks) == len(set(blocks))


def test_unknown_workloads_and_bad_sizes_are_named():
    with pytest.raises(ValueError, match="unknown workload 'doc'.*docs"):
        workload("doc", C)
    with pytest.raises(ValueError, match="prefix_tokens"):
        WorkloadConfig(prefix_tokens=0)
