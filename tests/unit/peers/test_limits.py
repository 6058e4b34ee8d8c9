"""Per-client admission (peers/limits.py): the request bucket, session slots, token and byte budgets, who the
client is, and the CLI flags that set them."""

from __future__ import annotations

import argparse
import dataclasses
from contextlib import ExitStack

import pytest

from peers.config import PeerConfig, PlacementConfig, ServerConfig
from peers.limits import (
    MAX_TRACKED_CLIENTS,
    MESSAGE_OVERHEAD_BYTES,
    Admission,
    LimitsConfig,
    RecentIds,
    SessionBudget,
    StreamBudget,
    client_key,
    stream_bytes_for,
    uploader_key,
)
from swarm.cli.peer import add_peer_flags
from swarm.errors import LimitExceeded, Overloaded


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Context:
    def __init__(self, peer: str, metadata: tuple = ()) -> None:
        self._peer, self._metadata = peer, metadata

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple:
        return self._metadata


def test_a_burst_is_admitted_then_the_sustained_rate() -> None:
    clock = Clock()
    admission = Admission(LimitsConfig(requests_per_s=8, request_burst=5), clock)
    for _ in range(5):
        admission.request("a")
    with pytest.raises(LimitExceeded, match=r"requests_per_s.*more than 8 requests/s") as caught:
        admission.request("a")
    assert caught.value.limit == "requests_per_s" and isinstance(caught.value, Overloaded)
    admission.request("b")  # another client has its own bucket
    clock.now += 0.125  # one request's worth of refill
    admission.request("a")
    with pytest.raises(LimitExceeded):
        admission.request("a")
    clock.now += 60  # refills up to the burst, not beyond
    for _ in range(5):
        admission.request("a")
    with pytest.raises(LimitExceeded):
        admission.request("a")


def test_idle_clients_are_forgotten_once_many_are_tracked() -> None:
    clock = Clock()
    admission = Admission(LimitsConfig(requests_per_s=1000, request_burst=2), clock)
    for number in range(MAX_TRACKED_CLIENTS):
        admission.request(f"client-{number}")
    assert admission.tracked_clients == MAX_TRACKED_CLIENTS
    clock.now += 1.0  # every bucket has refilled
    admission.request("newcomer")
    assert admission.tracked_clients == 1


def test_session_slots_per_client_are_given_back() -> None:
    admission = Admission(LimitsConfig(sessions_per_client=2))
    with admission.session("a"), admission.session("a"):
        assert admission.open_sessions("a") == 2
        with pytest.raises(LimitExceeded, match=r"sessions_per_client.*holds 2 of 2"), admission.session("a"):
            pass
        with admission.session("b"):
            pass
    assert admission.open_sessions("a") == 0
    with pytest.raises(RuntimeError), admission.session("a"):
        raise RuntimeError("the session failed")
    assert admission.open_sessions("a") == 0


def test_a_client_may_hold_a_fair_share_of_the_peers_sessions() -> None:
    """Above sessions_per_client while the peer has room: max_sessions // (clients holding sessions + 1)."""
    admission = Admission(LimitsConfig(sessions_per_client=2), max_sessions=12)
    with ExitStack() as held:
        for _ in range(6):  # alone: 12 // 2
            held.enter_context(admission.session("api"))
        with pytest.raises(LimitExceeded, match=r"holds 6 of 6"), admission.session("api"):
            pass
        for _ in range(4):  # beside one other: 12 // 3
            held.enter_context(admission.session("newcomer"))
        with pytest.raises(LimitExceeded, match=r"holds 4 of 4"), admission.session("newcomer"):
            pass
        for _ in range(2):  # beside two others: 12 // 4 = 3, but never below sessions_per_client
            held.enter_context(admission.session("third"))
        assert admission.open_sessions("third") == 2
    assert admission.open_sessions("api") == 0


def test_the_share_never_goes_below_sessions_per_client() -> None:
    admission = Admission(LimitsConfig(sessions_per_client=3), max_sessions=4)
    with ExitStack() as held:
        for _ in range(3):  # 4 // 2 = 2 is the share; sessions_per_client wins
            held.enter_context(admission.session("a"))
        with pytest.raises(LimitExceeded, match=r"holds 3 of 3"), admission.session("a"):
            pass


def test_session_tokens_include_every_step() -> None:
    budget = SessionBudget(10)
    budget.spend(6)
    budget.spend(4)
    with pytest.raises(LimitExceeded, match=r"session_tokens.*has run 10 tokens; 1 more would pass the limit of 10"):
        budget.spend(1)


def test_stream_bytes_count_each_message_and_its_overhead() -> None:
    budget = StreamBudget(3 * MESSAGE_OVERHEAD_BYTES + 100, "ForwardStream")
    budget.take(50)
    budget.take(50)
    budget.give_back(50)
    budget.take(50)
    with pytest.raises(LimitExceeded, match=r"stream_bytes.*ForwardStream holds"):
        budget.take(1)


