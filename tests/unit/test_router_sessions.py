"""Agent sessions: the table (ids, idle expiry on a fake clock, its bound, tool waits) and how ``kv`` weighs them
(affinity against load, protection of a live session's blocks); the other policies ignore them."""
from __future__ import annotations

import dataclasses

import pytest

from kvledger.router.openai_types import ParamError
from kvledger.router.policies import RankState, RouteRequest, SessionAt, make_policy, policy_names
from kvledger.router.policies.kv import KvCostModel, KvPolicy
from kvledger.router.probe import PrefixMatch
from kvledger.router.sessions import MAX_SESSION_ID, Sessions, session_of, waits_on_tool

T = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def req(n: int, first: int = 1, max_tokens: int = 4, session: SessionAt | None = None) -> RouteRequest:
    r = RouteRequest.of([first, *range(2, n + 1)], T, max_tokens=max_tokens)
    return dataclasses.replace(r, session=session)


def test_the_session_id_is_the_header_else_metadata_else_user_and_a_bad_one_is_named() -> None:
    both = {"metadata": {"session_id": "m"}, "user": "u"}
    assert session_of("h", both) == "h"
    assert session_of(None, both) == "m"
    assert session_of(None, {"metadata": {"other": 1}, "user": "u"}) == "u"
    assert session_of(None, {"metadata": None}) is None
    assert session_of(None, {"user": "u"}, tenant="acme") == "tenant:acme/u", "tenants never share a session"
    for header, fields, param in (("", {}, "x-session-id"), ("x" * (MAX_SESSION_ID + 1), {}, "x-session-id"),
                                  (None, {"metadata": {"session_id": 5}}, "metadata.session_id"),
                                  (None, {"user": ["a"]}, "user")):
        with pytest.raises(ParamError) as e:
            session_of(header, fields)
        assert e.value.param == param and param in str(e.value)


def test_a_session_lives_where_its_last_turn_ran_until_it_is_idle_for_the_ttl() -> None:
    clock = Clock()
    table = Sessions(ttl_s=300, clock=clock)
    first = req(41)                      # 10 full blocks before its last token
    table.served("a", 1, first, 11, 0, waiting_on_tool=True)
    longer = req(61)                     # the same prompt, grown: it starts with the first's 10 blocks
    assert table.at("a", longer) == SessionAt(1, 40, 11)
    assert table.at("a", req(61, first=9)) == SessionAt(1, 0, 11), "another prompt holds nothing of it"
    assert table.blocks_by_rank() == {1: 11}
    clock.now = 299.0
    table.served("a", 0, longer, 16, 40, waiting_on_tool=False)   # the next turn moved it, and renews it
    assert table.blocks_by_rank() == {0: 16}
    got = table.get("a")
    assert got is not None and (got.turns, got.prompt_tokens_total, got.cached_tokens_total) == (2, 102, 40)
    clock.now = 299.0 + 299.9
    assert table.stats().live == 1
    clock.now = 299.0 + 300.0
    assert table.at("a", longer) is None and table.blocks_by_rank() == {} and table.get("a") is None
    s = table.stats()
    assert (s.live, s.turns, s.prompt_tokens, s.cached_tokens) == (0, 2, 102, 40), "served tokens stay counted"
    assert s.hit_rate == 40 / 102


def test_the_table_is_bounded_and_drops_the_oldest_idle_session_first() -> None:
    clock = Clock()
    table = Sessions(ttl_s=300, max_sessions=2, clock=clock)
    for t, sid in enumerate(("a", "b")):
        clock.now = float(t)
        table.served(sid, 0, req(9), 2, 0, False)
    clock.now = 2.0
    table.served("a", 0, req(9), 2, 0, False)   # a is seen again: b is now the oldest idle
    table.served("c", 1, req(9), 3, 0, False)
    assert table.get("b") is None and table.get("a") is not None and table.get("c") is not None
    assert table.blocks_by_rank() == {0: 2, 1: 3}
    table.forget_rank(1)
    assert table.get("c") is None and table.stats().live == 1


