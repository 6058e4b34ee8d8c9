"""The NAT harness (benchmarks/netns/nat.py), with real TCP sockets: a home host behind a cone or a symmetric NAT
reaches public hosts from the router's public address; the cone NAT keeps one public port for one home port across
destinations and the symmetric NAT does not; no public host can open a connection to the home, not even with a
route to its private subnet; and closing leaves nothing behind."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

import pytest

from benchmarks.netns import HomeNetwork, WanLink, namespaces, nat_unavailable_reason

from ..daemons import poll_until

REASON = nat_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"NAT tests need network namespaces and nft: {REASON}"),
    pytest.mark.timeout(60),
]

# Prints "ready", then the address and port of each peer it accepts, one line each, until killed.
SERVE = (
    "import socket, sys; s = socket.create_server((sys.argv[1], int(sys.argv[2]))); print('ready', flush=True)\n"
    "while True: print(*s.accept()[1], flush=True)"
)
# Connects from the source port argv[1] (0: any) to port argv[2] of each host that follows, one socket each.
DIAL = (
    "import socket, sys; sockets = []\n"
    "for host in sys.argv[3:]:\n"
    "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); sockets.append(s)\n"
    "    s.bind(('', int(sys.argv[1]))); s.connect((host, int(sys.argv[2])))"
)
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)"
MAPPINGS = ["cone", "symmetric"]


@pytest.fixture(scope="module")
def wan() -> Iterator[tuple[WanLink, dict[str, HomeNetwork]]]:
    """Two public hosts, a and b, and two routers, each with a home behind it: one NAT of each kind."""
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(WanLink([*MAPPINGS, "a", "b"]))
        homes = {m: stack.enter_context(HomeNetwork(net, m, f"home-{m}", m)) for m in MAPPINGS}
        yield net, homes


def serve(net: WanLink, host: str, port: int) -> subprocess.Popen:
    server = net.python(host, ["-c", SERVE, net.address(host), str(port)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    return server


def seen(server: subprocess.Popen) -> tuple[str, int]:
    """The address and port of the next peer `server` accepted."""
    assert server.stdout is not None
    address, port = server.stdout.readline().split()
    return address, int(port)


def dial(home: HomeNetwork, source_port: int, port: int, *hosts: str) -> None:
    argv = [home.python_executable, "-c", DIAL, str(source_port), str(port), *hosts]
    subprocess.run(home.command(home.home, argv), check=True, timeout=20, capture_output=True)


def connects(command: list[str]) -> bool:
    return subprocess.run(command, capture_output=True, timeout=20).returncode == 0


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_the_home_reaches_a_public_host_from_the_routers_public_address(
    wan: tuple[WanLink, dict[str, HomeNetwork]], mapping: str
) -> None:
    net, homes = wan
    home, port = homes[mapping], 5100 + MAPPINGS.index(mapping)
    server = serve(net, "a", port)
    try:
        dial(home, 0, port, net.address("a"))
        address, _ = seen(server)
        assert address == home.public_address == net.address(mapping)
        assert not address.startswith("192.168.")
    finally:
        server.kill()


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_cone_keeps_the_public_port_across_destinations_and_symmetric_does_not(
    wan: tuple[WanLink, dict[str, HomeNetwork]], mapping: str
) -> None:
    net, homes = wan
    home, port, source_port = homes[mapping], 5200 + MAPPINGS.index(mapping), 40_000
    servers = [serve(net, host, port) for host in ("a", "b")]
    try:
        dial(home, source_port, port, net.address("a"), net.address("b"))
        (address_a, port_a), (address_b, port_b) = (seen(server) for server in servers)
        assert address_a == address_b == home.public_address
        if mapping == "cone":
            assert port_a == port_b == source_port  # Linux keeps the source port when it is free
        else:
            assert port_a != port_b, (port_a, port_b)
    finally:
        for server in servers:
            server.kill()


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_no_public_host_can_open_a_connection_to_the_home(
    wan: tuple[WanLink, dict[str, HomeNetwork]], mapping: str
) -> None:
    net, homes = wan
    home, port = homes[mapping], 5300 + MAPPINGS.index(mapping)
    private = home.address(home.home)
    listener = home.python(home.home, ["-c", SERVE, "0.0.0.0", str(port)], stdout=subprocess.DEVNULL)
    try:
        # The listener is up: the router itself, on the home's subnet, reaches it.
        from_router = net.command(mapping, [net.python_executable, "-c", CONNECT, private, str(port)])
        poll_until(lambda: connects(from_router), 15, lambda: f"the router cannot reach {private}:{port}")
        from_a = [net.python_executable, "-c", CONNECT]
        assert not connects(net.command("a", [*from_a, home.public_address, str(port)]))
        route = ["-n", net.namespace("a"), "route", "add", f"{home.subnet}.0/24", "via", home.public_address]
        subprocess.run(["ip", *route], check=True)
        try:
            assert not connects(net.command("a", [*from_a, private, str(port)]))
        finally:
            subprocess.run(["ip", *route[:3], "del", *route[4:]], check=True)
    finally:
        listener.kill()


def test_kill_and_close_leave_nothing_behind() -> None:
    with WanLink(["gw", "public"]) as net:
        with HomeNetwork(net, "gw", "home") as home:
            sleeper = home.popen("home", ["sleep", "60"])
            poll_until(lambda: sleeper.pid in home.pids(), 10, lambda: f"{sleeper.pid} not in {home.pids()}")
            assert sleeper.pid in home.kill() and sleeper.wait(10) == -9
            straggler = home.popen("home", ["sleep", "60"])
            made = [name for name in namespaces() if name.startswith(net.run_id)]
            assert home.namespace in made and net.namespace("gw") in made
        assert straggler.poll() is not None
        left = [name for name in namespaces() if name.startswith(net.run_id)]
        assert home.namespace not in left and net.namespace("gw") in left
        tables = subprocess.run(net.command("gw", ["nft", "list", "tables"]), capture_output=True, text=True)
        assert home.table not in tables.stdout
    assert not [name for name in namespaces() if name.startswith(net.run_id)]
