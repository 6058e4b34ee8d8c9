"""A swarm whose peer of blocks [15, 30) sits behind a NAT (issue 40), over a WanLink on a public-looking segment:
`swarm dht --relay` (the bootstrap, keeping relay slots) on host "bootstrap", `swarm peer join` of blocks [0, 15) on
"peer0", the client on "client", and the second peer either public on "peer1" (direct) or in a home namespace
behind router "gw" (benchmarks/netns/nat.py), joined with `--via-relay`. Peers run `--no-ray`. Used by
`python -m benchmarks.nat` and tests/integration/cluster/test_netns_nat_swarm.py."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.netns import PUBLIC_SUBNET, HomeNetwork, WanLink
from benchmarks.netns.nat import Mapping
from benchmarks.wan_swarm import Command
from swarm.registry.tunnel import is_tunnel

HOSTS = ["bootstrap", "relay2", "peer0", "client", "gw", "peer1", "dht1", "dht2"]
RELAY_HOSTS = ("bootstrap", "relay2")  # the `swarm dht --relay` nodes (peer0 relays too, but serves blocks [0, 15))
# libp2p starts hole punching once 4 other nodes have seen the same public address of a peer behind NAT: its relays,
# and as many plain DHT nodes as make up the rest, all of them initial peers, so that all have seen it before the
# client's connection arrives through the relay (after that, that connection is not punched).
PUNCH_OBSERVERS = 4
START_TIMEOUT_S = 180
SERVING = r"peer \w+ serving blocks \[\d+, \d+\) of \S+ at (\S+)"
RELAYED = r"serving through the relay at (\S+)"


@dataclass
class NatSwarm:
    net: WanLink
    home: HomeNetwork
    model: Path
    initial_peers: str = ""
    credentials: Path | None = None  # a private swarm's member directory (every part is that member); None: open
    peers: dict[str, Command] = field(default_factory=dict)
    address: str = ""  # the address the second peer announced: a relay's circuit address when behind NAT

    def start_peer(self, host: str, blocks: str, *extra: str) -> Command:
        """`swarm peer join --no-ray` of `blocks` on `host` ("home": behind the NAT); returns at once."""
        net = self.home if host == "home" else self.net
        flags = [*self.credential_flags, "--model", str(self.model), "--initial-peers", self.initial_peers]
        flags += ["--blocks", blocks]
        flags += ["--no-ray", "--host", net.address(host), "--ttl", "6", "--drain-grace", "2", *extra]
        self.peers[host] = Command(net, host, ["-m", "swarm", "peer", "join", *flags])
        return self.peers[host]

    def start_client(
        self, prompt_ids: Sequence[int], new_tokens: int, warmup: bool = False, pause: tuple[int, Path] | None = None
    ) -> Command:
        """benchmarks/wan_client.py's greedy generation from host "client" (it prints each token as it comes); with
        `pause` (token, resume file) it holds after that token until the file exists."""
        args = ["-m", "benchmarks.wan_client", "--model", str(self.model), "--initial-peers", self.initial_peers]
        args += ["--prompt-ids", ",".join(map(str, prompt_ids)), "--max-new-tokens", str(new_tokens)]
        args += ["--codec", "NONE", "--dht-host", self.net.address("client"), "--warmup" if warmup else "--no-warmup"]
        args += ["--credentials", str(self.credentials)] if self.credentials else []
        args += ["--pause-after-token", str(pause[0]), "--resume-file", str(pause[1])] if pause else []
        return Command(self.net, "client", args)

    @property
    def credential_flags(self) -> list[str]:
        return ["--credentials", str(self.credentials)] if self.credentials else ["--open"]

    def generate(self, prompt_ids: Sequence[int], new_tokens: int, warmup: bool = False) -> dict:
        """A client's generation, to its end: its JSON line."""
        return result_of(self.start_client(prompt_ids, new_tokens, warmup))

    def kill_relay_in_use(self, client: Command, resume_file: Path, relays: Sequence[str] = RELAY_HOSTS) -> str:
        """Once `client` (started with a pause) holds, SIGKILL the host of the relay its connection to the peer goes
        through, one of `relays`, then let the client go on by creating `resume_file`; that host. The client names
        the relay: libp2p reuses any connection it has to the peer, through whichever of the peer's relays."""
        in_use = json.loads(client.wait_for(r"^paused (.*)$", START_TIMEOUT_S).group(1))["relays"]
        host = self.host_at(in_use[0]) if len(in_use) == 1 else ""
        if host not in relays:
            raise RuntimeError(f"the client's connection should go through one of {list(relays)}: {in_use}")
        if not self.net.kill_host(host):
            raise RuntimeError(f"nothing ran on {host}")
        resume_file.touch()
        return host

    def host_at(self, address: str) -> str:
        """The public host whose address `address` (host:port) names."""
        return next(host for host in HOSTS if address.rsplit(":", 1)[0] == self.net.address(host))


