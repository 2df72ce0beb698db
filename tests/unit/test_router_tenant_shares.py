"""Tenants' limits through the real HTTP API (uvicorn on 127.0.0.1, in-process ranks): a tenant at its
``max_inflight`` waits (and past the queue's timeout gets a 429) while another tenant is served, a tenant over its
token rate gets a 429 whose ``Retry-After`` says when, and the per-tenant metrics and cluster report show it all."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
import torch

from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.router.config import RouterConfig
from kvledger.router.http import HttpServer, make_app
from kvledger.router.service import RouterService
from kvledger.router.tenants import ApiKeys
from kvledger.worker.engine.reference import MODEL_NAME
from kvledger.worker.ledger import CacheConfig

T = 4
QUEUE_TIMEOUT_S = 2.0
KEYS = {"flood": "sk-flood-0123456789", "calm": "sk-calm-0123456789", "metered": "sk-metered-012345",
        "ops": "sk-ops-admin-012345"}
KEY_FILE = f"""{KEYS['flood']}    flood    user   max_inflight=1
{KEYS['calm']}     calm     user   weight=2
{KEYS['metered']}  metered  user   tokens_per_s=1 burst=60
{KEYS['ops']}      ops      admin
"""


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterService, ApiKeys, httpx.Client]]:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(KEY_FILE)
    keys = ApiKeys.load(path)
    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=96, num_secondary_blocks=0)
    service = RouterService(LocalCluster.build(2, cfg), RouterConfig(tokens_per_block=T,
                                                                     queue_timeout_s=QUEUE_TIMEOUT_S))
    service.feed.sync()
    server = HttpServer(make_app(service, keys), port=0).start()
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield service, keys, client
    server.stop()


def complete(client: httpx.Client, tenant: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens},
                       headers={"Authorization": f"Bearer {KEYS[tenant]}"})


def test_a_tenant_at_its_max_inflight_waits_while_another_tenant_is_served(router) -> None:
    service, keys, client = router
    running = service.admission.hold(keys.caller(KEYS["flood"]))   # flood's one slot, as a running completion
    got: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: got.append(complete(client, "flood", "F: a second flood request")))
    waiter.start()
    try:
        for _ in range(10_000):   # bounded: until flood's second request waits at the gate
            if {t.tenant: t.queued for t in service.admission.tenants()}.get("flood") == 1:
                break
            threading.Event().wait(0.001)
        assert service.admission.counts() == (1, 1), "flood's request waits for flood's own slot"
        calm = complete(client, "calm", "C: a calm tenant's request")
        assert calm.status_code == 200, calm.text
        waiter.join(QUEUE_TIMEOUT_S + 30)
        assert got[0].status_code == 429 and "no slot within" in got[0].json()["error"]["message"], got[0].text
        assert got[0].headers["retry-after"] == "1"
    finally:
        running.release()
    again = complete(client, "flood", "F: a flood request with its slot free")
    assert again.status_code == 200, again.text
    report = {t["tenant"]: t for t in client.get("/v1/cluster", headers={"Authorization": f"Bearer {KEYS['ops']}"})
              .json()["tenants"]}
    assert report["flood"]["shed"] == 1 and report["flood"]["max_inflight"] == 1 and report["calm"]["weight"] == 2
    assert report["calm"]["served"] == 1 and report["flood"]["served"] == 2 and report["calm"]["token_share"] > 0


def test_a_tenant_over_its_token_rate_gets_429_with_a_retry_after_that_says_when(router) -> None:
    _, _, client = router
    first = complete(client, "metered", "M: twenty bytes long", max_tokens=30)   # 20 + 30 of its 60 tokens
    assert first.status_code == 200, first.text
    second = complete(client, "metered", "M: twenty bytes long", max_tokens=30)
    assert second.status_code == 429, second.text
    assert "over its token rate" in second.json()["error"]["message"]
    assert 30 <= int(second.headers["retry-after"]) <= 41, "50 tokens at 1 a second, less what refilled"
    too_big = complete(client, "metered", "M: twenty bytes long", max_tokens=50)
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "max_tokens", too_big.text


def test_per_tenant_metrics_for_admins_only(router) -> None:
    _, _, client = router
    assert complete(client, "calm", "C: one more for the metrics").status_code == 200
    assert client.get("/metrics", headers={"Authorization": f"Bearer {KEYS['calm']}"}).status_code == 403
    text = client.get("/metrics", headers={"Authorization": f"Bearer {KEYS['ops']}"}).text
    for line in ('kvledger_tenant_served_completions_total{tenant="calm"}',
                 'kvledger_tenant_served_tokens_total{tenant="calm"}',
                 'kvledger_tenant_shed_completions_total{tenant="calm"} 0.0',
                 'kvledger_tenant_running_completions{tenant="calm"} 0.0',
                 'kvledger_tenant_queued_completions{tenant="calm"} 0.0',
                 'kvledger_tenant_queue_seconds_count{tenant="calm"}'):
        assert line in text, line
