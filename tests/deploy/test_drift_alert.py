"""End to end: a real Prometheus evaluates the committed alert rules against a live ``vge serve``.

In-distribution digits keep the drift gauge low and the drift alert silent; digits turned a
quarter (an out-of-distribution shift: a camera mounted sideways) raise ``vge_uncertainty_drift`` above 0.25 and the ``VgeUncertaintyDrift``
alert becomes pending/firing. The rules are the committed ``deploy/prometheus/alerts.yml`` with
only the alert's ``for:`` shortened to 1 s so the test is bounded in time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml
from torchvision.io import encode_png

from tests.deploy.deploy_helpers import PROMETHEUS_CONFIG, REPO, free_port
from tests.deploy.test_deploy_prometheus import (  # noqa: F401 - vge_server is a fixture
    _query,
    prometheus_server,
    vge_server,
)


@pytest.fixture
def prometheus_with_rules(tmp_path: Path, vge_server: str) -> Iterator[str]:  # noqa: F811
    port = free_port()
    cfg = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    for job in cfg["scrape_configs"]:
        job["scrape_interval"] = "1s"
        target = (
            vge_server.removeprefix("http://") if job["job_name"] == "vge" else f"127.0.0.1:{port}"
        )
        job["static_configs"] = [{"targets": [target]}]
    rules = yaml.safe_load((PROMETHEUS_CONFIG.parent / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "VgeUncertaintyDrift":
                rule["for"] = "1s"
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    cfg["rule_files"] = [str(tmp_path / "alerts.yml")]
    with prometheus_server(tmp_path, cfg, port) as base:
        yield base


def _send(url: str, images: np.ndarray) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        for start in range(0, len(images), 64):
            files = [
                ("images", (f"{i}.png", encode_png(torch.from_numpy(np.ascontiguousarray(im)).unsqueeze(0)).numpy().tobytes()))
                for i, im in enumerate(images[start : start + 64])
            ]  # fmt: skip
            assert c.post("/v1/predict", files=files).status_code == 200


def _drift(prom: str) -> float:
    result = _query(prom, 'max(vge_uncertainty_drift{score="vgmu"})')
    return float(result[0]["value"][1]) if result else float("nan")


def _drift_alerts(prom: str) -> list[dict]:
    alerts = httpx.get(f"{prom}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == "VgeUncertaintyDrift"]


def _eventually(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.5)


def test_drift_alert_stays_silent_in_distribution_and_fires_on_shift(
    vge_server: str,  # noqa: F811
    prometheus_with_rules: str,
) -> None:
    data = np.load(REPO / "models" / "data" / "mnist-8k.npz")["images"]
    rng = np.random.default_rng(1)
    digits = data[rng.choice(len(data), size=640, replace=False)]
    _send(vge_server, digits)  # in distribution: fills the engine's window (≥ 200 images)
    time.sleep(1.5)  # the engine refreshes the gauge at most once a second
    _send(vge_server, digits[:64])
    _eventually(lambda: _drift(prometheus_with_rules) == _drift(prometheus_with_rules)
                and not np.isnan(_drift(prometheus_with_rules)), 20, "a drift sample")  # fmt: skip
    time.sleep(3)  # several rule evaluations
    assert _drift(prometheus_with_rules) < 0.25
    assert _drift_alerts(prometheus_with_rules) == []

    # A shifted stream: digits turned a quarter (a camera mounted sideways). (Inverted digits were
    # the shift before the server read pictures: it now reads dark-on-light digits as digits.)
    _send(vge_server, np.rot90(data[rng.choice(len(data), size=1280, replace=False)], 1, (1, 2)))
    time.sleep(1.5)
    _send(vge_server, np.rot90(digits[:64], 1, (1, 2)))
    _eventually(lambda: _drift(prometheus_with_rules) > 0.25, 30, "the drift gauge to rise")
    _eventually(lambda: _drift_alerts(prometheus_with_rules) != [], 30, "the drift alert")
    alert = _drift_alerts(prometheus_with_rules)[0]
    assert alert["state"] in ("pending", "firing") and alert["labels"]["score"] in ("vgmu", "eu")
    assert "runbook" in alert["annotations"]