def test_derived_stream_bytes_hold_the_largest_legitimate_tensor() -> None:
    payload = 8192 * 576 * 4
    limit = stream_bytes_for(8192, 576, 4 << 20)
    assert payload < limit < payload + 16 * MESSAGE_OVERHEAD_BYTES


@pytest.mark.parametrize(
    ("context", "key"),
    [
        (Context("ipv4:127.0.0.1:51234"), "ipv4:127.0.0.1"),
        (Context("ipv6:[::1]:51234"), "ipv6:[::1]"),
        (Context("unix:/tmp/socket"), "unix:/tmp/socket"),
        (Context("ipv4:10.0.0.2:1", (("x-swarm-client", "alice"),)), "name:alice"),
        (Context("ipv4:10.0.0.2:1", (("x-swarm-client", "x" * 500),)), "name:" + "x" * 64),
        (Context("ipv4:10.0.0.2:1", (("other", "alice"),)), "ipv4:10.0.0.2"),
    ],
)
def test_client_key(context: Context, key: str) -> None:
    assert client_key(context) == key


@pytest.mark.parametrize(
    ("context", "key"),
    [
        (Context("ipv4:10.0.0.2:1"), "ipv4:10.0.0.2"),
        (Context("ipv4:10.0.0.2:1", (("x-swarm-client", "alice"),)), "ipv4:10.0.0.2/name:alice"),
        (Context("ipv4:10.0.0.3:1", (("x-swarm-client", "alice"),)), "ipv4:10.0.0.3/name:alice"),  # not the same
        (Context("unix:/tmp/socket", (("x-swarm-client", "bob"),)), "unix:/tmp/socket/name:bob"),
    ],
)
def test_uploader_key_never_trusts_a_name_alone(context: Context, key: str) -> None:
    assert uploader_key(context) == key


def test_adapter_byte_flags_reach_the_limits() -> None:
    limits = PeerConfig.from_args(parse("--adapter-bytes-per-client=1000", "--adapter-bytes=5000")).server.limits
    assert (limits.adapter_bytes_per_client, limits.adapter_bytes) == (1000, 5000)
    with pytest.raises(SystemExit):
        parse("--adapter-bytes=0")


@pytest.mark.parametrize(
    "bad",
    [
        {"sessions_per_client": 0},
        {"requests_per_s": 0},
        {"request_burst": -1},
        {"stream_bytes": -1},
        {"adapter_bytes_per_client": 0},
        {"adapter_bytes": 0},
    ],
)
def test_limits_must_be_positive(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        LimitsConfig(**bad)


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_peer_flags(parser)
    return parser.parse_args(["--model", "m", "--open", *flags])


def test_flags_left_out_keep_the_configs_defaults() -> None:
    """The tuning flags have no defaults of their own (swarm/cli/_peer_flags.py): peers/config.py's are used."""
    config = PeerConfig.from_args(parse())
    assert config.server == dataclasses.replace(ServerConfig(), credentials=config.server.credentials)
    assert config.placement == PlacementConfig()


def test_threads_flag_sizes_the_compute_pool() -> None:
    """Peers sharing a machine's cores each take their share (benchmarks.wan: one each on two cores)."""
    assert PeerConfig.from_args(parse("--threads", "1")).threads == 1
    with pytest.raises(SystemExit):
        parse("--threads=-1")


def test_engine_flags_reach_the_server_config() -> None:
    flags = ("--page-size=8", "--max-batch-tokens=512", "--session-idle-s=30", "--max-sessions=2000")
    server = PeerConfig.from_args(parse(*flags)).server
    assert (server.page_size, server.max_batch_tokens, server.session_idle_s, server.max_sessions) == (
        8,
        512,
        30.0,
        2000,
    )
    with pytest.raises(SystemExit):
        parse("--page-size=0")  # argparse: "argument --page-size: must be >= 1, got 0"
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        ServerConfig(page_size=0)


def test_flags_set_the_limits() -> None:
    ns = parse(
        "--sessions-per-client=3",
        "--requests-per-s=7.5",
        "--request-burst=9",
        "--session-tokens=100",
        "--stream-bytes=5000",
        "--max-message-bytes=65536",
    )
    server = PeerConfig.from_args(ns).server
    assert server.limits == LimitsConfig(3, 7.5, 9, 100, 5000)
    assert server.max_message_bytes == 65536


def test_a_session_remembers_a_window_of_finished_step_ids_not_every_one() -> None:
    recent = RecentIds(4)
    for step_id in range(10_000):
        recent.add(step_id)
        assert step_id in recent
    assert len(recent) == 4 and 9_996 in recent and 9_995 not in recent
