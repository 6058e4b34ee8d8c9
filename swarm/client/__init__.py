"""Client side of the swarm.

model.py: DistributedModelForCausalLM (Hugging Face-style); generate.py: the decoding loop; sequential.py:
RemoteSequential (forward/backward through the swarm, in autograd); session.py: SpanSession (one inference stream
to one peer) and InferenceSession (a route across the model with failover and replay); view.py: SwarmView (the
registry's peers, refreshed in the background, and measured RTTs); metrics.py: ClientMetrics (failovers, retries,
step latency, refused outputs for Prometheus); checks.py: what every answer of a peer must be; verify.py: Verifier
(verify_fraction: steps run again on a second replica, disagreements settled by a third).
"""

from __future__ import annotations

from swarm.client.metrics import ClientMetrics
from swarm.client.model import DistributedModelForCausalLM, ModelSession
from swarm.client.sequential import RemoteSequential
from swarm.client.session import InferenceSession, SpanSession

__all__ = [
    "ClientMetrics",
    "DistributedModelForCausalLM",
    "InferenceSession",
    "ModelSession",
    "RemoteSequential",
    "SpanSession",
]
