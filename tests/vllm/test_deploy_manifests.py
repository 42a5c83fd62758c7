"""deploy/k8s/ holds a working P/D deployment as far as can be checked without a cluster (none
runs here; docs/deploy.md says so): every object has the fields Kubernetes requires, each
Deployment's selector matches its pod labels, each Service selects a Deployment and targets a
named port its containers declare, every host a container names is a Service of the set, every
`--kv-transfer-config` passes kvx's validation as vLLM would run it, the proxy's flags parse as
`kvx proxy` parses them, and the container image the pods use is the one the Containerfile's
build line tags, and every object validates strictly (no unknown field) against Kubernetes' own
published schema (kubernetes-validate, offline). In .venv-vllm because it has PyYAML (the core
venv does not)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvx.config.transfer import KVTransferConfig
from kvx.proxy import cli as proxy_cli

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
REQUIRED = {"apiVersion", "kind", "metadata", "spec"}
API = {"Deployment": "apps/v1", "Service": "v1"}


def objects() -> list[dict[str, Any]]:
    found = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


OBJECTS = objects()
DEPLOYMENTS = {o["metadata"]["name"]: o for o in OBJECTS if o["kind"] == "Deployment"}
SERVICES = {o["metadata"]["name"]: o for o in OBJECTS if o["kind"] == "Service"}


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    pod = deployment["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def test_the_set_is_p_d_proxy_and_redis() -> None:
    assert set(DEPLOYMENTS) == {"kvx-prefill", "kvx-decode", "kvx-proxy", "kvx-redis"}
    assert set(SERVICES) == set(DEPLOYMENTS)


@pytest.mark.parametrize(
    "obj", OBJECTS, ids=[f"{o['kind']}/{o['metadata']['name']}" for o in OBJECTS]
)
def test_required_fields_and_api_versions(obj: dict[str, Any]) -> None:
    assert set(obj) >= REQUIRED, obj.keys()
    assert obj["apiVersion"] == API[obj["kind"]]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"])


K8S_VERSION = "1.30"  # an API version clusters run today; the objects use only stable APIs


@pytest.mark.parametrize(
    "obj", OBJECTS, ids=[f"{o['kind']}/{o['metadata']['name']}" for o in OBJECTS]
)
def test_validates_strictly_against_the_kubernetes_schema(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_schema_check_refuses_a_misspelt_field() -> None:
    """The check above has teeth: a container field with a typo is refused."""
    deployment = json.loads(json.dumps(next(iter(DEPLOYMENTS.values()))))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_deployment_selects_its_pods_and_names_its_ports(name: str) -> None:
    dep = DEPLOYMENTS[name]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    volumes = {v["name"] for v in dep["spec"]["template"]["spec"].get("volumes", [])}
    for container in containers(dep):
        assert {"name", "image"} <= set(container)
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, mount
        for probe in ("readinessProbe", "livenessProbe"):
            if probe in container:
                port = container[probe]["httpGet"]["port"]
                assert port in {p["name"] for p in container.get("ports", [])}, (name, probe)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_service_selects_a_deployment_and_targets_a_declared_port(name: str) -> None:
    svc = SERVICES[name]
    matches = [
        d
        for d in DEPLOYMENTS.values()
        if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert len(matches) == 1, name
    declared = {
        p["name"]: p["containerPort"] for c in containers(matches[0]) for p in c.get("ports", [])
    }
    for port in svc["spec"]["ports"]:
        assert port["targetPort"] in declared, (name, port)
        assert port["port"] == declared[port["targetPort"]], (name, port)


def all_args(dep: dict[str, Any]) -> list[str]:
    return [a for c in containers(dep) for a in [*c.get("command", []), *c.get("args", [])]]


def test_every_host_named_is_a_service_on_its_port() -> None:
    ports = {(n, p["port"]) for n, s in SERVICES.items() for p in s["spec"]["ports"]}
    named = set()
    for dep in DEPLOYMENTS.values():
        for arg in all_args(dep):
            named |= {(h, int(p)) for h, p in re.findall(r"//(kvx-[a-z-]+):(\d+)", arg)}
    assert named and named <= ports, named - ports


@pytest.mark.parametrize("name", ["kvx-prefill", "kvx-decode"])
def test_kv_transfer_config_validates(name: str) -> None:
    args = all_args(DEPLOYMENTS[name])
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_role"] == {"kvx-prefill": "kv_producer", "kvx-decode": "kv_consumer"}[name]
    config.pop("kv_connector_module_path")  # kvx.adapters.vllm: the same connector for kvx
    KVTransferConfig.from_dict(config)  # raises ConfigError naming the key when wrong


def test_proxy_flags_parse() -> None:
    parser = argparse.ArgumentParser()
    proxy_cli.add_arguments(parser)
    args = all_args(DEPLOYMENTS["kvx-proxy"])
    assert args[:2] == ["kvx", "proxy"]
    config = proxy_cli.config_from_args(parser.parse_args(args[2:]))
    assert config.prefill == ("http://kvx-prefill:8100",)
    assert config.decode == ("http://kvx-decode:8200",)


def test_pods_use_the_image_the_containerfile_builds() -> None:
    built = re.search(r"-t (\S+) \.", (DEPLOY / "Containerfile").read_text())
    assert built is not None
    images = {c["image"] for d in DEPLOYMENTS.values() for c in containers(d)} - {"redis:7"}
    assert images == {built.group(1)}
