"""Client side of the swarm.

model.py: DistributedModelForCausalLM (Hugging Face-style); generate.py: the decoding loops (plain and speculative);
drafters.py: speculative drafters (prompt lookup, a local draft model); speculative.py: which drafts a verification
step keeps and how many to draft; chat.py: chat messages
to a prompt; sequential.py: RemoteSequential (forward/backward through the swarm, in autograd); span_session.py:
SpanSession (one session on one peer, and how long its answers are awaited); peer_link.py: PeerLink (the one
batched Sessions stream a process shares per peer); batch_wire.py: steps merged into StepBatch messages and
answers cut back per session; inference_stream.py: a session on its own Inference stream (older peers);
session.py: InferenceSession
(a route across the model with failover and replay); pace.py: when a hop is late; view.py: SwarmView (the
registry's peers, refreshed in the background, and measured RTTs); metrics.py: ClientMetrics (failovers, retries,
step latency, refused outputs for Prometheus); checks.py: what every answer of a peer must be; verify.py: Verifier
(verify_fraction: steps run again on a second replica, disagreements settled by a third); arguments.py: what
callers pass, checked.
model_session.py: ModelSession (a conversation whose caches the peers keep); prefix_reuse.py: a session's start
from what the route's peers hold of its prompt in their prefix caches; remote_cache.py: SwarmCache (a
transformers Cache on the peers); lora.py: LoraAdapter (trainable on the client, peft's format); adapter_upload.py:
which peer holds which adapter version; prompts.py: PromptTuning; deep_prompts.py: DeepPromptTuning;
head_batching.py: SharedHead (one batched LM head for every concurrent session of a process); client_engine.py:
ClientEngine (the plain steps of every session of a process through one loop); step_flight.py: one step on that
loop's path; hop_state.py: what a session keeps per hop; lockstep.py: many sessions' generations from one loop, one
LM head per turn; decode_batcher.py: DecodeBatcher (every thread's generate() calls on a model decoded in one loop,
one LM head per turn, each call's own sampling).
"""

from __future__ import annotations

from swarm.client.metrics import ClientMetrics
from swarm.client.model_session import ModelSession
from swarm.client.sequential import RemoteSequential
from swarm.client.session import InferenceSession
from swarm.client.span_session import SpanSession

__all__ = [
    "ClientMetrics",
    "DistributedModelForCausalLM",
    "InferenceSession",
    "ModelSession",
    "RemoteSequential",
    "SpanSession",
]


def __getattr__(name: str) -> object:
    """DistributedModelForCausalLM is imported on first use: it pulls in transformers, which the modules a peer
    imports from here (lora.py) never need."""
    if name == "DistributedModelForCausalLM":
        from swarm.client.model import DistributedModelForCausalLM

        return DistributedModelForCausalLM
    raise AttributeError(f"module 'swarm.client' has no attribute {name!r}")
