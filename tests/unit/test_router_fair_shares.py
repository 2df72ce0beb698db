"""Fair shares at the router's admission gate, with real threads and bounded waits: a flooding tenant does not push
the others out, weights split the slots, a tenant's own cap and token rate hold it alone back, priority orders a
tenant's requests; ``fifo`` keeps arrival order; the keys file's settings and its errors."""
from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from kvledger.router.admission import AdmissionGate, AdmissionRefused
from kvledger.router.openai_types import ParamError
from kvledger.router.tenant_limits import TenantLimits
from kvledger.router.tenants import ApiKeys, Caller

WAIT_S = 30.0


def tenant(name: str, role: str = "user", **limits: float) -> Caller:
    return Caller(name, role, TenantLimits(**limits))  # type: ignore[arg-type]


def until(cond: Callable[[], bool], what: str) -> None:
    """Until ``cond()`` (another thread's progress), bounded."""
    done = threading.Event()
    for _ in range(30_000):
        if cond():
            return
        done.wait(0.001)
    pytest.fail(f"timed out waiting for {what}")


class Queue:
    """Waiters queued one at a time behind slots the test holds, so their arrival order is known; each records its
    name when let in and gives its slot straight back, so a slot freed lets exactly one in after another."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self.order: list[str] = []
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def add(self, name: str, caller: Caller, priority: int | None = None, cost: int = 1) -> None:
        def wait() -> None:
            try:
                held = self.gate.hold(caller, priority, cost)
            except (AdmissionRefused, ValueError) as e:   # the test asserts there were none
                self.errors.append(e)
                return
            self.order.append(name)
            held.release()

        queued = self.gate.counts()[1]
        t = threading.Thread(target=wait)
        t.start()
        self.threads.append(t)
        until(lambda: self.gate.counts()[1] == queued + 1, f"{name} to queue")

    def run(self, *held) -> list[str]:
        for h in held:
            h.release()
        for t in self.threads:
            t.join(WAIT_S)
        assert not self.errors and not any(t.is_alive() for t in self.threads), self.errors
        assert self.gate.counts() == (0, 0)
        return self.order


def test_a_tenant_flooding_the_queue_does_not_push_the_others_back():
    """Under contention, every tenant gets its share of the slots, however many requests it sends: the flood's
    20 queued requests first, then 2 each of two others; the others are all in within the first 6 slots."""
    for discipline in ("fair", "fifo"):
        gate = AdmissionGate(max_inflight=1, max_queued=64, queue_timeout_s=WAIT_S, discipline=discipline)
        blocker = gate.hold(tenant("blocker"))
        q = Queue(gate)
        for i in range(20):
            q.add("flood", tenant("flood"))
        for name in ("a", "b", "a", "b"):
            q.add(name, tenant(name))
        order = q.run(blocker)
        late = max(i for i, n in enumerate(order) if n != "flood")
        if discipline == "fair":
            assert order[:6] == ["flood", "a", "b", "flood", "a", "b"], order
        else:
            assert late == 23 and order[:20] == ["flood"] * 20, "fifo serves in arrival order: the others last"
        assert {n: order.count(n) for n in ("flood", "a", "b")} == {"flood": 20, "a": 2, "b": 2}
        stats = {t.tenant: t for t in gate.tenants()}
        assert stats["flood"].served == 20 and stats["a"].served_tokens == 2 and stats["a"].queue_seconds.count == 2


def test_weights_two_to_one_split_the_slots_two_to_one():
    gate = AdmissionGate(max_inflight=1, max_queued=128, queue_timeout_s=WAIT_S)
    blocker = gate.hold(tenant("blocker"))
    q = Queue(gate)
    heavy, light = tenant("heavy", weight=2), tenant("light", weight=1)
    for _ in range(30):
        q.add("light", light, cost=10)
        q.add("heavy", heavy, cost=10)
    order = q.run(blocker)
    first = order[:30]
    assert first.count("heavy") == 20 and first.count("light") == 10, first
    assert len(order) == 60


def test_a_tenant_at_its_max_inflight_waits_for_its_own_slot_while_others_pass():
    gate = AdmissionGate(max_inflight=4, max_queued=8, queue_timeout_s=WAIT_S)
    capped, other = tenant("capped", max_inflight=1), tenant("other")
    first = gate.hold(capped)
    q = Queue(gate)
    q.add("capped", capped)
    assert gate.counts() == (1, 1), "three slots free, but not capped's"
    held = [gate.hold(other) for _ in range(3)]   # the others pass it at once
    assert gate.counts() == (4, 1)
    stats = {t.tenant: t for t in gate.tenants()}
    assert (stats["capped"].running, stats["capped"].queued, stats["other"].running) == (1, 1, 3)
    for h in held:
        h.release()
    assert gate.counts() == (1, 1), "free slots do not lift a tenant's own cap"
    assert q.run(first) == ["capped"]


def test_a_tenant_over_its_token_rate_waits_for_its_bucket_or_gets_429_saying_when():
    now = [100.0]
    gate = AdmissionGate(max_inflight=8, max_queued=8, queue_timeout_s=5.0, clock=lambda: now[0])
    metered = tenant("metered", tokens_per_s=100, burst=1000)
    gate.hold(metered, cost=1000).release()   # the whole burst
    with pytest.raises(AdmissionRefused, match="over its token rate") as refused:
        gate.hold(metered, cost=800)
    assert refused.value.retry_after_s == 8, "800 tokens at 100 per second"
    with pytest.raises(ParamError, match="burst=1000") as too_big:
        gate.hold(metered, cost=1001)
    assert too_big.value.param == "max_tokens"
    gate.hold(tenant("other"), cost=10_000).release()   # another tenant is not held back
    q = Queue(gate)
    q.add("metered", metered, cost=30)   # 0.3 s of the bucket: within the queue's timeout, so it waits
    assert gate.counts()[1] == 1
    now[0] += 0.5
    assert q.run() == ["metered"]
    stats = {t.tenant: t for t in gate.tenants()}
    assert stats["metered"].shed == 1 and stats["metered"].served == 2 and stats["metered"].served_tokens == 1030
    assert stats["metered"].queue_seconds.sum == pytest.approx(0.5)


def test_within_a_tenant_higher_priority_then_an_admins_request_then_arrival():
    gate = AdmissionGate(max_inflight=1, max_queued=8, queue_timeout_s=WAIT_S)
    blocker = gate.hold(tenant("acme"))
    q = Queue(gate)
    q.add("low", tenant("acme"), priority=10)
    q.add("user", tenant("acme"), priority=50)
    q.add("admin", tenant("acme", role="admin"), priority=50)
    q.add("user later", tenant("acme"), priority=50)
    q.add("high", tenant("acme"), priority=90)
    assert q.run(blocker) == ["high", "admin", "user", "user later", "low"]


def test_fifo_keeps_arrival_order_whatever_the_priority():
    gate = AdmissionGate(max_inflight=1, max_queued=8, queue_timeout_s=WAIT_S, discipline="fifo")
    blocker = gate.hold()
    q = Queue(gate)
    for i, prio in enumerate((10, 90, 50)):
        q.add(str(i), tenant("acme"), priority=prio)
    assert q.run(blocker) == ["0", "1", "2"]


def test_a_refusal_changes_nothing_and_frees_no_one_elses_place():
    gate = AdmissionGate(max_inflight=1, max_queued=1, queue_timeout_s=WAIT_S)
    blocker = gate.hold(tenant("a"))
    q = Queue(gate)
    q.add("b", tenant("b"))
    with pytest.raises(AdmissionRefused, match="max_queued_completions=1"):
        gate.hold(tenant("c"))
    assert gate.counts() == (1, 1) and gate.refused == 1
    assert q.run(blocker) == ["b"]
    assert {t.tenant: t.shed for t in gate.tenants()} == {"a": 0, "b": 0, "c": 1}


KEYS = """# key  tenant  role  settings
sk-a1  acme   user   weight=2 max_inflight=8 tokens_per_s=20000
sk-a2  acme   admin
sk-b1  flood  user   weight=1 max_inflight=4 tokens_per_s=5000 burst=20000
sk-b2  flood  user   weight=1 max_inflight=4 tokens_per_s=5000 burst=20000
sk-c   calm   user
"""


def test_the_keys_file_gives_each_tenant_its_limits(tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEYS)
    keys = ApiKeys.load(path)
    acme = TenantLimits(weight=2, max_inflight=8, tokens_per_s=20000)
    assert keys.caller("sk-a1").limits == keys.caller("sk-a2").limits == acme, "a key that sets none: its tenant's"
    assert acme.capacity == 20000, "burst defaults to one second's worth"
    flood = keys.caller("sk-b2").limits
    assert (flood.weight, flood.max_inflight, flood.tokens_per_s, flood.capacity) == (1, 4, 5000, 20000)
    assert keys.caller("sk-c").limits == TenantLimits()


@pytest.mark.parametrize("line, needle", [
    ("sk-x t user weight=0", "line 2: weight must be a number > 0, got 0.0"),
    ("sk-x t user weight=heavy", "line 2: weight: expected a number, got 'heavy'"),
    ("sk-x t user max_inflight=1.5", "line 2: max_inflight: expected an int, got '1.5'"),
    ("sk-x t user max_inflight=0", "line 2: max_inflight must be an int >= 1"),
    ("sk-x t user tokens_per_s=inf", "line 2: tokens_per_s must be a number > 0"),
    ("sk-x t user burst=100", "line 2: burst needs tokens_per_s"),
    ("sk-x t user wieght=2", "line 2: 'wieght=2': expected NAME=VALUE"),
    ("sk-x t user weight", "line 2: 'weight': expected NAME=VALUE"),
    ("sk-x t user weight=2 weight=3", "line 2: weight: given twice"),
    ("sk-x t user\nsk-y t user weight=2\nsk-z t user weight=3", "line 4: weight: tenant 't' has weight=2.0 on line 3"),
])
def test_a_bad_setting_in_the_keys_file_names_the_file_line_and_field(tmp_path, line, needle):
    path = tmp_path / "keys"
    path.write_text(f"sk-ok ok user\n{line}\n")
    with pytest.raises(ValueError, match="api_keys: ") as e:
        ApiKeys.load(path)
    assert str(path) in str(e.value) and needle in str(e.value), str(e.value)
