"""Turn a network interface's offloads off (checksum, segmentation, GRO), with the ethtool ioctl: no `ethtool`
binary is installed here. The user-space relay (relay.py) copies frames as the wire would carry them, so no frame may
leave a veth with a checksum left for hardware to fill in, or larger than the MTU.

Run inside a namespace: `ip netns exec NS python -m benchmarks.netns.ethtool IFACE...`.
"""

from __future__ import annotations

import array
import fcntl
import socket
import struct
import sys

SIOCETHTOOL = 0x8946
# Legacy ethtool "set" commands (linux/ethtool.h); each takes a struct ethtool_value {u32 cmd; u32 data;}.
ETHTOOL_STXCSUM = 0x17
ETHTOOL_SSG = 0x19
ETHTOOL_STSO = 0x1F
ETHTOOL_SGSO = 0x24
ETHTOOL_SGRO = 0x2C
OFFLOADS = (ETHTOOL_STSO, ETHTOOL_SGSO, ETHTOOL_SGRO, ETHTOOL_SSG, ETHTOOL_STXCSUM)


def _set(probe: socket.socket, interface: str, command: int, value: int) -> None:
    data = array.array("B", struct.pack("II", command, value))
    request = struct.pack("16sP", interface.encode(), data.buffer_info()[0])
    fcntl.ioctl(probe, SIOCETHTOOL, request)


def offloads_off(interface: str) -> None:
    """Checksum, scatter-gather, TSO, GSO and GRO off on `interface` (of this process's network namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for command in OFFLOADS:
            _set(probe, interface, command, 0)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        offloads_off(name)
