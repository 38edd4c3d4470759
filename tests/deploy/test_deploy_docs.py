"""docs/deploy.md keeps step with what ships: its links lead to files of the repository (under docs/, for the
docs site), the files it names exist, and the figures it
gives for the probes and the drain are the manifests' (tests/deploy/test_kubernetes.py checks that those
fit together)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
BASE = ROOT / "deploy" / "kubernetes" / "base"


def test_the_links_lead_to_files_of_the_repository():
    text = DEPLOY_DOC.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert "config.md" in targets and "prometheus/kilnproxy-alerts.yml" in targets
    for target in targets:
        if "://" not in target:
            assert (DEPLOY_DOC.parent / target).exists(), f"docs/deploy.md links to {target}, which does not exist"
            # the docs site (mkdocs, docs_dir docs/) has only what is under docs/
            assert (DEPLOY_DOC.parent / target).resolve().is_relative_to(DEPLOY_DOC.parent), target
    for path in re.findall(r"`((?:deploy|docs|tests)/[\w./-]+|Containerfile)`", text):  # files named, not linked
        assert (ROOT / path).exists(), f"docs/deploy.md names {path}, which does not exist"


def test_the_figures_of_the_drain_are_the_manifests():
    text = " ".join(DEPLOY_DOC.read_text(encoding="utf-8").split())
    deployment = yaml.safe_load((BASE / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    readiness = pod["containers"][0]["readinessProbe"]
    config = (BASE / "kilnproxy.toml").read_text()
    drain = re.search(r"^drain_seconds = (\d+)$", config, re.M).group(1)
    grace = re.search(r"^shutdown_grace_seconds = (\d+)$", config, re.M).group(1)
    assert (f"readiness every {readiness['periodSeconds']} s, {readiness['failureThreshold']} failures "
            f"({readiness['periodSeconds'] * readiness['failureThreshold']} s); `drain_seconds = {drain}`; "
            f"`shutdown_grace_seconds = {grace}`; "
            f"`terminationGracePeriodSeconds: {pod['terminationGracePeriodSeconds']}`") in text
    assert f"a **Deployment** of {deployment['spec']['replicas']} replicas" in text
