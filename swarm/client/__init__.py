"""Client side of the swarm. session.py: SpanSession (one inference stream to one peer) and ChainSession (a fixed
chain of them). Routing, failover and the Hugging Face-style model class come with the client issue."""

from __future__ import annotations

from swarm.client.session import ChainSession, SpanSession
from swarm.types import Hop

__all__ = ["ChainSession", "Hop", "SpanSession"]
