"""Client side of the swarm. session.py: SpanSession (one inference stream to one peer) and InferenceSession (a
route across the model with failover and replay)."""

from __future__ import annotations

from swarm.client.session import InferenceSession, SpanSession

__all__ = ["InferenceSession", "SpanSession"]
