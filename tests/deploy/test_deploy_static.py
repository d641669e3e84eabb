"""Static checks of the deployment files: compose (with a real Compose v2 binary), hadolint,
promtool, the Dockerfile's shape, Grafana provisioning and the dashboard JSON.

No Docker engine is needed: ``docker-compose config`` only parses, interpolates and validates.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.deploy_helpers import (
    DASHBOARD,
    PROMETHEUS_CONFIG,
    REPO,
    dashboard_exprs,
    dashboard_panels,
    find_tool,
    load_dashboard,
    promql_metric_names,
    run_tool,
)

COMPOSE = REPO / "docker-compose.yml"
COMPOSE_CPU = REPO / "docker-compose.cpu.yml"
ENV_EXAMPLE = REPO / ".env.example"
DOCKERFILE = REPO / "Dockerfile"

#: The metric contract from docs/architecture.md: name -> type.
CONTRACT_METRICS = {
    "vge_request_duration_seconds": "histogram",
    "vge_queue_wait_seconds": "histogram",
    "vge_compute_seconds": "histogram",
    "vge_batch_size": "histogram",
    "vge_queue_depth": "gauge",
    "vge_inflight_requests": "gauge",
    "vge_predictions_total": "counter",
    "vge_rejections_total": "counter",
    "vge_model_load_seconds": "histogram",
    "vge_training_jobs": "gauge",
    "vge_device_memory_bytes": "gauge",
    "vge_prediction_vgmu": "histogram",
    "vge_prediction_eu": "histogram",
    "vge_prediction_tu": "histogram",
    "vge_prediction_class_total": "counter",
    "vge_uncertainty_drift": "gauge",
    "vge_abstain_ratio_window": "gauge",
    "vge_calibrated_deferral": "gauge",
    "vge_review_queue_depth": "gauge",
    "vge_reviews_total": "counter",
    "vge_review_latency_seconds": "histogram",
    "vge_review_enqueue_total": "counter",
}


def _clean_env() -> dict[str, str]:
    """The environment without variables the compose files interpolate (a developer's shell may
    export some), so the test sees exactly what the env file provides."""
    drop = ("VGE_", "GRAFANA_", "PROMETHEUS_", "COMPOSE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["HOME"] = os.environ.get("HOME", "/tmp")
    return env


@pytest.fixture(scope="module")
def env_file(tmp_path_factory) -> Path:
    """.env.example with the values a user must fill in (API key, Grafana password) filled in."""
    lines = ENV_EXAMPLE.read_text().splitlines()
    filled = {"VGE_API_KEY=": "VGE_API_KEY=ci-test-key-0123",
              "GRAFANA_ADMIN_PASSWORD=": "GRAFANA_ADMIN_PASSWORD=ci-grafana-0123"}  # fmt: skip
    for empty in filled:
        assert empty in lines, f".env.example must leave {empty[:-1]} for the user to set"
    path = tmp_path_factory.mktemp("compose") / ".env"
    path.write_text("\n".join(filled.get(ln, ln) for ln in lines) + "\n")
    return path


def _compose(*args: str, env_file: Path, files=(COMPOSE,)):
    cmd = [
        find_tool("docker-compose"),
        "--project-directory",
        str(REPO),
        "--env-file",
        str(env_file),
    ]
    for f in files:
        cmd += ["-f", str(f)]
    return run_tool([*cmd, *args], env=_clean_env())


def _compose_json(files, env_file: Path) -> dict:
    res = _compose("config", "--format", "json", files=files, env_file=env_file)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


# --------------------------------------------------------------------------------------------
# docker compose
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, COMPOSE_CPU)], ids=["gpu", "cpu-override"])
def test_compose_config_is_valid(files, env_file):
    res = _compose("config", "-q", files=files, env_file=env_file)
    assert res.returncode == 0, f"docker-compose config failed:\n{res.stderr}"


def test_compose_postgres_profile_is_optional(env_file):
    """Without the profile there is no database service; with it, a healthy PostgreSQL whose
    volume persists, and the vge service takes the URL from VGE_DB_URL."""
    plain = _compose_json((COMPOSE,), env_file)["services"]
    assert "postgres" not in plain and plain["vge"]["environment"]["VGE_REVIEW_QUEUE"] == "on"
    res = _compose("--profile", "postgres", "config", "--format", "json", env_file=env_file)
    assert res.returncode == 0, res.stderr
    services = json.loads(res.stdout)["services"]
    pg = services["postgres"]
    assert pg["image"].startswith("postgres:") and "pg_isready" in pg["healthcheck"]["test"]
    assert pg["volumes"][0]["target"] == "/var/lib/postgresql/data"
    assert "VGE_DB_URL" in services["vge"]["environment"]


def test_compose_refuses_to_start_without_api_key(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    for env in (empty, ENV_EXAMPLE):  # unset, and the example's empty value copied unchanged
        res = _compose("config", "-q", env_file=env)
        assert res.returncode != 0
        assert "VGE_API_KEY" in res.stderr or "GRAFANA_ADMIN_PASSWORD" in res.stderr


def test_compose_safe_defaults(tmp_path, env_file):
    """Issue 28: ports were published on every interface, Grafana fell back to admin/admin, the
    example shipped `change-me` secrets and .env was not ignored by git."""
    only_key = tmp_path / "key.env"
    only_key.write_text("VGE_API_KEY=ci-test-key-0123\n")  # no Grafana password: refused
    res = _compose("config", "-q", env_file=only_key)
    assert res.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in res.stderr
    services = _compose_json((COMPOSE,), env_file)["services"]
    ports = [p for s in services.values() for p in s.get("ports", [])]
    assert len(ports) == 3 and all(p.get("host_ip") == "127.0.0.1" for p in ports), ports
    everywhere = tmp_path / "bind.env"
    everywhere.write_text(env_file.read_text().replace("VGE_BIND=127.0.0.1", "VGE_BIND=0.0.0.0"))
    services = _compose_json((COMPOSE,), everywhere)["services"]
    assert {p.get("host_ip") for s in services.values() for p in s.get("ports", [])} == {"0.0.0.0"}
    assert "change-me" not in ENV_EXAMPLE.read_text() and "change-me" not in COMPOSE.read_text()
    assert "token_urlsafe" in ENV_EXAMPLE.read_text()  # says how to generate the secrets
    assert ".env" in (REPO / ".gitignore").read_text().splitlines()


def test_compose_gpu_service_shape(env_file):
    cfg = _compose_json((COMPOSE,), env_file)
    services = cfg["services"]
    assert set(services) >= {"vge", "prometheus", "grafana"}
    vge = services["vge"]
    build = Path(vge["build"]["context"])
    assert build == REPO and (build / vge["build"]["dockerfile"]).resolve() == DOCKERFILE

    devices = vge["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices
    ), devices
    env = vge["environment"]
    assert env["VGE_DEVICE"] == "cuda"
    assert env["VGE_HOST"] == "0.0.0.0"
    assert env["VGE_API_KEY"] == "ci-test-key-0123"  # interpolated from the env file
    assert "VGE_MODEL_DIR" not in env or env["VGE_MODEL_DIR"], "empty VGE_MODEL_DIR means '.'"

    # job database and the models root live on the named volume
    mounts = {m["target"]: m for m in vge["volumes"]}
    assert mounts["/data"]["type"] == "volume"
    assert env["VGE_JOBS_DB_URL"].startswith("sqlite:////data/")
    assert env["VGE_MODELS_ROOT"].startswith("/data/")

    # healthchecks everywhere; startup ordered on health
    for name in ("vge", "prometheus", "grafana"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    assert any("/healthz" in part for part in vge["healthcheck"]["test"])
    assert services["prometheus"]["depends_on"]["vge"]["condition"] == "service_healthy"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"

    # published ports: API 8000, Prometheus 9090, Grafana 3000
    published = {
        (p["target"], str(p["published"])) for s in services.values() for p in s.get("ports", [])
    }
    assert published >= {(8000, "8000"), (9090, "9090"), (3000, "3000")}


def test_compose_cpu_override_drops_gpu_and_keeps_the_rest(env_file):
    gpu = _compose_json((COMPOSE,), env_file)["services"]["vge"]
    cpu = _compose_json((COMPOSE, COMPOSE_CPU), env_file)["services"]["vge"]
    assert not cpu.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
    assert cpu["environment"]["VGE_DEVICE"] == "cpu"
    assert {k: v for k, v in cpu["environment"].items() if k != "VGE_DEVICE"} == {
        k: v for k, v in gpu["environment"].items() if k != "VGE_DEVICE"
    }
    assert cpu["volumes"] == gpu["volumes"]
    assert cpu["healthcheck"] == gpu["healthcheck"]


def test_compose_bind_mounts_exist_and_match_configs(env_file):
    services = _compose_json((COMPOSE,), env_file)["services"]
    for name, svc in services.items():
        for m in svc.get("volumes", []):
            if m["type"] == "bind":
                assert Path(m["source"]).exists(), f"{name}: bind source {m['source']} missing"

    prom = services["prometheus"]
    prom_mounts = {m["target"]: Path(m["source"]) for m in prom["volumes"] if m["type"] == "bind"}
    config_flag = next(a for a in prom["command"] if a.startswith("--config.file="))
    assert prom_mounts[config_flag.split("=", 1)[1]] == PROMETHEUS_CONFIG

    graf = {m["target"]: Path(m["source"]) for m in services["grafana"]["volumes"]}
    prov = graf["/etc/grafana/provisioning"]
    provider = yaml.safe_load((prov / "dashboards" / "vge.yml").read_text())
    dash_path = provider["providers"][0]["options"]["path"]
    assert graf[dash_path] == DASHBOARD.parent
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dash_path}/{DASHBOARD.name}"


def test_compose_service_env_is_valid_settings(env_file):
    """Every VGE_* variable compose passes is a real setting and validates (extra='forbid')."""
    from service.common.settings import Settings

    env = _compose_json((COMPOSE, COMPOSE_CPU), env_file)["services"]["vge"]["environment"]
    vge_env = {k: v for k, v in env.items() if k.startswith("VGE_")}
    fields = {f"VGE_{name.upper()}" for name in Settings.model_fields}
    assert set(vge_env) <= fields, f"unknown settings: {set(vge_env) - fields}"
    # As in the container: an empty variable means unset (Settings has env_ignore_empty).
    Settings(**{k[4:].lower(): v for k, v in vge_env.items() if v != ""})


def test_prometheus_scrapes_the_compose_service(env_file):
    services = _compose_json((COMPOSE,), env_file)["services"]
    port = int(services["vge"]["environment"]["VGE_PORT"])
    cfg = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "vge")
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"vge:{port}"]
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_promtool_check_config():
    res = run_tool([find_tool("promtool"), "check", "config", str(PROMETHEUS_CONFIG)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout + res.stderr


def test_alert_rules_check_and_unit_tests():
    """promtool check rules + promtool test rules: synthetic series → exactly the expected alerts."""
    rules = PROMETHEUS_CONFIG.parent / "alerts.yml"
    res = run_tool([find_tool("promtool"), "check", "rules", str(rules)])
    assert res.returncode == 0 and "SUCCESS: 11 rules found" in res.stdout, res.stdout + res.stderr
    res = run_tool(
        [find_tool("promtool"), "test", "rules", str(rules.with_name("alerts_test.yml"))]
    )
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr
    text = rules.read_text()
    for name in ("VgeHighLatencyP99", "VgeServerErrors", "VgeQueueFull", "VgeEngineNotReady",
                 "VgeTrainingJobFailed", "VgeAbstainRateHigh", "VgeUncertaintyDrift",
                 "VgeReviewQueueFull", "VgeReviewStoreDown", "VgeModelRestoreFailed",
                 "VgeFleetNotConverged"):  # fmt: skip
        assert f"alert: {name}" in text
    assert text.count("runbook:") == 11


# --------------------------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------------------------


def test_hadolint_clean():
    """No finding at any severity; each deliberate exception is an inline `hadolint ignore`."""
    res = run_tool([find_tool("hadolint"), "--no-color", str(DOCKERFILE)])
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_shape():
    ins = _instructions()
    kinds = [k for k, _ in ins]

    users = [arg for k, arg in ins if k == "USER"]
    assert users, "no USER: the service would run as root"
    assert users[-1].split(":")[0] not in ("0", "root")

    assert ins[-1] == ("ENTRYPOINT", '["vge", "serve"]') or (
        ("ENTRYPOINT", '["vge", "serve"]') in ins
    )
    health = [arg for k, arg in ins if k == "HEALTHCHECK"]
    assert len(health) == 1 and "/healthz" in health[0] and "urllib" in health[0]

    # torch is installed before any project code is copied (code edits keep the torch layer)
    torch_at = next(i for i, (k, a) in enumerate(ins) if k == "RUN" and "torch==" in a)
    code_at = min(
        i for i, (k, a) in enumerate(ins) if k == "COPY" and re.search(r"\b(models|service)\b", a)
    )
    deps_at = next(i for i, (k, a) in enumerate(ins) if k == "COPY" and "pyproject.toml" in a)
    assert torch_at < deps_at < code_at
    assert kinds.count("FROM") >= 1


def test_every_volume_the_image_is_run_with_is_made_for_its_user(env_file):
    """A named volume mounted where the image has no directory is created owned by root, and the
    server (uid 10001) cannot write there: the fleet's /models and /reviews were such paths
    (training jobs could not save models, review images were not stored). Every named-volume
    target of a service running this image is a directory the Dockerfile makes and chowns to
    the runtime user, or lies under one."""
    made: set[str] = set()
    owned: set[str] = set()
    for kind, arg in _instructions():
        if kind != "RUN":
            continue
        for step in arg.split("&&"):
            words = step.split()
            if words[:2] == ["mkdir", "-p"]:
                made.update(words[2:])
            elif words[:1] == ["chown"]:
                owned.update(w for w in words[1:] if w.startswith("/"))
    uid = next(arg for kind, arg in reversed(_instructions()) if kind == "USER").split(":")[0]
    # the runtime user by name (useradd --uid UID NAME), the owner the chowns give
    runs = " ".join(arg for kind, arg in _instructions() if kind == "RUN")
    user = re.search(rf"useradd [^&]*--uid {uid} [^&]* (\w+)\s*&&", runs)
    assert user is not None, f"no useradd of uid {uid}"
    chowns = [arg for kind, arg in _instructions() if kind == "RUN" and "chown" in arg]
    assert all(f"chown -R {user[1]}:" in arg for arg in chowns), chowns

    def under(path: str, roots: set[str]) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    res = _compose("--profile", "fleet", "--profile", "postgres", "config", "--format", "json",
                   env_file=env_file)  # fmt: skip
    assert res.returncode == 0, res.stderr
    services = json.loads(res.stdout)["services"]
    targets = {
        (name, v["target"])
        for name, svc in services.items()
        if svc.get("image", "").startswith("${VGE_IMAGE") or "vge" in svc.get("image", "")
        for v in svc.get("volumes", [])
        if v.get("type") == "volume"
    }
    assert {"/models", "/reviews", "/data"} <= {t for _, t in targets}, targets
    for name, target in targets:
        made_here = under(target, made) or any(m.startswith(target + "/") for m in made)  # -p
        assert made_here, f"{name}: {target} is not made in the image"
        assert under(target, owned), f"{name}: {target} is not owned by {user[1]} in the image"


def test_dockerfile_env_is_valid_settings():
    from service.common.settings import Settings

    env: dict[str, str] = {}
    for k, arg in _instructions():
        if k == "ENV":
            for m in re.finditer(r"(\w+)=(\S+)", arg):
                env[m.group(1)] = m.group(2)
    vge_env = {k: v for k, v in env.items() if k.startswith("VGE_")}
    assert vge_env["VGE_HOST"] == "0.0.0.0"
    fields = {f"VGE_{name.upper()}" for name in Settings.model_fields}
    assert set(vge_env) <= fields, f"unknown settings: {set(vge_env) - fields}"
    # As in the container: an empty variable means unset (Settings has env_ignore_empty).
    Settings(**{k[4:].lower(): v for k, v in vge_env.items() if v != ""})


def test_dependency_layer_installs_the_extras_asked_for():
    """Layer 2's requirement list, made by the Dockerfile's own command (no Docker needed): the
    core dependencies and the postgres extra by default; `--build-arg VGE_EXTRAS=postgres,grpc`
    adds the gRPC front end's (which VGE_GRPC_PORT needs); an unknown extra fails the build."""
    import tomllib

    (run,) = [a for k, a in _instructions() if k == "RUN" and "requirements.txt" in a]
    code = re.search(r'python -c "(.+?)" >', run).group(1)
    default = dict(re.findall(r"ARG (\w+)=(\S+)", DOCKERFILE.read_text()))["VGE_EXTRAS"]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]

    def requirements(extras: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "VGE_EXTRAS": extras}
        return subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env,
            capture_output=True, text=True,
        )  # fmt: skip

    assert default == "postgres"
    assert requirements(default).stdout.splitlines() == project["dependencies"] + extra["postgres"]
    both = requirements("postgres, grpc").stdout.splitlines()
    assert both == project["dependencies"] + extra["postgres"] + extra["grpc"]
    assert requirements("postgres,nope").returncode != 0


