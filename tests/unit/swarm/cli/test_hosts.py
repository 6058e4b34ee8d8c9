"""--host and --announce-host on every command that runs a server or a DHT node others dial (`swarm peer join`,
`swarm up`, `swarm dht`, `swarm train`), and `host`/`announce_host` in a training job's YAML: parsed, checked, and
carried into the configs the servers are built from."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import pytest

from swarm.cli import build_parser, main
from swarm.errors import InvalidRequest
from swarm.training.config import config_from_dict, load_config

JOIN = ["peer", "join", "--open", "--model", "m"]
UP = ["up", "--open", "--model", "m"]
DHT = ["dht", "--open"]
TRAIN = ["train", "job.yaml"]
JOB = {"run_id": "r", "model": "m", "credentials": "open", "data": {"path": "d"}}


@pytest.mark.parametrize("command", [JOIN, UP, DHT], ids=["peer join", "up", "dht"])
def test_daemons_default_to_loopback_and_take_both_flags(command: list[str]) -> None:
    ns = build_parser().parse_args(command)
    assert (ns.host, ns.announce_host) == ("127.0.0.1", "")
    ns = build_parser().parse_args([*command, "--host", "0.0.0.0", "--announce-host", "203.0.113.7"])
    assert (ns.host, ns.announce_host) == ("0.0.0.0", "203.0.113.7")


def test_train_flags_override_the_job_config_only_when_given() -> None:
    ns = build_parser().parse_args(TRAIN)
    assert (ns.host, ns.announce_host) == (None, None)
    ns = build_parser().parse_args([*TRAIN, "--host", "0.0.0.0", "--announce-host", "peer.example.org"])
    assert (ns.host, ns.announce_host) == ("0.0.0.0", "peer.example.org")


@pytest.mark.parametrize("command", [JOIN, UP, DHT, TRAIN], ids=["peer join", "up", "dht", "train"])
@pytest.mark.parametrize(
    ("flags", "flag", "words"),
    [
        (["--host", "peer.example.org"], "--host", "not an IP address"),
        (["--announce-host", "0.0.0.0"], "--announce-host", "not an address others can dial"),
        (["--announce-host", "no spaces"], "--announce-host", "neither an IP address nor a DNS name"),
    ],
)
def test_a_bad_address_is_a_usage_error_naming_the_flag(command, flags, flag, words, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*command, *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and words in err


def test_peer_config_carries_both_addresses_to_the_server_and_the_dht_node() -> None:
    from peers.config import PeerConfig

    ns = build_parser().parse_args(
        [*JOIN, "--host", "0.0.0.0", "--announce-host", "203.0.113.7", "--dht-port", "31337"]
    )
    config = PeerConfig.from_args(ns)
    assert (config.host, config.announce_host, config.dht_port) == ("0.0.0.0", "203.0.113.7", 31337)
    assert (config.server.host, config.server.announce_host) == ("0.0.0.0", "203.0.113.7")


@pytest.mark.parametrize("command", [["peer", "join"], ["up"], ["dht"]], ids=["peer join", "up", "dht"])
def test_a_wildcard_with_no_route_stops_before_anything_starts(
    command: list[str], smollm2_path: Path, monkeypatch, capsys
) -> None:
    def unreachable(self, address):
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(socket.socket, "connect", unreachable)
    model = [] if command == ["dht"] else ["--model", str(smollm2_path)]
    assert main([*command, "--open", *model, "--host", "0.0.0.0"]) == 2
    assert "--announce-host: listening on every interface, but no route" in capsys.readouterr().err


def test_job_config_defaults_to_loopback_and_takes_host_and_announce_host(tmp_path: Path) -> None:
    config = config_from_dict(dict(JOB))
    assert (config.host, config.announce_host) == ("127.0.0.1", "")
    assert config.hosts.announced() == "127.0.0.1"
    config = config_from_dict({**JOB, "host": "0.0.0.0", "announce_host": "10.0.0.5"})
    assert config.hosts.announced() == "10.0.0.5" and config.hosts.bind_address(0) == "0.0.0.0:0"
    path = tmp_path / "job.yaml"
    path.write_text("run_id: r\nmodel: m\ncredentials: open\ndata: {path: d}\nhost: 127.0.0.2\n")
    assert load_config(path).host == "127.0.0.2"
    overridden = load_config(path, host="0.0.0.0", announce_host="127.0.0.3")
    assert (overridden.host, overridden.announce_host) == ("0.0.0.0", "127.0.0.3")
    assert load_config(path, host=None, announce_host=None).host == "127.0.0.2"


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"host": "example.org"}, "host: 'example.org' is not an IP address"),
        ({"announce_host": "::"}, "announce_host"),
    ],
)
def test_job_config_refuses_bad_addresses_by_key(raw: dict, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        config_from_dict({**JOB, **raw})


def test_stage_port_from_yaml_cli_and_python(tmp_path: Path) -> None:
    """`stage_port` in the job's YAML, `swarm train --stage-port` over it, and TrainConfig(stage_port=...)."""
    assert config_from_dict(dict(JOB)).stage_ports == range(0, 1)  # any free port
    assert config_from_dict({**JOB, "stage_port": 7000}).stage_ports == range(7000, 7001)
    assert config_from_dict({**JOB, "stage_port": "7000-7009"}).stage_ports == range(7000, 7010)
    path = tmp_path / "job.yaml"
    path.write_text("run_id: r\nmodel: m\ncredentials: open\ndata: {path: d}\nstage_port: 7100-7101\n")
    assert load_config(path).stage_ports == range(7100, 7102)
    assert load_config(path, stage_port=None).stage_ports == range(7100, 7102)
    ns = build_parser().parse_args([*TRAIN, "--stage-port", "7200"])
    assert load_config(path, stage_port=ns.stage_port).stage_ports == range(7200, 7201)
    assert build_parser().parse_args(TRAIN).stage_port is None


@pytest.mark.parametrize("port", [-1, 65536, "7010-7000", "0-10", "seven", "7000-"])
def test_stage_port_refuses_what_is_no_port_or_range(port: object) -> None:
    with pytest.raises(InvalidRequest, match="stage_port must be a port"):
        config_from_dict({**JOB, "stage_port": port})
