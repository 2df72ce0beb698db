"""The differential fuzzer (``tests/rank_fuzz.py``) in the suite: a few hundred rank steps under pressure, every
answer equal to scratch's and the ledger's books intact. ``python tests/rank_fuzz.py`` runs it long."""
from __future__ import annotations

from rank_fuzz import fuzz


def test_a_rank_under_pressure_answers_as_scratch_and_keeps_its_books():
    report = fuzz(range(40))
    assert report.steps >= 300 and report.requests >= 100, report
    assert report.divergences == [] and report.integrity_errors == []