def test_torch_pins_match_pyproject():
    """The Dockerfile's torch pins satisfy the ranges in pyproject.toml."""
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = {Requirement(d).name: Requirement(d) for d in deps}
    args = dict(re.findall(r"ARG (\w+)=(\S+)", DOCKERFILE.read_text()))
    assert reqs["torch"].specifier.contains(args["TORCH_VERSION"])
    assert reqs["torchvision"].specifier.contains(args["TORCHVISION_VERSION"])


def test_dockerignore_keeps_what_the_build_copies():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for kept in (
        "pyproject.toml", "README.md", "models/zoo/m/model.safetensors", "models/data/mnist-8k.npz",
        "service/cli/serve.py",
    ):  # fmt: skip
        assert not _dockerignored(kept, patterns), kept
    for dropped in (
        ".git/HEAD", ".venv/bin/python", "models/nets/__pycache__/lenet.cpython-311.pyc",
        "tests/deploy/test_deploy_static.py", ".env", "var/jobs.sqlite3",
    ):  # fmt: skip
        assert _dockerignored(dropped, patterns), dropped


# --------------------------------------------------------------------------------------------
# Grafana dashboard (static part; the metric names are checked against a live scrape in
# test_deploy_prometheus.py)
# --------------------------------------------------------------------------------------------


