"""A user-space Ethernet switch that delays every frame: the wide-area link of the multi-host harness.

This kernel has no `netem` and the machine no iptables (so no NFQUEUE), so the router namespace bridges its veth
ports itself: an AF_PACKET socket per port, a thread that reads each port and a thread that writes each port, and
every frame held `delay` before it leaves (one crossing host -> host, so RTT = 2 x delay). Learning switch: frames go
to the port their destination MAC was last seen on, broadcasts and unknown destinations to every other port.

Run in the router namespace (benchmarks/netns/link.py does): `python -m benchmarks.netns.relay --delay-ms 50 p0 p1`.
It prints "relay ready" once every port is open and runs until killed.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import socket
import threading
import time

from benchmarks.netns.ethtool import offloads_off

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SOL_PACKET = 263
PACKET_IGNORE_OUTGOING = 23  # Linux >= 4.20: the socket does not see the frames it (or the kernel) sends
SOCKET_BUFFER = 4 << 20


class Port:
    """One veth end of the router: its socket and the frames waiting to leave through it, with their due times."""

    def __init__(self, interface: str) -> None:
        offloads_off(interface)
        self.interface = interface
        self.socket = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        with contextlib.suppress(OSError):  # older kernels: outgoing frames are skipped by their packet type
            self.socket.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        self.socket.bind((interface, ETH_P_ALL))
        self.waiting: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

    def transmit_forever(self) -> None:
        """Send each waiting frame at its due time; frames leave in the order they came, as on a wire."""
        while True:
            due, frame = self.waiting.get()
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            with contextlib.suppress(OSError):  # a full queue, a namespace going away: lost, as on a real link
                self.socket.send(frame)


class Switch:
    """Ports plus the MAC table; `delay_s` is added to every frame's crossing."""

    def __init__(self, interfaces: list[str], delay_s: float) -> None:
        self.ports = [Port(name) for name in interfaces]
        self.delay_s = delay_s
        self.table: dict[bytes, Port] = {}

    def start(self) -> None:
        for port in self.ports:
            threading.Thread(target=self._receive_forever, args=(port,), daemon=True).start()
            threading.Thread(target=port.transmit_forever, daemon=True).start()

    def _receive_forever(self, port: Port) -> None:
        while True:
            frame, address = port.socket.recvfrom(65535)
            if address[2] == PACKET_OUTGOING or len(frame) < 14:
                continue
            due = time.monotonic() + self.delay_s
            self.table[frame[6:12]] = port
            target = self.table.get(frame[0:6]) if not frame[0] & 1 else None  # odd first octet: multicast
            for out in [target] if target is not None else self.ports:
                if out is not port:
                    out.waiting.put((due, frame))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to every frame")
    parser.add_argument("interfaces", nargs="+")
    ns = parser.parse_args()
    switch = Switch(ns.interfaces, max(0.0, ns.delay_ms) / 1000)
    switch.start()
    print("relay ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
