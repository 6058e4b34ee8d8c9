"""InferenceSession.rollback trims each hop's replay history to the kept tokens, whatever pieces it was sent in."""

from __future__ import annotations

import torch

from swarm.client.hop_state import trimmed


def test_history_is_trimmed_to_the_kept_tokens_across_pieces() -> None:
    history = torch.arange(2 * 9 * 3, dtype=torch.float32).reshape(2, 9, 3)
    pieces = [history[:, :5], history[:, 5:6], history[:, 6:9]]  # a prefill, a token, a step with 2 drafts
    for keep in range(10):
        kept = trimmed(pieces, keep)
        assert torch.equal(torch.cat(kept, dim=1) if kept else history[:, :0], history[:, :keep])
    assert len(trimmed(pieces, 7)) == 3 and trimmed(pieces, 5)[-1].shape[1] == 5
