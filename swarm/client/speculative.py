"""Speculative decoding's two policies on the client: which drafted tokens a verification step keeps (`verify`,
lossless for greedy and for sampling) and how many tokens to draft next (`DraftLength`, from the recent acceptance).

generate.py's speculative loop calls both; the drafters (drafters.py) propose the tokens.
"""

from __future__ import annotations

import math

import torch

COST_OF_A_DRAFT = 0.25  # a drafted token is worth verifying while P(the run reaches it) stays above this
PROBE_EVERY = 8  # at k = 0, draft one token after this many steps, to notice when drafts become good again
MAX_PROBE_EVERY = 64  # each rejected probe doubles the wait for the next one, up to this many steps


def verify(
    scores: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sample: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check drafted tokens against the target model's processed scores of one verification step.

    Args:
        scores: [batch, k + 1, vocab] the processed target scores at each drafted position and one past them.
        drafts: [batch, k] the drafted tokens.
        draft_probs: [batch, k, vocab] the distributions the drafts were sampled from; None: point masses (prompt
            lookup, or a greedy draft).
        sample: sample (speculative sampling: keep a draft with probability min(1, p/q), else resample from
            normalised max(p - q, 0)); False: greedy (keep a draft while it is the argmax).
    Returns:
        tokens [batch, k + 1] and accepted [batch]: row i's first accepted[i] tokens are its drafts, its token at
        accepted[i] is the correction (or the bonus token after k accepted drafts); every token up to there is
        distributed exactly as plain decoding's would be.
    """
    k = drafts.shape[1]
    if not sample:
        best = scores.argmax(dim=-1)
        return best, _run_length(drafts == best[:, :k])
    probs = torch.softmax(scores, dim=-1)
    if k == 0:  # nothing drafted: exactly plain sampling, at plain sampling's cost
        return torch.multinomial(probs[:, 0], 1, generator=generator), drafts.new_zeros(drafts.shape[0])
    target = probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [batch, k]
    proposed = torch.ones_like(target)
    if draft_probs is not None:
        proposed = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    draws = torch.rand(target.shape, generator=generator, dtype=target.dtype)
    accepted = _run_length(draws * proposed < target)
    rows = torch.arange(drafts.shape[0])
    at = probs[rows, accepted]  # [batch, vocab]: p where the run stopped
    rejected = accepted < k
    if bool(rejected.any()):
        residual = _residual(at[rejected], drafts, draft_probs, rows[rejected], accepted[rejected])
        at = at.clone()
        at[rejected] = residual
    tokens = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], dim=1)
    tokens[rows, accepted] = torch.multinomial(at, 1, generator=generator).squeeze(1)
    return tokens, accepted


def _residual(
    p: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None, rows: torch.Tensor, at: torch.Tensor
) -> torch.Tensor:
    """normalise(max(p - q, 0)) at each rejected row's first rejected position; p itself where that is all zero
    (p == q up to rounding, where a rejection has probability ~0 anyway)."""
    if draft_probs is None:
        q = torch.zeros_like(p)
        q[torch.arange(p.shape[0]), drafts[rows, at]] = 1.0
    else:
        q = draft_probs[rows, at]
    residual = (p - q).clamp(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=1e-30), p)


def _run_length(matches: torch.Tensor) -> torch.Tensor:
    """[batch, k] booleans -> [batch] number of leading Trues."""
    return matches.long().cumprod(dim=1).sum(dim=1)


class DraftLength:
    """How many tokens to draft: the longest run whose last token is still accepted with probability >= the cost of
    verifying it (rate^k >= COST_OF_A_DRAFT), from a moving average of the per-token acceptance rate. Rejections
    drive k to 1, then 0 with a 1-token probe after PROBE_EVERY steps; each rejected probe doubles the wait (up to
    MAX_PROBE_EVERY) and a kept one brings it back, so free text costs about what plain decoding does."""

    def __init__(self, max_tokens: int, rate: float = 0.8, weight: float = 0.3) -> None:
        self.max_tokens, self.rate, self.weight = max_tokens, rate, weight
        self.probe_every = PROBE_EVERY  # steps at k = 0 before the next probe
        self._idle_steps = 0
        self._probing = False  # the step just handed out is a probe

    def next(self) -> int:
        self._probing = False
        k = self.max_tokens if self.rate >= 1 else int(math.log(COST_OF_A_DRAFT) / math.log(max(self.rate, 1e-6)))
        k = min(self.max_tokens, k)
        if k > 0:
            self._idle_steps = 0
            return k
        self._idle_steps += 1
        if self._idle_steps < self.probe_every:
            return 0
        self._idle_steps, self._probing = 0, True
        return 1

    def observe(self, drafted: int, accepted: int) -> None:
        """One verification: `accepted` of `drafted` tokens kept. Only the drafts up to the first rejection were
        tested; those after it tell nothing about the rate. Nothing drafted (a probe the drafter had no guess for)
        tells nothing either."""
        if drafted == 0:
            return
        tested = accepted + (1 if accepted < drafted else 0)
        if tested:
            self.rate += self.weight * (accepted / tested - self.rate)
        if self._probing:
            self.probe_every = PROBE_EVERY if accepted else min(2 * self.probe_every, MAX_PROBE_EVERY)
            self._probing = False
