"""A cheap fingerprint of a replica's parameters, so that replicas of a stage notice when they differ.

The replicas of a stage apply bitwise equal updates to bitwise equal parameters; they differ only after a step one
of them took without the others (alone, or after failed rounds) or a round one side completed and the other failed.
Every gradient contribution and Progress call carries this digest; a round whose members' digests differ does not
combine, and the members outside the largest group take the stage's state (peers/training/gradient_exchange.py).

The digest hashes a fixed sample of each parameter: SAMPLES_PER_TENSOR elements at an even stride, so that its
cost does not grow with the stage's size. An update moves nearly every element (AdamW's step and decay reach every
element with a nonzero value), so two replicas whose updates differed differ in the sample too. Measured on the
2-core dev machine under a load average of 15-20 (other jobs): 0.8-1.5 ms for 39 tensors (4 blocks at SmolLM2-135M's
width), about 2% of a backward of 8 x 32 tokens through them; the replica computes it once per step and state load
(StageReplica.params_digest) for its Progress calls, and once per round.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

SAMPLES_PER_TENSOR = 64
DIGEST_BYTES = 16


@torch.no_grad()
def parameter_digest(parameters: Iterable[torch.Tensor]) -> bytes:
    """The digest of `parameters` (in their order): equal for bitwise equal parameters."""
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for parameter in parameters:
        flat = parameter.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLES_PER_TENSOR)][:SAMPLES_PER_TENSOR]
        if sample.device.type != "cpu" or sample.dtype == torch.bfloat16:  # numpy has no bfloat16
            sample = sample.float().cpu()
        digest.update(sample.numpy().tobytes())  # numpy's strided copy: a few microseconds, torch's several ops
    return digest.digest()


def majority_digest(digests: Mapping[str, bytes]) -> bytes:
    """The digest most replicas (peer id -> digest) hold; a tie goes to the group of the smallest peer id, so that
    every replica that sees the same digests picks the same one."""
    groups: dict[bytes, list[str]] = {}
    for peer_id, digest in digests.items():
        groups.setdefault(digest, []).append(peer_id)
    return min(groups, key=lambda digest: (-len(groups[digest]), min(groups[digest])))
