"""benchmarks/engine.py: the real engine process driven by the front ends' client, no HTTP."""

from __future__ import annotations

from benchmarks.engine import measure, parse_args


def test_measure_drives_a_real_engine_and_charges_its_cpu_per_request() -> None:
    args = parse_args(
        ["--conc", "8", "--clients", "2", "--seconds", "0.5", "--rounds", "2", "--warmup", "0.2",
         "--max-batch-size", "4"]
    )  # fmt: skip
    rounds = measure(args)
    assert len(rounds) == 2
    for r in rounds:
        assert r["req/s"] > 0
        # The engine's own histogram: batches of 1 to --max-batch-size images (8 in flight).
        assert 1.0 <= r["batch"] <= 4.0
        # Every request costs the engine's event loop and this process some CPU.
        assert r["loop"] > 0 and r["client"] > 0
