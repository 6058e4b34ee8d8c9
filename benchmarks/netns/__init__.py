"""Many hosts on one machine, for tests and benchmarks: link.py (WanLink: a network namespace per host, a router
namespace between them, RTT and rate emulated; cleanup of everything it made), relay.py (the user-space delaying
switch the router runs), ethtool.py (offloads off, for the relay), probe.py (measure a round trip between hosts:
`from benchmarks.netns.probe import measure_rtt`)."""

from benchmarks.netns.link import WanLink, namespaces, unavailable_reason

__all__ = ["WanLink", "namespaces", "unavailable_reason"]
