"""Which vLLM servers run a KV connector, and the two requests of a split across them (``router.kv_connector``)."""
from __future__ import annotations

import pytest

from kvledger.router.config import RouterConfig
from kvledger.router.kv_connector import CONSUMER_METRIC, PREFILL_PARAMS, connector_of, decode_fields, prefill_fields


def described(connector: str | None, role: str | None) -> dict:
    """What ``/server_info?config_format=json`` answers, as far as it is read."""
    config = None if connector is None else {"kv_connector": connector, "kv_role": role, "engine_id": "e"}
    return {"vllm_config": {"kv_transfer_config": config, "model_config": {}}, "vllm_env": {}}


@pytest.mark.parametrize(("role", "produces", "consumes"), [
    ("kv_producer", True, False), ("kv_consumer", False, True), ("kv_both", True, True)])
def test_the_role_a_server_describes_says_which_side_of_a_split_it_can_take(role, produces, consumes):
    c = connector_of(described("NixlConnector", role), set())
    assert (c.name, c.role, c.produces, c.consumes) == ("NixlConnector", role, produces, consumes)


def test_a_server_with_no_connector_runs_none_whatever_else_it_says():
    assert connector_of(described(None, None), {CONSUMER_METRIC}) is None, "its own description wins"
    assert connector_of(None, {"vllm:num_requests_running"}) is None


def test_without_a_description_the_consumer_gauge_shows_a_connector_of_unknown_name():
    c = connector_of(None, {"vllm:num_requests_running", CONSUMER_METRIC})
    assert (c.name, c.role, c.consumes, c.produces) == (None, None, True, True)


def test_the_prefill_asks_for_a_remote_decode_and_the_decode_carries_what_the_prefill_answered():
    fields = {"temperature": 0, "kv_transfer_params": {"from": "client"}}
    sent = prefill_fields(fields)
    assert sent == {"temperature": 0, "kv_transfer_params": PREFILL_PARAMS} and sent["kv_transfer_params"]["do_remote_decode"]
    assert fields["kv_transfer_params"] == {"from": "client"}, "the client's fields are not changed"
    nixl = {"remote_engine_id": "p0", "remote_block_ids": [3, 4], "remote_host": "10.0.0.1", "remote_port": 5600,
            "do_remote_prefill": True, "do_remote_decode": False}
    assert decode_fields({"temperature": 0}, {"choices": [], "kv_transfer_params": nixl}) == {
        "temperature": 0, "kv_transfer_params": nixl}
    assert decode_fields({"temperature": 0}, {"choices": [], "kv_transfer_params": None}) == {"temperature": 0}, \
        "the shared-storage connector answers none: the decode server finds the KV by the prompt"


@pytest.mark.parametrize(("vllm", "prefill", "match"), [
    ((), ("localhost:8000",), "vllm_prefill servers are http://HOST:PORT"),
    (("http://a:1",), ("http://a:1",), "list a server twice"),
    ((), ("http://a:1", "http://a:1"), "list a server twice")])
def test_prefill_servers_are_urls_of_their_own(vllm, prefill, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(vllm=vllm, vllm_prefill=prefill)
