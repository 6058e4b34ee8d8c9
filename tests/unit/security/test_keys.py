"""`swarm keys init` / `swarm keys issue` and loading what they write: files, certificates, clear refusals."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509

from swarm.cli import main
from swarm.errors import CredentialsError
from swarm.security import TLS_NAME, MemberVerifier, SwarmCredentials, init_swarm, issue_member

ADDRESS = "/ip4/127.0.0.1/tcp/1/p2p/QmXnBkqZqU1JmmjUcHHZxQmLkApvz6bDmVdDa2CQRo9Jcn"


def test_init_then_issue_write_a_ca_and_a_member_signed_by_it(tmp_path: Path, capsys) -> None:
    assert main(["keys", "init", str(tmp_path / "ca"), "--name", "lab"]) == 0
    assert main(["keys", "issue", str(tmp_path / "ca"), "--out", str(tmp_path / "m"), "--name", "n1",
                 "--host", "10.1.2.3", "--host", "peer.example"]) == 0  # fmt: skip
    assert "swarm lab" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "ca").iterdir()} == {"ca.pem", "ca.key"}
    assert {p.name for p in (tmp_path / "m").iterdir()} == {"ca.pem", "member.pem", "member.key"}
    for secret in (tmp_path / "ca" / "ca.key", tmp_path / "m" / "member.key"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    credentials = SwarmCredentials.load(tmp_path / "m")
    assert credentials.member_name == "n1" and not credentials.is_open
    assert MemberVerifier(credentials.ca_pem).member(credentials.cert_der()).name == "n1"
    cert = x509.load_pem_x509_certificate(credentials.cert_pem)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {TLS_NAME, "peer.example"}
    ips = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.1.2.3")}
    assert set(names.get_values_for_type(x509.IPAddress)) == ips


def test_nothing_is_overwritten(tmp_path: Path) -> None:
    init_swarm(tmp_path / "ca")
    issue_member(tmp_path / "ca", tmp_path / "m")
    with pytest.raises(CredentialsError, match="already holds a swarm CA"):
        init_swarm(tmp_path / "ca")
    with pytest.raises(CredentialsError, match="already holds a member key"):
        issue_member(tmp_path / "ca", tmp_path / "m")


def test_unusable_credentials_are_refused_with_the_reason(tmp_path: Path, keys) -> None:
    with pytest.raises(CredentialsError, match="run `swarm keys init`"):
        issue_member(tmp_path / "nowhere", tmp_path / "m")
    init_swarm(tmp_path / "ca")
    with pytest.raises(CredentialsError, match="a CA directory: issue member credentials"):
        SwarmCredentials.load(tmp_path / "ca")
    with pytest.raises(CredentialsError, match="not issued by this swarm's CA"):
        SwarmCredentials(keys.bob.ca_pem, keys.mallory.cert_pem, keys.mallory.key_pem).check()
    with pytest.raises(CredentialsError, match="does not belong to"):
        SwarmCredentials(keys.alice.ca_pem, keys.alice.cert_pem, keys.bob.key_pem).check()


def test_an_open_swarm_is_only_ever_chosen_explicitly(keys) -> None:
    with pytest.raises(CredentialsError, match=r"--credentials DIR .* or --open"):
        SwarmCredentials.choose(None, open_swarm=False)
    with pytest.raises(CredentialsError, match="not both"):
        SwarmCredentials.choose(keys.root / "alice", open_swarm=True)
    assert SwarmCredentials.choose(None, open_swarm=True).is_open
    assert SwarmCredentials.choose(keys.root / "alice", open_swarm=False) == keys.alice
    assert "key_pem" not in repr(keys.alice)


def test_every_swarm_command_refuses_to_start_without_a_choice(capsys) -> None:
    for command in (
        ["peer", "join", "--model", "m"],
        ["up", "--model", "m"],
        ["status", "--initial-peers", ADDRESS],
        ["generate", "hello", "--initial-peers", ADDRESS],
        ["monitor", "--initial-peers", ADDRESS],
        ["prometheus-targets", "--initial-peers", ADDRESS, "--out", "x.json"],
    ):
        assert main(command) == 2, command
        assert "no swarm credentials: pass --credentials DIR" in capsys.readouterr().err
