"""The cluster configs in cluster/ pass Ray's own validation, offline:

- the launcher YAMLs (AWS spot, GCP preemptible) go through `prepare_config` (merged with Ray's provider
  defaults) and `validate_config` (Ray's JSON schema plus its cross-checks), as `ray up` does before it calls the
  cloud;
- the KubeRay RayCluster goes through the KubeRay autoscaler's own reader, which derives an autoscaling config from
  the manifest and validates it, plus structural checks of the manifest that Kubernetes would make (port names,
  replica bounds, string-valued rayStartParams, containers with images);
- every `swarm ...` command the configs run parses with the real `swarm` argument parser, and every one that talks
  to the swarm runs it as a private swarm (`--credentials`).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
from ray.autoscaler._private.util import prepare_config, validate_config

from swarm.cli import build_parser

CLUSTER = Path(__file__).resolve().parents[3] / "cluster"
LAUNCHER_CONFIGS = {"aws-spot.yaml": "spot", "gcp-preemptible.yaml": "preemptible"}
PORT_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$")  # Kubernetes IANA_SVC_NAME: at most 15 characters
SHELL_VALUES = {  # what the shell would substitute, for parsing the commands
    r'"\$\(hostname -I \| awk \'\{print \$1\}\'\)"': "10.0.0.2",
    r'"\$\(cat ~/swarm-initial-peers\)"': "/ip4/10.0.0.1/tcp/31337/p2p/QmXnBkqZqU1JmmjUcHHZxQmLkApvz6bDmVdDa2CQRo9Jcn",
    r'"\$PEERS"': "/ip4/10.0.0.1/tcp/31337/p2p/QmXnBkqZqU1JmmjUcHHZxQmLkApvz6bDmVdDa2CQRo9Jcn",
    r'"\$IP"|"\$POD_IP"': "10.0.0.2",
    r"\$SWARM_PEER_FLAGS": "--num-blocks 8 --dtype float16",
    r'"\{\\"node:\$(IP|POD_IP)\\": 0\.01\}"': "'{\"node:10.0.0.2\": 0.01}'",
}


def swarm_commands(shell: str) -> list[list[str]]:
    """The argument lists of every `swarm ...` command in a shell snippet, up to its redirection or `&`."""
    for pattern, value in SHELL_VALUES.items():
        shell = re.sub(pattern, value, shell)
    return [shlex.split(match) for match in re.findall(r"\bswarm (.+?)(?:>|&|;|$)", shell)]


def check_commands_parse(commands: list[str]) -> list[list[str]]:
    parsed = [args for command in commands for args in swarm_commands(command)]
    for args in parsed:
        ns = build_parser().parse_args(args)  # SystemExit on an unknown flag
        assert ns.run is not None
        if hasattr(ns, "credentials"):
            assert ns.credentials is not None and not ns.open, f"swarm {args[0]} is not run as a private swarm"
    return parsed


@pytest.mark.parametrize("name", sorted(LAUNCHER_CONFIGS))
def test_launcher_config_passes_ray_validation(name: str) -> None:
    config = prepare_config(yaml.safe_load((CLUSTER / name).read_text()))
    validate_config(config)
    workers = {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}
    assert len(workers) >= 3, "several kinds of GPU workers"
    market = LAUNCHER_CONFIGS[name]
    for node_type, spec in workers.items():
        assert spec["resources"].get("GPU", 0) >= 1 and spec["resources"].get(market) == 1, node_type
        node = spec["node_config"]
        if market == "spot":
            assert node["InstanceMarketOptions"]["MarketType"] == "spot", node_type
        else:
            assert {"preemptible": True} in node["scheduling"], node_type
    assert config["available_node_types"][config["head_node_type"]]["resources"] == {"CPU": 0}


@pytest.mark.parametrize("name", sorted(LAUNCHER_CONFIGS))
def test_launcher_config_starts_the_swarm(name: str) -> None:
    config = yaml.safe_load((CLUSTER / name).read_text())
    head = check_commands_parse(config["head_start_ray_commands"])
    workers = check_commands_parse(config["worker_start_ray_commands"])
    assert [args[:3] for args in head if args[0] == "up"] == [["up", "--peers", "0"]]
    assert {args[0] for args in head} == {"up", "monitor", "prometheus-targets"}
    (join,) = workers
    assert join[:2] == ["peer", "join"] and "--initial-peers" not in join  # the address comes through Ray
    assert join[join.index("--ray-address") + 1] == "auto" and "--ray-resources" in join


def test_kuberay_manifest_is_read_by_rays_kuberay_autoscaler() -> None:
    manifest = yaml.safe_load((CLUSTER / "kuberay-raycluster.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayCluster")
    derived = _derive_autoscaling_config_from_ray_cr(manifest)  # validates it with Ray's schema too
    workers = {k: v for k, v in derived["available_node_types"].items() if k != derived["head_node_type"]}
    assert len(workers) >= 2 and all(spec["resources"]["GPU"] == 1 for spec in workers.values())
    assert derived["available_node_types"]["headgroup"]["resources"]["CPU"] == 0


def test_kuberay_manifest_structure() -> None:
    manifest = yaml.safe_load((CLUSTER / "kuberay-raycluster.yaml").read_text())
    spec = manifest["spec"]
    assert manifest["metadata"]["name"] and manifest["metadata"]["namespace"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    names = [group["groupName"] for group in spec["workerGroupSpecs"]]
    assert len(names) == len(set(names))
    for group in groups:
        assert all(isinstance(value, str) for value in group["rayStartParams"].values()), "KubeRay wants strings"
        for container in group["template"]["spec"]["containers"]:
            assert container["name"] and container["image"]
            assert all(PORT_NAME.match(port["name"]) for port in container.get("ports", [])), container["ports"]
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        start = container["lifecycle"]["postStart"]["exec"]["command"][-1]
        environment = {item["name"]: item.get("value", "") for item in container["env"]}
        (join,) = check_commands_parse([start.replace("$SWARM_PEER_FLAGS", environment["SWARM_PEER_FLAGS"])])
        assert join[:2] == ["peer", "join"] and "--initial-peers" not in join
        assert "kill -TERM" in container["lifecycle"]["preStop"]["exec"]["command"][-1]  # the daemon drains
    (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
    commands = check_commands_parse([head["lifecycle"]["postStart"]["exec"]["command"][-1]])
    assert [args[0] for args in commands] == ["up", "monitor", "prometheus-targets"]
