"""benchmarks.readiness end to end: one real server start, SIGTERM, readiness timed."""

from __future__ import annotations

from benchmarks.readiness import REPO, time_to_not_ready


def test_readiness_turns_false_within_a_fraction_of_the_drain() -> None:
    # The drain is 1 s; readiness must fall long before it ends (the supervisor forwards SIGTERM
    # on its wake-up socket, not at a poll). A bound, not a timing target: 0.5 s is 150x the
    # median measured on the 2-core box.
    seconds = time_to_not_ready(REPO)
    assert 0 < seconds < 0.5
