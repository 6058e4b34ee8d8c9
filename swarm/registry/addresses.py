"""Initial peers as users pass them: checked before any DHT node starts, so a typo fails at once by name.

The library (`from_pretrained`), the registry and every CLI command with `--initial-peers` use `initial_peer_list`.
"""

from __future__ import annotations

from collections.abc import Sequence

from swarm.errors import InvalidArgument

EXAMPLE = "/ip4/127.0.0.1/tcp/PORT/p2p/ID (the address `swarm up` prints as 'initial peers')"


def initial_peer_list(initial_peers: str | Sequence[str], argument: str = "initial_peers") -> list[str]:
    """The multiaddresses in `initial_peers`: one address, a comma-separated string of them, or a list.

    Raises:
        InvalidArgument: none given, something that is not a string, or an address that does not parse or lacks
            its /p2p/ peer id.
    """
    if isinstance(initial_peers, str):
        initial_peers = initial_peers.split(",")
    elif not isinstance(initial_peers, Sequence) or not all(isinstance(a, str) for a in initial_peers):
        raise InvalidArgument(argument, f"expected a list of multiaddresses, got {initial_peers!r}")
    addresses = [address.strip() for address in initial_peers if address.strip()]
    if not addresses:
        raise InvalidArgument(argument, f"no initial peer given: pass at least one multiaddress, e.g. {EXAMPLE}")
    for address in addresses:
        check_multiaddress(address, argument)
    return addresses


def check_multiaddress(address: str, argument: str = "initial_peers") -> None:
    """Raise InvalidArgument unless `address` is a multiaddress with a transport and a /p2p/ peer id."""
    from hivemind.utils.multiaddr import Multiaddr  # hivemind is heavy: only once an address is actually checked

    try:
        protocols = [protocol.name for protocol in Multiaddr(address).protocols()]
    except Exception as error:  # multiaddr raises its own StringParseError, ValueError, BinaryParseError...
        raise InvalidArgument(argument, f"{address!r} is not a multiaddress ({error}); expected {EXAMPLE}") from None
    if "p2p" not in protocols:
        raise InvalidArgument(argument, f"{address!r} lacks the /p2p/ID peer id; expected {EXAMPLE}")
