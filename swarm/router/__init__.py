"""How a client picks peers. base.py: Router ABC, coverage check, this client's load; bans.py: exponential
backoff for failed peers; min_latency.py: inference routes; wiring.py: forward/backward routes."""

from __future__ import annotations

from swarm.router.bans import Bans
from swarm.router.base import Router, check_coverage, serving
from swarm.router.min_latency import MinLatencyRouter
from swarm.router.wiring import WiringRouter

__all__ = ["Bans", "MinLatencyRouter", "Router", "WiringRouter", "check_coverage", "serving"]
