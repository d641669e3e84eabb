"""benchmarks.ab's CPU split: the engine's main thread is its event loop, the rest its compute."""

from __future__ import annotations

import pytest


def test_cpu_split_sorts_threads_into_engine_loop_compute_and_front_ends() -> None:
    from benchmarks.ab import cpu_split

    before = {("engine 11", 11): 1.0, ("engine 11", 15): 2.0, ("front end 12", 12): 0.5}
    after = {("engine 11", 11): 1.2, ("engine 11", 15): 2.5, ("engine 11", 16): 0.1,
             ("front end 12", 12): 1.1, ("front end 13", 13): 0.3,
             ("supervisor 10", 10): 9.0}  # fmt: skip
    split = cpu_split(before, after, requests=1000)
    assert split == pytest.approx(
        {"engine loop": 200.0, "engine compute": 600.0, "front ends": 900.0}
    )
