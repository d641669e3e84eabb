"""The dashboard against a running service and a real Prometheus server.

* ``vge serve`` runs as a subprocess on a free loopback port (CPU, temp state dir).
* Every metric name the dashboard's PromQL uses must be one the service's ``/metrics`` exports.
* A real ``prometheus`` (Debian package) scrapes the service every second, using the committed
  ``deploy/prometheus/prometheus.yml`` with only the targets and interval rewritten, while a short,
  bounded load of ``POST /v1/predict`` runs. Then the dashboard's own expressions are evaluated
  through Prometheus' HTTP API: all must be accepted, and p99 latency and the abstain rate must be
  non-empty and plausible.

Both servers are stopped by their own PID.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.deploy_helpers import (
    PROMETHEUS_CONFIG,
    REPO,
    dashboard_exprs,
    find_tool,
    free_port,
    load_dashboard,
    png_bytes,
    promql_metric_names,
)

#: What the dashboard's ``$__rate_interval`` becomes in the test: longer than the whole run, so the
#: window covers the load from its first scrape (rate() extrapolates inside it).
RATE_WINDOW = "2m"
PREDICT_ENDPOINT = "/v1/predict"
N_REQUESTS = 36


def _stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Stop a child we started, by its PID: SIGTERM, then SIGKILL if it does not exit."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200:
                return
            last = r.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.2)
    pytest.fail(f"{url} not ready after {timeout}s ({last}):\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def vge_server(tmp_path_factory) -> Iterator[str]:
    """``vge serve`` on a free port with the shipped default model; yields its base URL."""
    tmp = tmp_path_factory.mktemp("vge-serve")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGE_")}
    env.update(
        VGE_DEVICE="cpu",
        VGE_JOBS_DB_URL=f"sqlite:///{tmp}/jobs.sqlite3",
        VGE_JOBS_DIR=str(tmp / "jobs"),
        VGE_MODELS_ROOT=str(tmp / "models"),
        VGE_DATA_ROOT=str(tmp / "data"),
        VGE_TORCH_THREADS="1",
        VGE_DECODE_WORKERS="2",
        VGE_LOG_LEVEL="warning",
    )
    log = tmp / "vge.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [find_tool("vge"), "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=tmp,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{base}/healthz", proc, log, timeout=90)  # what the Docker HEALTHCHECK probes
        _wait_http(f"{base}/readyz", proc, log, timeout=60)  # model loaded, batcher running
        yield base
    finally:
        _stop(proc)


def _exported_names(metrics_text: str) -> set[str]:
    """Sample names the exposition declares, from its families' types (a labelled family with no
    children yet still counts: its ``# TYPE`` line is the service's promise to export it)."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(metrics_text):
        if fam.type == "histogram":
            names |= {f"{fam.name}_bucket", f"{fam.name}_sum", f"{fam.name}_count"}
        elif fam.type == "counter":
            names.add(f"{fam.name}_total")
        else:
            names.add(fam.name)
        names |= {s.name for s in fam.samples}
    return names


def test_dashboard_queries_only_metrics_the_service_exports(vge_server):
    r = httpx.get(f"{vge_server}/metrics", timeout=10)
    assert r.status_code == 200
    exported = _exported_names(r.text)
    exprs = dashboard_exprs(load_dashboard())
    assert len(exprs) >= 10
    for title, expr in exprs:
        names = promql_metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        missing = names - exported
        assert not missing, f"panel {title!r} queries {sorted(missing)}, not exported by /metrics"


