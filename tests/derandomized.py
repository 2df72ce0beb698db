"""Hypothesis state machines run as one fixed sequence of workloads, so the coverage floors a test asserts hold
in any run of the suite."""
from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.internal.cache import LRUCache
from hypothesis.internal.conjecture import providers
from hypothesis.stateful import run_state_machine_as_test


def without_mined_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draw without the constants Hypothesis (6.1xx, through its internals) mines from every loaded local module
    and caches for the session: with them the derandomized workloads, and so the coverage floors, depend on
    which modules other tests loaded first and on every constant in them. Hypothesis's global constants stay, and
    the sequence is the same in any run."""
    monkeypatch.setattr(providers, "_get_local_constants", lambda: providers.Constants(
        integers=providers.SortedSet(), floats=providers.SortedSet(key=providers.float_to_int),
        bytes=providers.SortedSet(), strings=providers.SortedSet()))
    monkeypatch.setattr(providers, "CONSTANTS_CACHE", LRUCache(1024))


def run_derandomized(machine: type, max_examples: int, step_count: int = 60) -> None:
    """``machine`` through one fixed sequence of workloads of ``step_count`` steps each, whatever
    HYPOTHESIS_PROFILE says."""
    run_state_machine_as_test(machine, settings=settings(max_examples=max_examples, stateful_step_count=step_count,
                                                         deadline=None, database=None, derandomize=True,
                                                         phases=[Phase.generate]))
