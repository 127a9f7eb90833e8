"""The Kubernetes manifests under deploy/kubernetes: each validates strictly against the
Kubernetes schema (offline, kubernetes-validate's bundled schemas), and every command, option
and variable they pass is one the daemons' command lines accept."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from starsd_draftd import cli as draftd_cli
from starsd_target import cli as target_cli

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
K8S_VERSION = "1.30.0"  # the oldest release the manifests target (PodDisruptionBudget policy/v1, probes)
COMMANDS = {"starsd-draftd": draftd_cli.main, "starsd-target": target_cli.main}


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


DOCS = _documents()


def _kinds() -> set[str]:
    return {doc["kind"] for _, doc in DOCS}


def test_the_set_is_complete():
    assert {"ConfigMap", "Secret", "Service", "Deployment", "PodDisruptionBudget",
            "PersistentVolumeClaim"} <= _kinds(), _kinds()


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in DOCS])
def test_each_manifest_validates_strictly(name, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_misspelt_field_fails_validation():
    """The check can fail: strict validation refuses a field the schema does not have."""
    doc = next(d for _, d in DOCS if d["kind"] == "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/", "port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def _containers():
    for _, doc in DOCS:
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, c


def _config_map() -> dict:
    return next(d for _, d in DOCS if d["kind"] == "ConfigMap")["data"]


def _serve(container) -> tuple[str, object]:
    name = container["command"][0]
    assert name in COMMANDS, f"{container['name']} runs {name}, not a StarSD command"
    assert container["args"][0] in COMMANDS[name].commands, container["args"]
    return name, COMMANDS[name].commands[container["args"][0]]


def test_every_option_a_container_passes_is_one_its_command_takes():
    seen = 0
    for _, c in _containers():
        name, command = _serve(c)
        known = {o for p in command.params for o in p.opts + p.secondary_opts}
        for arg in c["args"][1:]:
            if arg.startswith("--"):
                assert arg.split("=", 1)[0] in known, f"{name} {c['args'][0]} has no option {arg}"
                seen += 1
    assert seen >= 4


def test_every_variable_the_pods_get_is_one_a_command_reads():
    """The ConfigMap's variables and each container's own: each is an option's variable of the
    command that container runs (STARSD_DRAFTD_* for the draft daemon, STARSD_TARGET_* for targets),
    and its value parses as that option's type."""
    cm = _config_map()
    checked = 0
    for _, c in _containers():
        name, command = _serve(c)
        prefix = "STARSD_DRAFTD_" if name == "starsd-draftd" else "STARSD_TARGET_"
        params = {p.envvar: p for p in command.params if p.envvar}
        env = {k: v for k, v in cm.items() if k.startswith(prefix)}
        env.update({e["name"]: e.get("value") for e in c.get("env", [])})
        assert all(k.startswith(prefix) for k in env), f"{c['name']} gets another daemon's variables"
        for var, value in env.items():
            assert var in params, f"{name} serve reads no {var}"
            if value is not None and not getattr(params[var].type, "exists", False):
                params[var].type_cast_value(None, value.split() if params[var].multiple else value)
            checked += 1
    other = {k for k in cm if not k.startswith(("STARSD_DRAFTD_", "STARSD_TARGET_"))}
    assert not other, other
    assert checked >= 10


def test_probes_drain_and_keys_fit_together():
    cm = _config_map()
    draftd = next(d for d, c in _containers() if c["command"][0] == "starsd-draftd")
    target = next(d for d, c in _containers() if c["command"][0] == "starsd-target")
    pod = draftd["spec"]["template"]["spec"]
    # the drain ends by itself before Kubernetes' SIGKILL; a rollout waits until every target has
    # looked the new pod up before it drains the next old one
    assert pod["terminationGracePeriodSeconds"] > float(cm["STARSD_DRAFTD_DRAIN_TIMEOUT"])
    assert draftd["spec"]["minReadySeconds"] > float(cm["STARSD_TARGET_DRAFT_RESOLVE_INTERVAL"])
    assert draftd["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert int(cm["STARSD_DRAFTD_METRICS_PORT"]) == next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
    # targets reach every draft daemon pod through the headless Service
    svc = next(d for _, d in DOCS if d["kind"] == "Service" and d["metadata"]["name"] == "starsd-draftd")
    assert svc["spec"]["clusterIP"] == "None"
    host, port = re.fullmatch(r"tcp://([^:]+):(\d+)", cm["STARSD_TARGET_DRAFT"]).groups()
    assert host == svc["metadata"]["name"] and int(port) in {p["port"] for p in svc["spec"]["ports"]}
    # the target's probes reach /health without the API key, which comes from the Secret
    tc = target["spec"]["template"]["spec"]["containers"][0]
    assert cm["STARSD_TARGET_API_OPEN_PATHS"] == tc["readinessProbe"]["httpGet"]["path"] == "/health"
    key = next(e for e in tc["env"] if e["name"] == "STARSD_TARGET_API_KEY")["valueFrom"]["secretKeyRef"]
    secret = next(d for _, d in DOCS if d["kind"] == "Secret")
    assert key["name"] == secret["metadata"]["name"] and key["key"] in secret["stringData"]
    assert tc["lifecycle"]["preStop"] and tc["resources"]["limits"]["nvidia.com/gpu"] == 1
    for d in (draftd, target):  # every key file the pods mount is in the Secret
        for v in d["spec"]["template"]["spec"]["volumes"]:
            for item in v.get("secret", {}).get("items", []):
                assert item["key"] in secret["stringData"]
    assert any(d["kind"] == "PodDisruptionBudget" and d["spec"]["selector"] == draftd["spec"]["selector"]
               for _, d in DOCS)


def test_the_secret_holds_placeholders_not_keys():
    secret = next(d for _, d in DOCS if d["kind"] == "Secret")
    for value in secret["stringData"].values():
        assert value.startswith("replace"), "a real key in the repository"


def test_the_dockerfile_installs_the_product_and_its_commands():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_VARIANT=cpu$", text, flags=re.M)  # CUDA as a build argument
    assert "download.pytorch.org/whl/${TORCH_VARIANT}" in text
    copied = " ".join(re.findall(r"^COPY (.*)$", text, flags=re.M)).split()
    for part in ("common", "starsd_draftd", "starsd_target", "setup.cfg", "pyproject.toml"):
        assert part in copied, part
    images = {c["image"] for _, c in _containers()}
    assert images == {"starsd:latest"} and "-t starsd:latest" in text