def test_promql_lexer():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, endpoint) (rate(a_bucket{x="y(z)"}[$__rate_interval])))'
    ) == {"a_bucket"}
    assert promql_metric_names(
        '(sum by (model) (rate(p_total{abstained="true"}[1m])) or 0 * sum(rate(p_total[5m])))'
        " / on (model) group_left sum(q)"
    ) == {"p_total", "q"}
    assert promql_metric_names("sum(g) + up offset 1h30m > 1e3") == {"g", "up"}


def test_dashboard_datasource_is_the_provisioned_one():
    prov = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    uid = prov["datasources"][0]["uid"]
    assert prov["datasources"][0]["url"] == "http://prometheus:9090"
    dash = load_dashboard()
    assert dash["uid"] and dash["title"]
    for p in dashboard_panels(dash):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == uid, p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == uid, p["title"]


def test_dashboard_covers_the_issue_and_the_metric_contract():
    dash = load_dashboard()
    exprs = dashboard_exprs(dash)
    titles = " | ".join(p["title"].lower() for p in dashboard_panels(dash))
    for word in (
        "request rate", "p50 / p95 / p99", "queue wait vs compute", "batch size distribution",
        "queue depth", "in-flight", "abstain rate", "rejections by reason",
        "training jobs by state", "device memory", "vgmu of served images", "eu of served images",
        "abstain rate vs calibrated deferral", "uncertainty drift", "predicted-class mix",
        "review queue depth", "reviews per hour by outcome", "human-model agreement",
        "time to review",
    ):  # fmt: skip
        assert word in titles, f"no panel for {word!r}"

    latency = [e for t, e in exprs if "p99" in t.lower() or "latency" in t.lower()]
    for q in ("0.5", "0.95", "0.99"):
        assert any(
            f"histogram_quantile({q}," in e
            and "vge_request_duration_seconds_bucket" in e
            and re.search(r"by \([^)]*\bendpoint\b", e)
            and re.search(r"by \([^)]*\ble\b", e)
            for e in latency
        ), f"no per-endpoint p{q} latency query"

    used = set().union(*(promql_metric_names(e) for _, e in exprs))
    allowed = set()
    for name, kind in CONTRACT_METRICS.items():
        allowed |= (
            {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
        )
    assert used <= allowed, f"not in the metric contract: {used - allowed}"
    for name in CONTRACT_METRICS:
        assert any(u == name or u.startswith(name + "_") for u in used), (
            f"{name} not on the dashboard"
        )


def _dockerignored(rel: str, patterns: list[str]) -> bool:
    """Whether ``rel`` is excluded by .dockerignore ``patterns``: a pattern matching the path or
    any parent directory excludes it, ``**/`` matches at any depth, a later ``!`` re-includes.
    (fnmatch's ``*`` also crosses ``/``, so this errs towards excluding: stricter, not laxer.)"""
    import fnmatch

    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for raw in patterns:
        neg = raw.startswith("!")
        pat = raw.lstrip("!").strip("/")
        tails = [pat[3:], "*/" + pat[3:]] if pat.startswith("**/") else [pat]
        if any(fnmatch.fnmatchcase(p, t) for p in prefixes for t in tails):
            excluded = not neg
    return excluded


def test_build_context_builds_a_wheel_with_the_default_model(tmp_path):
    """Layer 3 of the Dockerfile, without Docker: the files it COPYs (as .dockerignore leaves
    them) build the package, and the wheel carries the shipped default model as package data."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from models.zoo import DEFAULT_MODEL, default_model_dir

    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = re.findall(r"^COPY\s+(.+?)\s+\S+\s*$", DOCKERFILE.read_text(), flags=re.M)
    sources = [src for line in copies for src in line.split()]
    assert {"pyproject.toml", "README.md", "models", "service"} <= set(sources)

    missing = [src for src in sources if not (REPO / src).exists()]
    assert not missing, f"the Dockerfile COPYs {missing}, which the repository lacks"
    assert (default_model_dir() / "model_card.json").is_file(), "no shipped default model"
    ctx = tmp_path / "ctx"
    for src in sources:
        for path in [REPO / src] if (REPO / src).is_file() else sorted((REPO / src).rglob("*")):
            rel = path.relative_to(REPO).as_posix()
            if path.is_file() and not _dockerignored(rel, patterns):
                (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, ctx / rel)
    model_rel = default_model_dir().relative_to(REPO).as_posix()
    assert (ctx / model_rel / "model_card.json").is_file(), ".dockerignore drops the default model"
    assert not list(ctx.rglob("__pycache__"))

    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(ctx)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = (tmp_path / "dist").glob("vge_serve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.name for p in default_model_dir().iterdir() if p.is_file()}
    assert {f"models/zoo/{DEFAULT_MODEL}/{n}" for n in shipped} <= names
    assert "service/cli/serve.py" in names


# --------------------------------------------------------------------------------------------
# Documentation examples (issue 32: a newcomer copies them as they are)
# --------------------------------------------------------------------------------------------

README = REPO / "README.md"
DEPLOYMENT_DOC = REPO / "docs" / "deployment.md"


def _markdown_sections(path: Path) -> list[tuple[str, list[tuple[str, str]]]]:
    """``(heading, [(language, code), ...])`` per heading of ``path``, with the fenced code blocks
    under it (up to the next heading of any level; ``#`` lines inside a fence are code)."""
    sections: list[tuple[str, list[tuple[str, str]]]] = [("", [])]
    fence: tuple[str, list[str]] | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        if fence is None and line.startswith("```"):
            fence = (line[3:].strip(), [])
        elif fence is not None and line.startswith("```"):
            sections[-1][1].append((fence[0], "\n".join(fence[1])))
            fence = None
        elif fence is not None:
            fence[1].append(line)
        elif line.startswith("#"):
            sections.append((line.lstrip("#").strip(), []))
    assert fence is None, f"{path.name}: unclosed code block"
    return sections


def _blocks(path: Path, *headings: str) -> list[tuple[str, str]]:
    """The code blocks under the sections whose heading starts with one of ``headings`` (all of
    the file's blocks when none is given); each named heading must exist."""
    sections = _markdown_sections(path)
    if not headings:
        return [b for _, blocks in sections for b in blocks]
    for h in headings:
        assert any(title.startswith(h) for title, _ in sections), f"{path.name}: no section {h!r}"
    return [b for title, blocks in sections if title.startswith(headings) for b in blocks]


def _example_code() -> str:
    """Every example a newcomer runs to serve or call a model: README's Quick start, training
    jobs, V2 clients and Docker Compose sections, every block of docs/deployment.md (Kubernetes,
    KServe, tritonclient), the compose files and the Dockerfile."""
    readme = _blocks(README, "Quick start", "Training jobs", "V2 clients",
                     "Running with Docker Compose")  # fmt: skip
    parts = [code for _, code in readme + _blocks(DEPLOYMENT_DOC)]
    parts += [p.read_text() for p in (COMPOSE, COMPOSE_CPU, DOCKERFILE)]
    return "\n".join(parts)


def test_every_example_serves_and_calls_the_shipped_default_model(env_file):
    """Issue 32: the KServe example served LeNet (`storageUri`) while its client called
    `cnn4-lle-vgn-mnist`, a 404. Every example that serves a model, or calls one by name, names
    the shipped default (read from the code, not restated here)."""
    from models.zoo import DEFAULT_MODEL, zoo_models

    others = set(zoo_models()) - {DEFAULT_MODEL}
    assert DEFAULT_MODEL in zoo_models() and others, "the check below would look for nothing"
    code = _example_code()
    named = {o for o in others if o in code}
    assert not named, f"examples name {sorted(named)}, not the default {DEFAULT_MODEL}"

    # Where a model is named to serve or call, it is the default; each kind of example exists.
    named_by = {
        "KServe storageUri": re.findall(r"storageUri:\s*(\S+?)/?(?:\s|$)", code),
        "tritonclient infer()": re.findall(r"\.infer\(\s*[\"']([^\"']+)", code),
        "perf_analyzer -m": re.findall(r"perf_analyzer\s+-m\s+(\S+)", code),
        "an answer's model": re.findall(r"\"model\":\s*\"([^\"]+)\"", code),
    }
    for what, names in named_by.items():
        assert names, f"no {what} found in the examples: is this test still reading them?"
        assert {n.rsplit("/", 1)[-1] for n in names} == {DEFAULT_MODEL}, (what, names)
    for name in re.findall(r"/v2/models/([^/\s{<\"']+)", code):
        assert name == DEFAULT_MODEL, f"/v2/models/{name} in an example"
    for name in re.findall(r"--model-dir[ =](\S+)", code):
        assert name == DEFAULT_MODEL, f"--model-dir {name} in an example"

    # A model directory set in an example is KServe's download of the default (above), or none.
    for value in re.findall(r"VGE_MODEL_DIR\W+value:\s*(\S+?)[}\s]", code):
        assert value == "/mnt/models", f"VGE_MODEL_DIR={value} in docs/deployment.md"
    for files in ((COMPOSE,), (COMPOSE, COMPOSE_CPU)):
        env = _compose_json(files, env_file)["services"]["vge"]["environment"]
        assert env.get("VGE_MODEL_DIR") in (None, DEFAULT_MODEL), env.get("VGE_MODEL_DIR")
    assert not any(k == "ENV" and "VGE_MODEL_DIR=" in a for k, a in _instructions())


def test_every_file_a_doc_example_uploads_exists():
    """Issue 32: the Docker "Try it" step uploaded `digit.png`, which nobody has. Every file a
    curl example in README.md or docs/ uploads (`-F images=@PATH`) is in the repository, where
    the examples run (its root)."""
    docs = [README, *sorted((REPO / "docs").glob("*.md"))]
    uploads = {
        (doc.name, path)
        for doc in docs
        for _, code in _blocks(doc)
        for path in re.findall(r"-F\s+[\"']?\w+=@([^\s\"';]+)", code)
        if "$" not in path
    }
    missing = sorted((doc, p) for doc, p in uploads if not (REPO / p).is_file())
    assert not missing, f"examples upload files the repository lacks: {missing}"
    try_it = _blocks(README, "Running with Docker Compose")
    assert any(re.search(r"-F\s+[\"']?images=@", code) for _, code in try_it), (
        "the Docker section no longer uploads an image: update this test"
    )