def _dockerfile_healthcheck() -> list[str]:
    """The exec-form command of the Dockerfile's HEALTHCHECK."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("HEALTHCHECK")]
    return json.loads(line[line.index("CMD") + 3 :].strip())


def test_dockerfile_healthcheck_probe_against_the_service(vge_server):
    """The image's HEALTHCHECK command, run as written (python on PATH = this interpreter): healthy
    (exit 0) against the running service, unhealthy (exit 1) against a closed port."""
    cmd = _dockerfile_healthcheck()
    assert cmd[0] == "python"
    cmd = [sys.executable, *cmd[1:]]
    port = vge_server.rsplit(":", 1)[1]
    env = {**os.environ, "VGE_PORT": port}
    ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert ok.returncode == 0, ok.stderr
    env["VGE_PORT"] = str(free_port())
    bad = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert bad.returncode == 1, (bad.returncode, bad.stderr)


# --------------------------------------------------------------------------------------------
# real Prometheus
# --------------------------------------------------------------------------------------------


@pytest.fixture
def prometheus(tmp_path, vge_server) -> Iterator[str]:
    """A real Prometheus on a free loopback port scraping ``vge_server`` every second."""
    port = free_port()
    cfg = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    cfg["global"]["scrape_interval"] = "1s"
    cfg["global"]["evaluation_interval"] = "1s"
    for job in cfg["scrape_configs"]:
        job["scrape_interval"] = "1s"
        target = (
            vge_server.removeprefix("http://") if job["job_name"] == "vge" else f"127.0.0.1:{port}"
        )
        job["static_configs"] = [{"targets": [target]}]
    assert any(j["job_name"] == "vge" for j in cfg["scrape_configs"])
    with prometheus_server(tmp_path, cfg, port) as base:
        yield base


@contextlib.contextmanager
def prometheus_server(tmp_path: Path, cfg: dict, port: int) -> Iterator[str]:
    """Run Debian's ``prometheus`` with ``cfg`` on ``127.0.0.1:port``; yields its base URL."""
    cfg_path = tmp_path / "prometheus.yml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                find_tool("prometheus"),
                f"--config.file={cfg_path}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{base}/-/ready", proc, log, timeout=30)
        yield base
    finally:
        _stop(proc)


def _query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr!r}: {body}"
    assert body["data"]["resultType"] == "vector"
    return body["data"]["result"]


def _wait_for(prom: str, expr: str, ok, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        result = _query(prom, expr)
        if ok(result):
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"Prometheus never satisfied {expr!r}; last result {result}")
        time.sleep(0.25)


def _mnist_pngs(n: int) -> list[bytes]:
    """Real digits from the bundled MNIST split plus some noise images (likely abstentions)."""
    data = np.load(REPO / "models" / "data" / "mnist-8k.npz")
    rng = np.random.default_rng(0)
    images = [data["images"][i] for i in rng.choice(len(data["images"]), size=n, replace=False)]
    for i in range(0, n, 4):
        images[i] = rng.integers(0, 256, size=(28, 28), dtype=np.uint8)
    return [png_bytes(img.tolist()) for img in images]


def _predict(client: httpx.Client, pngs: list[bytes], abstain_k: float | None = None) -> list[dict]:
    files = [("images", (f"img{i}.png", png, "image/png")) for i, png in enumerate(pngs)]
    params = {} if abstain_k is None else {"abstain_k": abstain_k}
    r = client.post(PREDICT_ENDPOINT, files=files, params=params)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == len(pngs)
    return results


def _value(sample: dict) -> float:
    return float(sample["value"][1])


