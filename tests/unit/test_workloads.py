"""The bench's named workloads (``replay.workloads``): what each shares, and in what order it asks; the offline bound
they are measured against."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

from kvledger.replay.bounds import static_split_cached_tokens
from kvledger.replay.workloads import WorkloadConfig, agents, conversation, documents, power_law, unique, workload

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


def _chat_trace(path) -> None:
    """Two chats after one system-prompt block (one of three turns, one of two) and a lone request, in a Mooncake
    file of 512-token blocks: each turn holds the turn before whole."""
    lines = [(0, [0, 1, 2], 1300), (1000, [0, 7], 700), (2000, [0, 1, 2, 3], 1800), (3000, [0, 20], 600),
             (4000, [0, 7, 8], 1100), (5000, [0, 1, 2, 3, 4, 5], 2600)]
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 9, "hash_ids": ids}) + "\n"
                            for t, ids, n in lines))


def test_conversations_are_the_chats_of_most_turns_in_order_each_block_scaled_to_the_bench(tmp_path):
    _chat_trace(tmp_path / "chats.jsonl")
    c = WorkloadConfig(block_size=32, prefixes=2, questions=3, max_prompt_tokens=5 * 32, output_tokens=4,
                       conversation_trace=str(tmp_path / "chats.jsonl"))
    t = conversation(c)
    assert [r.hash_ids for r in t.requests] == [(0, 1, 2), (0, 7), (0, 1, 2, 3), (0, 7, 8), (0, 1, 2, 3, 4)]
    # 1300 tokens: two whole 512-token blocks and 276 of the third, which becomes ceil(276 * 32 / 512) = 18 tokens;
    # the last turn is cut to its first five blocks, whole
    assert [r.input_length for r in t.requests] == [82, 44, 113, 69, 160]
    assert {r.output_length for r in t.requests} == {4}
    one_turn_each = conversation(dataclasses.replace(c, prefixes=3, questions=1))
    assert [r.hash_ids for r in one_turn_each.requests] == [(0, 1, 2), (0, 7), (0, 20)]
    with pytest.raises(ValueError, match="conversation_trace.*missing"):
        conversation(dataclasses.replace(c, conversation_trace=str(tmp_path / "missing")))


def test_agent_sessions_share_the_tools_and_each_turn_extends_its_sessions_last():
    t = agents(C)   # 6 sessions of 5 turns, 10 blocks of tools, a task and each turn's addition 2 blocks
    assert len(t.requests) == 30
    assert all(r.hash_ids[:10] == t.requests[0].hash_ids[:10] for r in t.requests)
    last: dict[int, tuple[int, ...]] = {}
    for r in t.requests:
        task = r.hash_ids[10]
        before = last.get(task)
        assert r.hash_ids[:-2] == before if before is not None else len(r.hash_ids) == 12
        assert r.input_length == 32 * len(r.hash_ids)
        last[task] = r.hash_ids
    assert len(last) == 6 and {len(h) for h in last.values()} == {10 + 2 * 5}
    assert len({r.hash_ids[10] for r in t.requests[:6]}) < 6   # the sessions interleave, not one after another


def test_the_static_split_keeps_each_chat_whole_past_the_head_every_request_shares():
    # two chats of three turns after one shared block, engines of 5 blocks: one chat (4 blocks and a tail) fits one
    a = [(0, 1), (0, 1, 2), (0, 1, 2, 3)]
    b = [(0, 5), (0, 5, 6), (0, 5, 6, 7)]
    chains = [a[0], b[0], a[1], b[1], a[2], b[2]]
    lengths = [32 * len(ids) + 1 for ids in chains]
    # each turn after the first finds its chat's blocks on its engine: 2 + 3 blocks a chat; grouped by the shared
    # first block, both chats would be on one engine, where they evict each other
    assert static_split_cached_tokens(chains, lengths, 32, [5, 5]) == 2 * 32 * (2 + 3)
    assert static_split_cached_tokens(chains, lengths, 32, [5]) == 256
