"""The Kubernetes, KServe, HAProxy and compose-fleet files under deploy/, checked as CI reads them.

* Core kinds (deploy/k8s/*.yaml): ``kubernetes-validate --strict`` against Kubernetes
  :data:`K8S_VERSION` (its schemas ship in the wheel: nothing is downloaded).
* KServe (deploy/k8s/kserve/): the ``openAPIV3Schema`` of KServe :data:`KSERVE_VERSION`'s CRDs,
  vendored under tests/deploy/kserve_crd/ (source and commit inside each file), with ``jsonschema``;
  unknown fields are refused, as ``kubectl apply --validate=strict`` refuses them.
* What the files must agree on: probes, drain and grace periods, front ends, /dev/shm and the CPU
  limit, the shared volumes, the Secret's keys, the model name the clients call.
* HAProxy (deploy/haproxy/haproxy.cfg): ``haproxy -c``; compose's fleet profile with a real
  Compose v2 binary.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deploy_helpers import REPO, find_tool, run_tool

K8S = REPO / "deploy" / "k8s"
KSERVE = K8S / "kserve"
CRDS = Path(__file__).with_name("kserve_crd")
HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
COMPOSE = REPO / "docker-compose.yml"

#: The Kubernetes release the core manifests are validated against (kubernetes-validate's
#: bundled schemas; ``kubernetes-validate --version`` lists what it ships).
K8S_VERSION = "1.33.0"
#: The KServe release whose CRD schemas the KServe manifests are validated against.
KSERVE_VERSION = "v0.15.2"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _core_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _by_kind() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in _core_files():
        for doc in _docs(path):
            out.setdefault(doc["kind"], doc)
    return out


# --------------------------------------------------------------------------- validation


def test_core_manifests_pass_kubernetes_validate_strict() -> None:
    """Every core manifest, strict (unknown fields are errors), offline, against K8S_VERSION."""
    files = _core_files()
    kinds = {d["kind"] for p in files for d in _docs(p)}
    assert kinds >= {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                     "ConfigMap", "PersistentVolumeClaim"}, kinds  # fmt: skip
    tool = find_tool("kubernetes-validate")
    res = run_tool([tool, "--strict", "-k", K8S_VERSION, *map(str, files)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("passed") == sum(len(_docs(p)) for p in files), res.stdout


def test_kubernetes_validate_strict_refuses_a_misspelt_field(tmp_path: Path) -> None:
    """The check above can fail: a typo in the Deployment (``readinesProbe``) is refused."""
    bad = tmp_path / "deployment.yaml"
    bad.write_text((K8S / "deployment.yaml").read_text().replace("readinessProbe", "readinesProbe"))
    res = run_tool([find_tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, str(bad)])
    assert res.returncode != 0 and "readinesProbe" in res.stdout + res.stderr


def test_kustomization_lists_every_core_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in _core_files())


def _strict(schema: Any) -> Any:
    """A CRD schema that refuses unknown fields (as the API server's strict field validation):
    ``additionalProperties: false`` on every object with ``properties`` that neither declares
    additional properties nor preserves unknown fields. ``metadata`` is the API server's (a bare
    object in a CRD) and stays open."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def _crd(kind: str) -> dict[str, Any]:
    name = {"InferenceService": "inferenceservices", "ServingRuntime": "servingruntimes"}[kind]
    with gzip.open(CRDS / f"{name}-{KSERVE_VERSION}.json.gz", "rt", encoding="utf-8") as f:
        crd = json.load(f)
    assert crd["kind"] == kind and f"/{KSERVE_VERSION}/" in crd["source"], crd["source"]
    return crd


def _kserve_errors(doc: dict[str, Any]) -> list[str]:
    import jsonschema

    crd = _crd(doc["kind"])
    assert doc["apiVersion"] == f"{crd['group']}/{crd['version']}", doc["apiVersion"]
    validator = jsonschema.Draft7Validator(_strict(crd["openAPIV3Schema"]))
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


@pytest.mark.parametrize("name", ["servingruntime.yaml", "inferenceservice.yaml"])
def test_kserve_manifests_match_the_crd_schema(name: str) -> None:
    (doc,) = _docs(KSERVE / name)
    assert _kserve_errors(doc) == []


def test_kserve_schema_check_refuses_unknown_and_mistyped_fields() -> None:
    """The check above can fail: an unknown field and a wrong type are both reported."""
    (isvc,) = _docs(KSERVE / "inferenceservice.yaml")
    isvc["spec"]["predictor"]["model"]["storageUrl"] = "s3://x"
    isvc["spec"]["predictor"]["minReplicas"] = "one"
    errors = "\n".join(_kserve_errors(isvc))
    assert "storageUrl" in errors and "minReplicas" in errors, errors


