"""Many hosts on one machine, for tests and benchmarks: link.py (WanLink: a network namespace per host, a router
namespace between them, RTT and rate emulated; cleanup of everything it made), nat.py (HomeNetwork: a home host
behind a cone or symmetric NAT router that is one of a WanLink's hosts), relay.py (the user-space delaying switch
the router runs), ethtool.py (offloads off, for the relay), probe.py (measure a round trip between hosts:
`from benchmarks.netns.probe import measure_rtt`)."""

from benchmarks.netns.link import PUBLIC_SUBNET, WanLink, namespaces, unavailable_reason
from benchmarks.netns.nat import HomeNetwork, nat_unavailable_reason

__all__ = ["PUBLIC_SUBNET", "HomeNetwork", "WanLink", "namespaces", "nat_unavailable_reason", "unavailable_reason"]