def test_real_prometheus_scrapes_service_and_dashboard_queries_answer(vge_server, prometheus):
    dash_exprs = dashboard_exprs(load_dashboard())
    p99 = next(
        e for _, e in dash_exprs
        if e.startswith("histogram_quantile(0.99,") and "vge_request_duration_seconds_bucket" in e
    )  # fmt: skip
    abstain = next(e for t, e in dash_exprs if t == "Abstain rate")

    def sub(expr: str) -> str:
        return expr.replace("$__rate_interval", RATE_WINDOW)

    pngs = _mnist_pngs(48)
    noise = [p for i, p in enumerate(pngs) if i % 4 == 0]
    with httpx.Client(base_url=vge_server, timeout=30) as client:
        # Warm-up: abstain_k=0 never abstains (p1 > p2), abstain_k=100 on noise nearly always
        # does, so both vge_predictions_total{abstained=...} series normally exist before the load.
        warm = _predict(client, pngs[1:3], abstain_k=0.0) + _predict(
            client, noise[:4], abstain_k=100.0
        )
        # Wait until Prometheus has sampled them: the load is then an *increase* that rate() sees,
        # whatever the scrape phase.
        count_q = f'sum(vge_request_duration_seconds_count{{endpoint="{PREDICT_ENDPOINT}"}})'
        _wait_for(prometheus, count_q, lambda r: r and _value(r[0]) >= 2)
        _wait_for(
            prometheus, "sum(vge_predictions_total)", lambda r: r and _value(r[0]) >= len(warm)
        )
        seeded = {
            s["metric"]["abstained"]
            for s in _query(prometheus, "count by (abstained) (vge_predictions_total)")
        }

        # Bounded load: N_REQUESTS requests of 1-4 images, 4 at a time, spread over ~3 s; every
        # third uses abstain_k=100, the rest the model's default.
        def one(i: int) -> list[dict]:
            time.sleep(0.08 * (i % 9))
            k = 1 + i % 4
            imgs = [pngs[(i * 3 + j) % len(pngs)] for j in range(k)]
            return _predict(client, imgs, abstain_k=100.0 if i % 3 == 0 else None)

        with ThreadPoolExecutor(max_workers=4) as pool:
            preds = [p for batch in pool.map(one, range(N_REQUESTS)) for p in batch]
    assert len(preds) == sum(1 + i % 4 for i in range(N_REQUESTS))
    served = warm + preds
    truth_abstain = sum(bool(p["abstain"]) for p in served) / len(served)

    # Prometheus has scraped everything the load did.
    _wait_for(prometheus, count_q, lambda r: r and _value(r[0]) >= 2 + N_REQUESTS)
    _wait_for(prometheus, "sum(vge_predictions_total)", lambda r: r and _value(r[0]) >= len(served))
    up = _query(prometheus, 'up{job="vge"}')
    assert up and _value(up[0]) == 1.0

    # Every dashboard expression is valid PromQL for a real Prometheus.
    for title, expr in dash_exprs:
        assert isinstance(_query(prometheus, sub(expr)), list), title

    # p99 latency of /v1/predict: present and plausible.
    result = _query(prometheus, sub(p99))
    by_endpoint = {s["metric"].get("endpoint"): _value(s) for s in result}
    assert PREDICT_ENDPOINT in by_endpoint, result
    p99_s = by_endpoint[PREDICT_ENDPOINT]
    assert math.isfinite(p99_s) and 0.0 < p99_s < 10.0, p99_s

    # Abstain rate: one series per model, a fraction, close to what the clients were told.
    result = _query(prometheus, sub(abstain))
    assert result, "abstain rate is empty"
    rates = [_value(s) for s in result]
    assert all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in rates), rates
    if seeded == {"true", "false"}:
        # Both series were sampled before the load, so the windowed ratio is the load's ratio
        # (the 6 warm-up predictions are the only difference).
        assert abs(rates[0] - truth_abstain) <= 0.1, (rates, truth_abstain)
    else:
        assert 0.0 < truth_abstain < 1.0 or rates[0] in (0.0, 1.0), (rates, truth_abstain)

    # The other panels have data too, where this run must have produced it.
    for expr in (
        f"sum(rate(vge_request_duration_seconds_count[{RATE_WINDOW}]))",
        f"sum by (model) (rate(vge_batch_size_sum[{RATE_WINDOW}])) / sum by (model) (rate(vge_batch_size_count[{RATE_WINDOW}]))",
        f"histogram_quantile(0.95, sum by (le, model) (rate(vge_compute_seconds_bucket[{RATE_WINDOW}])))",
        f"histogram_quantile(0.95, sum by (le, model) (rate(vge_queue_wait_seconds_bucket[{RATE_WINDOW}])))",
        'sum by (state) (vge_training_jobs)',
        "sum(vge_inflight_requests)",
    ):  # fmt: skip
        res = _query(prometheus, expr)
        assert res and all(math.isfinite(_value(s)) and _value(s) >= 0 for s in res), (expr, res)
