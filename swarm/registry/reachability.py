"""Whether others can reach an announced address, asked of another DHT node (issue 15: a peer whose announced
address nobody can dial is told so at start, not discovered by clients' timeouts).

Every DHT node that others store on (swarm/registry/dht.py: not client-mode ones) answers `rayswarm.reachability`:
given "host:port", it opens a TCP connection there and closes it at once, sending nothing, and answers "" or why it
failed. A node checks its own address through the first initial peer it has; with none (the swarm's first node) it
can only connect to itself, and says so. It runs inside hivemind's DHT process (DHT.run_coroutine), over the DHT's
own libp2p connections. What a node dials for others is bounded: one dial at a time, SELF_CHECK_TIMEOUT_S each.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any

from swarm.registry.hosts import SELF_CHECK_TIMEOUT_S, join_host_port, warn_if_unreachable

logger = logging.getLogger(__name__)

HANDLER = "rayswarm.reachability"
ASK_TIMEOUT_S = 3 * SELF_CHECK_TIMEOUT_S  # the libp2p call around the other node's dial


@dataclass(frozen=True, slots=True)
class Reachability:
    address: str  # host:port checked
    reachable: bool
    via: str  # the DHT node that dialled it (its peer id), or "itself" when no other node was known
    error: str = ""  # why the dial failed; "" when reachable


def serve(dht: Any) -> None:
    """Answer other nodes' checks from now on (called once per node, in the parent process)."""
    dht.run_coroutine(_add_handler)


def check(dht: Any, host: str, port: int, initial_peers: list[str], what: str) -> Reachability:
    """Ask the first initial peer's node to dial host:port (a local dial when there is none, or when it cannot be
    asked); logs a warning naming --announce-host when the address is unreachable."""
    address = join_host_port(host, port)
    other = next((peer.rsplit("/p2p/", 1)[1] for peer in initial_peers if "/p2p/" in peer), None)
    if other is not None:
        try:
            error = dht.run_coroutine(functools.partial(_ask, other, address))
        except Exception as failure:  # an old node without the handler, or a libp2p error
            logger.warning(
                "%s: could not ask DHT node %s to check %s (%s); checking locally", what, other, address, failure
            )
        else:
            if error:
                logger.warning(
                    "%s announces %s, which DHT node %s cannot connect to (%s): others will not reach it either; "
                    "pass --announce-host (`announce_host:` in a job's YAML) with an address others can dial, and "
                    "check that the port is open",
                    what,
                    address,
                    other,
                    error,
                )
            return Reachability(address, not error, other, error)
    logger.info(
        "%s: no other DHT node to check %s through (first node of the swarm): connecting to itself", what, address
    )
    return Reachability(address, warn_if_unreachable(host, port, what), "itself")


async def _add_handler(dht: Any, node: Any) -> None:
    from google.protobuf.wrappers_pb2 import StringValue

    gate = asyncio.Semaphore(1)

    async def dial(request: StringValue, context: Any) -> StringValue:
        async with gate:
            return StringValue(value=await _dial(request.value))

    await node.p2p.add_protobuf_handler(HANDLER, dial, StringValue)


async def _dial(address: str) -> str:
    """ "" if a TCP connection to address ("host:port", IPv6 in brackets) opens within SELF_CHECK_TIMEOUT_S, else
    why not."""
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), SELF_CHECK_TIMEOUT_S)
    except (TimeoutError, OSError, ValueError) as error:
        return getattr(error, "strerror", None) or str(error) or type(error).__name__
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return ""


async def _ask(other: str, address: str, dht: Any, node: Any) -> str:
    from google.protobuf.wrappers_pb2 import StringValue
    from hivemind.p2p import PeerID

    request = StringValue(value=address)
    call = node.p2p.call_protobuf_handler(PeerID.from_base58(other), HANDLER, request, StringValue)
    return (await asyncio.wait_for(call, ASK_TIMEOUT_S)).value