def result_of(client: Command) -> dict:
    return json.loads(client.wait_for(r"^\{.*\}$", START_TIMEOUT_S).group(0))


@contextlib.contextmanager
def nat_swarm(
    model: Path,
    behind_nat: bool = True,
    mapping: Mapping = "symmetric",
    rtt_ms: float = 0.0,
    relays: int = 1,
    credentials: Path | None = None,
) -> Iterator[NatSwarm]:
    """The swarm, serving; every namespace and process is gone when the block ends. `relays`: 2 adds a second
    `swarm dht --relay` on host "relay2", and everyone joins through both. Behind a cone NAT, plain DHT nodes on
    "dht1" and "dht2" join the initial peers up to PUNCH_OBSERVERS, so that the peer's connections get punched.
    `credentials`: a private swarm (a member's directory, every part that member), whose relays are its own."""
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(WanLink(HOSTS, rtt_ms=rtt_ms, subnet=PUBLIC_SUBNET))
        home = stack.enter_context(HomeNetwork(net, "gw", "home", mapping=mapping))
        swarm = NatSwarm(net, home, model, credentials=credentials)
        swarm.initial_peers = start_relay(net, "bootstrap", [], swarm.credential_flags)
        if relays > 1:
            swarm.initial_peers += "," + start_relay(net, "relay2", [swarm.initial_peers], swarm.credential_flags)
        if behind_nat and mapping == "cone":
            for host in ["dht1", "dht2"][: PUNCH_OBSERVERS - relays]:
                swarm.initial_peers += "," + start_relay(
                    net, host, [swarm.initial_peers], swarm.credential_flags, relay=False
                )
        swarm.start_peer("peer0", "0:15", "--relay")  # its DHT node then dials relays: it pushes to a relayed peer
        second = swarm.start_peer("home", "15:30", "--via-relay") if behind_nat else swarm.start_peer("peer1", "15:30")
        served = {host: command.wait_for(SERVING, START_TIMEOUT_S).group(1) for host, command in swarm.peers.items()}
        swarm.address = second.wait_for(RELAYED, 60).group(1) if behind_nat else served["peer1"]
        yield swarm


def start_relay(
    net: WanLink, host: str, initial_peers: list[str], credential_flags: list[str], relay: bool = True
) -> str:
    """`swarm dht --relay` (`relay=False`: a plain `swarm dht`) on `host`, joined through `initial_peers`: its
    multiaddress, once it serves."""
    flags = [*credential_flags, "--host", net.address(host), *(f"--initial-peers={peer}" for peer in initial_peers)]
    flags += ["--relay"] if relay else []
    return Command(net, host, ["-m", "swarm", "dht", *flags]).wait_for(r"initial peers: (\S+)", 60).group(1)


def relayed_hops(route: str) -> list[bool]:
    """Per hop of a wan_client route line, whether it goes through a relay."""
    return [is_tunnel(hop) for hop in route.split(",")]
