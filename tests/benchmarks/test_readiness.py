"""benchmarks.readiness end to end: one real server start, SIGTERM, readiness timed."""

from __future__ import annotations

from benchmarks.readiness import REPO, time_to_not_ready


def test_readiness_turns_false_long_before_the_drain_ends() -> None:
    """Readiness falls at the start of the 1 s drain, not at its end or never. (How fast it falls
    is the benchmark's to measure, docs/benchmarks.md "Drain: SIGTERM to not ready": a bound
    tight enough to catch the old 0.2 s poll would be a timing target in a test.)"""
    seconds = time_to_not_ready(REPO)
    assert 0 < seconds < 0.5
