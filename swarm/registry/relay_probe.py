"""Whether a node's relay serves circuits past libp2p's default cap, checked once as it starts (issue 40).

hivemind's p2pd starts two relay services on a relay node: one with the limits it is given (4 GiB and 30 minutes
per circuit), started when the node is found public, and one with libp2p's defaults (128 KiB per direction and
2 minutes), started as the daemon comes up. Both serve the same protocol, and whichever registers last answers:
a start-up race. Measured in benchmarks/netns (`swarm dht --relay` in one namespace, a peer behind NAT reserving
on it, 4 MB echoed through the circuit): 1 start in 4 cut every circuit at ~128 KiB, which a gRPC connection
through the relay crosses within seconds of decoding. So a relay probes itself: a private node on this machine
reserves a slot on it, a second one sends PROBE_BYTES (twice the default cap) to the first through the relay, and
only an answer after all of them counts. Registry starts a relay node again until the probe passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import Any

from swarm.registry.tunnel import CIRCUIT, WireAddress

PROTOCOL = "rayswarm.relay-probe"
PROBE_BYTES = 1 << 18  # 256 KiB: twice libp2p's default cap of a circuit, in one direction
PROBE_TIMEOUT_S = 20.0
RESERVE_TIMEOUT_S = 10.0


def relays_past_the_default_cap(dht: Any, listen: str) -> bool:
    """Probe the relay of `dht`'s node (in its DHT process) as the module docstring says; `listen`: the multiaddress
    the node listens on (its port may be 0), which the probe's nodes dial from this machine."""
    return dht.run_coroutine(functools.partial(_probe, listen))


async def _probe(listen: str, dht: Any, node: Any) -> bool:
    from hivemind.p2p import P2P

    started: list[Any] = []
    try:
        family, ip = listen.split("/")[1:3]
        ip = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(ip, ip)  # a wildcard: dial it on loopback
        port = str(next(iter(await node.p2p.get_visible_maddrs()))).split("/tcp/")[1].split("/")[0]
        own = [f"/{family}/{ip}/tcp/{port}/p2p/{node.peer_id}"]
        common = {
            "host_maddrs": [f"/{family}/{ip}/tcp/0"],
            "dht_mode": "client",
            "auto_nat": False,
            "nat_port_map": False,
        }
        relayed = await P2P.create(
            initial_peers=own, force_reachability="private", use_auto_relay=True, trusted_relays=own, **common
        )
        started.append(relayed)
        dialer = await P2P.create(initial_peers=own, **common)
        started.append(dialer)
        await relayed.add_binary_stream_handler(PROTOCOL, _count)
        await _connect_through(dialer, relayed.peer_id, WireAddress(own[0] + CIRCUIT))
        _, reader, writer = await dialer.call_binary_stream_handler(relayed.peer_id, PROTOCOL)
        writer.write(bytes(PROBE_BYTES))
        await writer.drain()
        return await asyncio.wait_for(reader.read(2), PROBE_TIMEOUT_S) == b"ok"
    except Exception:  # reset at the cap, no circuit at all, or a probe node that did not start: failed
        return False
    finally:
        for p2p in started:
            with contextlib.suppress(Exception):
                await p2p.shutdown()


async def _connect_through(dialer: Any, peer: Any, circuit: WireAddress) -> None:
    """Connect through the relay once the slot is reserved (a moment after the relayed node starts)."""
    deadline = time.monotonic() + RESERVE_TIMEOUT_S
    while True:
        try:
            return await dialer._client.connect(peer, [circuit])
        except Exception:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.2)


async def _count(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    received = 0
    while received < PROBE_BYTES and (data := await reader.read(1 << 16)):
        received += len(data)
    if received >= PROBE_BYTES:
        writer.write(b"ok")
        await writer.drain()
    writer.close()