def test_a_session_waits_on_a_tool_when_its_last_answer_called_one_chat_or_streamed() -> None:
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "tool_calls": [{}]},
                         "finish_reason": "tool_calls"}]}
    chunk = {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
    named = {"choices": [{"message": {"role": "assistant", "tool_calls": [{"id": "c"}]}, "finish_reason": "stop"}]}
    assert waits_on_tool(chat) and waits_on_tool(chunk) and waits_on_tool(named), "a named tool_choice ends with stop"
    assert waits_on_tool({"choices": [{"delta": {"tool_calls": [{"index": 0}]}, "finish_reason": None}]})
    assert not waits_on_tool({"choices": [{"finish_reason": "stop"}]}) and not waits_on_tool({"usage": {}})
    table = Sessions(clock=Clock())
    table.served("a", 0, req(9), 2, 0, waits_on_tool(chat))
    table.served("b", 0, req(9, first=5), 2, 0, waits_on_tool({"choices": [{"finish_reason": "stop"}]}))
    assert (table.stats().live, table.stats().waiting_on_tool) == (2, 1)
    table.served("a", 0, req(13), 3, 8, False)   # the tool's result came back: the next answer is text
    assert table.stats().waiting_on_tool == 0


COST = KvCostModel(allow_migration=False)


def test_affinity_wins_over_a_small_load_gap_but_not_a_large_one() -> None:
    """The index shows nothing yet (the engine's events are on their way): the session's rank is credited with
    the 400 prompt tokens it held at the last turn."""
    turn = req(501, session=SessionAt(1, 400, 100))
    small = [RankState(0), RankState(1, queued_requests=1, queued_prefill_tokens=100)]
    large = [RankState(0), RankState(1, queued_requests=4, queued_prefill_tokens=1000)]
    assert KvPolicy(COST).route(turn, small, {}).rank == 1
    assert KvPolicy(COST).route(turn, large, {}).rank == 0, "load still wins"
    assert KvPolicy(COST).route(dataclasses.replace(turn, session=None), small, {}).rank == 0
    assert KvPolicy(dataclasses.replace(COST, affinity_weight=0)).route(turn, small, {}).rank == 0
    # once the index shows the session's prefix, its match is the credit (never counted twice)
    shown = {1: PrefixMatch(100, 400, 0)}
    d = KvPolicy(COST).route(turn, large, shown)
    assert d.rank == 0 and d.scores[1] - d.scores[0] == pytest.approx((1000 - 400) * COST.prefill_s_per_token)


def test_another_request_avoids_a_rank_where_it_would_evict_a_live_sessions_blocks() -> None:
    """Rank 0 holds 60 blocks of live sessions beside 30 in use out of 100: a request of 22 blocks would evict
    12 of them there, while rank 1 (a little busier) has room."""
    other = req(81)   # 85 tokens to completion: 22 blocks
    states = [RankState(0, kv_used_blocks=30, kv_total_blocks=100, session_blocks=60),
              RankState(1, queued_prefill_tokens=8, kv_used_blocks=30, kv_total_blocks=100)]
    d = KvPolicy(COST).route(other, states, {})
    assert d.rank == 1
    assert d.scores[0] - d.scores[1] == pytest.approx((12 * T - 8) * COST.prefill_s_per_token)
    assert KvPolicy(dataclasses.replace(COST, protection_weight=0)).route(other, states, {}).rank == 0
    # the session's own turn reuses its blocks there: they are not protected from it
    own = req(81, session=SessionAt(0, 40, 60))
    assert KvPolicy(COST).route(own, states, {0: PrefixMatch(10, 40, 0)}).rank == 0
    # what the router dispatched there counts too, when the rank's report has not caught up
    busy = [dataclasses.replace(states[0], kv_used_blocks=0, dispatched_blocks=30), states[1]]
    assert KvPolicy(COST).route(other, busy, {}).rank == 1
    # with room for both, nothing is evicted and the less loaded rank wins
    roomy = [dataclasses.replace(s, kv_total_blocks=200) for s in states]
    assert KvPolicy(COST).route(other, roomy, {}).rank == 0


@pytest.mark.parametrize("name", [n for n in policy_names() if n != "kv"])
def test_the_other_policies_ignore_sessions(name: str) -> None:
    plain = [RankState(0, queued_requests=2, kv_used_blocks=10, kv_total_blocks=100), RankState(1, kv_total_blocks=100)]
    marked = [dataclasses.replace(plain[0], session_blocks=90), plain[1]]
    for i in range(20):
        r = req(41, first=i + 1)
        a = make_policy(name, seed=i).route(r, plain, {})
        b = make_policy(name, seed=i).route(dataclasses.replace(r, session=SessionAt(1, 40, 50)), marked, {})
        assert (a.rank, a.scores) == (b.rank, b.scores)