# --------------------------------------------------------------------------- consistency


def _container() -> dict[str, Any]:
    (container,) = _by_kind()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def _env() -> dict[str, Any]:
    """The container's settings: the ConfigMap's, then its own ``env`` (values or references)."""
    env: dict[str, Any] = dict(_by_kind()["ConfigMap"]["data"])
    for var in _container()["env"]:
        env[var["name"]] = var.get("value", var.get("valueFrom"))
    return env


def _quantity_mib(q: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024**2}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti)", q)
    assert m, q
    return float(m.group(1)) * units[m.group(2)]


def _cpus(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_deployment_probes_drain_and_grace_agree_with_the_settings() -> None:
    from service.common.settings import Settings

    dep = _by_kind()["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    c = _container()
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    env = _env()
    settings = Settings(**{k[4:].lower(): v for k, v in env.items()
                           if k.startswith("VGE_") and isinstance(v, str)})  # fmt: skip
    assert settings.port == port
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    # The pod must outlive preStop + the server's own drain + its shutdown grace.
    assert (
        pod["terminationGracePeriodSeconds"]
        > pre_stop + settings.drain_s + settings.shutdown_grace_s
    )
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_front_ends_and_dev_shm_follow_the_cpu_limit() -> None:
    """VGE_WORKERS is the CPU limit less one (0 would count the node's cores), and /dev/shm (a
    memory emptyDir) holds an arena per front end."""
    c = _container()
    env = _env()
    limit = _cpus(c["resources"]["limits"]["cpu"])
    workers = int(env["VGE_WORKERS"])
    assert workers == max(1, math.ceil(limit) - 1)
    volumes = {
        v["name"]: v for v in _by_kind()["Deployment"]["spec"]["template"]["spec"]["volumes"]
    }
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert _quantity_mib(shm["sizeLimit"]) >= workers * int(env["VGE_SHM_MB_PER_WORKER"])
    assert _quantity_mib(c["resources"]["limits"]["memory"]) > _quantity_mib(shm["sizeLimit"])


def test_shared_volumes_secrets_and_fleet_settings() -> None:
    """Models (ReadWriteMany: a promote through any replica is served by all) and review images
    on shared claims at the paths the settings name; the API key and the database URL from the
    Secret; each replica named after its pod."""
    kinds = _by_kind()
    c = _container()
    env = _env()
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in pod["volumes"] if "persistentVolumeClaim" in v}  # fmt: skip
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    pvcs = {d["metadata"]["name"]: d for d in _docs(K8S / "pvc.yaml")}
    for setting in ("VGE_MODELS_ROOT", "VGE_REVIEW_DIR"):
        claim = claims[mounts[env[setting]]]
        assert pvcs[claim]["spec"]["accessModes"] == ["ReadWriteMany"], claim
    assert env["VGE_API_KEY"] == {"secretKeyRef": {"name": "vge-serve", "key": "api-key"}}
    assert env["VGE_DB_URL"] == {"secretKeyRef": {"name": "vge-serve", "key": "db-url"}}
    assert env["VGE_REPLICA_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "VGE_MODEL_DIR" not in env  # the fleet's first start: the shipped default
    assert not any(k in kinds["ConfigMap"]["data"] for k in ("VGE_API_KEY", "VGE_DB_URL"))


def test_service_pdb_and_hpa_select_the_deployment() -> None:
    kinds = _by_kind()
    dep = kinds["Deployment"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert kinds["Service"]["spec"]["selector"] == labels
    assert kinds["Service"]["spec"]["ports"][0]["targetPort"] == "http"
    assert kinds["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == labels
    hpa = kinds["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": dep["metadata"]["name"]}  # fmt: skip
    assert hpa["minReplicas"] > kinds["PodDisruptionBudget"]["spec"]["maxUnavailable"]
    pods = [m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"]
    from service.common.metrics import Metrics

    exported = Metrics().render().decode()
    for name in pods:  # a metric the replicas really export
        assert f"# TYPE {name} " in exported, name


def test_kserve_serves_the_shipped_default_under_the_name_clients_call() -> None:
    """The InferenceService's model is the shipped default, by the name in its card, which is
    what the V2 client examples call."""
    from models.zoo import DEFAULT_MODEL

    (isvc,) = _docs(KSERVE / "inferenceservice.yaml")
    (runtime,) = _docs(KSERVE / "servingruntime.yaml")
    model = isvc["spec"]["predictor"]["model"]
    assert isvc["metadata"]["name"] == DEFAULT_MODEL
    assert model["storageUri"].rstrip("/").rsplit("/", 1)[-1] == DEFAULT_MODEL
    assert model["runtime"] == runtime["metadata"]["name"] and model["protocolVersion"] == "v2"
    assert runtime["spec"]["protocolVersions"] == ["v2"]
    assert model["modelFormat"]["name"] in {
        f["name"] for f in runtime["spec"]["supportedModelFormats"]
    }
    card = json.loads((REPO / "models" / "zoo" / DEFAULT_MODEL / "model_card.json").read_text())
    assert card["name"] == DEFAULT_MODEL
    (container,) = runtime["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["VGE_MODEL_DIR"] == "/mnt/models" and env["VGE_PORT"] == "8080"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"


def test_kserve_front_ends_and_dev_shm_follow_the_cpu_limit() -> None:
    """As the Deployment's: the runtime's VGE_WORKERS is its CPU limit less one (unset, the
    server would count the node's cores under a CFS quota and start far too many front ends),
    and its /dev/shm holds an arena per front end."""
    from service.common.settings import Settings

    (runtime,) = _docs(KSERVE / "servingruntime.yaml")
    (c,) = runtime["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    workers = int(env["VGE_WORKERS"])
    assert workers == max(1, math.ceil(_cpus(c["resources"]["limits"]["cpu"])) - 1)
    volumes = {v["name"]: v for v in runtime["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    per_worker = int(env.get("VGE_SHM_MB_PER_WORKER", Settings().shm_mb_per_worker))
    assert shm["medium"] == "Memory" and _quantity_mib(shm["sizeLimit"]) >= workers * per_worker


# --------------------------------------------------------------------------- HAProxy, compose


def haproxy_binary() -> str:
    """Debian's haproxy (in /usr/sbin, which a user's PATH may lack); a failure naming the
    install line when it is missing (CI must run these checks, not skip them)."""
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        pytest.fail("haproxy not found; install it with: bash scripts/install-system-deps.sh")
    return found


def test_haproxy_config_is_valid_and_checks_readiness() -> None:
    haproxy = haproxy_binary()
    res = run_tool([haproxy, "-c", "-f", str(HAPROXY_CFG)])
    assert res.returncode == 0, res.stdout + res.stderr
    text = HAPROXY_CFG.read_text()
    assert "http-check send meth GET uri /readyz" in text
    assert re.search(r"^\s*retry-on .*conn-failure.*empty-response.*503", text, re.M)
    assert re.search(r"^\s*option redispatch", text, re.M)
    assert re.search(r"^\s*retries [1-9]", text, re.M)


def test_compose_fleet_profile(tmp_path: Path) -> None:
    """``--profile fleet``: N replicas on one PostgreSQL (VGE_DB_URL) with shared models and
    review volumes, behind HAProxy with the project's haproxy.cfg; without the profile, none."""
    from service.common.settings import Settings
    from tests.deploy.test_deploy_static import ENV_EXAMPLE, _clean_env

    env_file = tmp_path / ".env"
    filled = {"VGE_API_KEY=": "VGE_API_KEY=ci-test-key-0123",
              "GRAFANA_ADMIN_PASSWORD=": "GRAFANA_ADMIN_PASSWORD=ci-grafana-0123",
              "POSTGRES_PASSWORD=": "POSTGRES_PASSWORD=ci-postgres-0123"}  # fmt: skip
    env_file.write_text(
        "\n".join(filled.get(ln, ln) for ln in ENV_EXAMPLE.read_text().splitlines())
    )

    def config(*profile: str) -> dict[str, Any]:
        cmd = [find_tool("docker-compose"), "--project-directory", str(REPO), "--env-file",
               str(env_file), "-f", str(COMPOSE), *profile, "config", "--format", "json"]  # fmt: skip
        res = run_tool(cmd, env=_clean_env())
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)["services"]

    assert not {"vge-fleet", "haproxy"} & set(config())
    services = config("--profile", "fleet")
    fleet, lb = services["vge-fleet"], services["haproxy"]
    assert fleet["deploy"]["replicas"] >= 2
    env = fleet["environment"]
    assert env["VGE_DB_URL"].startswith("postgresql://vge:ci-postgres-0123@postgres:5432/")
    Settings(**{k[4:].lower(): v for k, v in env.items() if k.startswith("VGE_") and v != ""})
    targets = {v["target"]: v for v in fleet["volumes"]}
    assert targets[env["VGE_MODELS_ROOT"]]["type"] == "volume"
    assert targets[env["VGE_REVIEW_DIR"]]["type"] == "volume"
    assert fleet["depends_on"]["postgres"]["condition"] == "service_healthy"
    (cfg,) = lb["volumes"]
    assert Path(cfg["source"]) == HAPROXY_CFG and cfg["read_only"]
    assert lb["depends_on"]["vge-fleet"]["condition"] == "service_healthy"
    assert "vge-fleet:8000" in HAPROXY_CFG.read_text()
    assert "fleet" in services["postgres"]["profiles"]
