"""Batched metric updates give exactly the samples of one update per value."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from service.common.metrics import UNCERTAINTY_BUCKETS, inc_many, observe_many


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in registry.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    }


def test_observe_many_equals_observing_each_value() -> None:
    # On a bound (counts in that bucket, `<=`), between bounds, above the last finite bound
    # (+Inf only), exactly 0 and a repeated value.
    values = np.array([0.001, 0.0015, 0.3, 0.3, 0.0, 0.99, 1.0, 1.7, 0.05, 1e-9])
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("h", "h", ["model"], buckets=UNCERTAINTY_BUCKETS, registry=one)
    h2 = Histogram("h", "h", ["model"], buckets=UNCERTAINTY_BUCKETS, registry=many)
    for v in values.tolist():
        h1.labels(model="m").observe(v)
    observe_many(h2.labels(model="m"), values)
    observe_many(h2.labels(model="m"), values[:0])  # nothing: no sample moves
    expected, got = _samples(one), _samples(many)
    total = ("h_sum", (("model", "m"),))
    assert got.pop(total) == pytest.approx(expected.pop(total), rel=1e-12)  # numpy sums pairwise
    assert got == expected
    assert expected[("h_bucket", (("le", "0.001"), ("model", "m")))] == 3  # 0, 1e-9, 0.001
    assert expected[("h_bucket", (("le", "+Inf"), ("model", "m")))] == len(values)
    assert expected[("h_count", (("model", "m"),))] == len(values)


def test_inc_many_equals_one_increment_per_index() -> None:
    one, many = CollectorRegistry(), CollectorRegistry()
    c1 = Counter("c", "c", ["label"], registry=one)
    c2 = Counter("c", "c", ["label"], registry=many)
    labels = [str(i) for i in range(4)]
    indices = np.array([3, 0, 3, 3, 1])
    ones = [c1.labels(label=n) for n in labels]  # the monitor creates every class's child
    for i in indices.tolist():
        ones[i].inc()
    children = [c2.labels(label=n) for n in labels]
    inc_many(children, indices)
    assert _samples(many) == _samples(one)
    assert _samples(many)[("c_total", (("label", "3"),))] == 3
    assert ("c_total", (("label", "2"),)) in _samples(many)  # exported at 0, never incremented
