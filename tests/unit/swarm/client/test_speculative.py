"""Speculative decoding on a tiny local Llama (no swarm): greedy output equals plain decoding token for token with
every drafter; sampling keeps plain sampling's distribution (chi-squared over 20,000 samples, fixed seeds), both for
the verification rule alone and for the whole loop with its logits processors; the draft length backs off."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from swarm.client.drafters import DraftModel, PromptLookup, lookup
from swarm.client.generate import (
    Decoding,
    GenerationParams,
    Speculation,
    decode_loop,
    logits_processors,
    speculative_decode_loop,
)
from swarm.client.speculative import MAX_PROBE_EVERY, PROBE_EVERY, DraftLength, verify
from swarm.config import ClientConfig
from swarm.errors import InvalidArgument

SAMPLES = 20_000


def tiny_llama(vocab: int, seed: int, sharpness: float = 8.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random init is nearly uniform; sharper logits make the tests' distributions distinct
        model.lm_head.weight.mul_(sharpness)
    return model


class LocalSession:
    """The session contract generate.py's loops expect, over a local model (no cache: recomputes the whole text)."""

    def __init__(self, model: LlamaForCausalLM, rows: int) -> None:
        self.model, self.ids = model, torch.zeros(rows, 0, dtype=torch.long)
        self.fed: list[int] = []

    def last_logits(self, ids: torch.Tensor, count: int) -> torch.Tensor:
        self.ids = torch.cat([self.ids, ids], dim=1)
        self.fed.append(ids.shape[1])
        return self.model(input_ids=self.ids).logits[:, -count:]

    def next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.last_logits(ids, 1)[:, -1]

    def forget(self, count: int) -> None:
        self.ids = self.ids[:, : self.ids.shape[1] - count]


def plain(model, prompt: torch.Tensor, params: GenerationParams, generator=None) -> torch.Tensor:
    session = LocalSession(model, prompt.shape[0])
    return decode_loop(session.next_logits, Decoding(prompt[:, :0], prompt, params, generator=generator))


def speculative(model, prompt, params, drafter, k: int = 4, generator=None, stats=None) -> torch.Tensor:
    session = LocalSession(model, prompt.shape[0])
    observe = (lambda drafted, accepted: stats.append((drafted, accepted))) if stats is not None else None
    speculation = Speculation(drafter, DraftLength(k), session.forget, *([observe] if observe else []))
    loop = speculative_decode_loop
    return loop(session.last_logits, prompt[:, :0], prompt, params, speculation, generator=generator)


PROMPTS = torch.tensor([[5, 9, 17, 5, 9, 17, 5, 9], [1, 2, 3, 4, 1, 2, 3, 4], [30, 31, 7, 30, 31, 7, 2, 30]])


@pytest.mark.parametrize("drafter", ["prompt_lookup", "self", "other"])
@pytest.mark.parametrize("repetition_penalty", [1.0, 1.3])
def test_greedy_speculation_equals_plain_greedy(drafter: str, repetition_penalty: float) -> None:
    target = tiny_llama(40, seed=1)
    draft = {"prompt_lookup": PromptLookup(), "self": DraftModel(target, 40)}
    draft["other"] = DraftModel(tiny_llama(40, 2), 40)
    params = GenerationParams(max_new_tokens=16, repetition_penalty=repetition_penalty, eos_token_ids=(3,))
    stats: list[tuple[int, int]] = []
    with torch.inference_mode():
        expected = plain(target, PROMPTS, params)
        got = speculative(target, PROMPTS, params, draft[drafter], stats=stats)
    assert torch.equal(got, expected)
    drafted, accepted = sum(d for d, _ in stats), sum(a for _, a in stats)
    if drafter == "self":  # the model drafting for itself is always right
        assert drafted > 0 and accepted == drafted


def test_a_step_keeps_the_accepted_drafts_and_forgets_the_rest() -> None:
    target = tiny_llama(40, seed=1)
    prompt = PROMPTS[:1]
    with torch.inference_mode():
        session = LocalSession(target, 1)
        speculation = Speculation(DraftModel(target, 40), DraftLength(4), session.forget)
        params = GenerationParams(max_new_tokens=11)
        out = speculative_decode_loop(session.last_logits, prompt[:, :0], prompt, params, speculation)
    assert out.shape == (1, 11)
    assert session.fed[0] == prompt.shape[1] + 4  # the prompt and 4 drafts in one step, then last token + drafts
    assert len(session.fed) <= 3  # 11 tokens in 3 round trips (5 + 5 + 1), not 11
    assert torch.equal(session.ids, torch.cat([prompt, out[:, :-1]], dim=1))  # the last token is not fed


def test_prompt_lookup_copies_what_followed_the_latest_match() -> None:
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    assert lookup([4, 5, 6, 4, 5], 3) == [6, 4, 5]
    assert lookup([1, 2, 3], 3) == []
    assert lookup([7, 1, 2, 9, 1], 2) == []  # a lone token's match is too weak a guess


def test_the_draft_length_backs_off_on_rejections_and_probes() -> None:
    length = DraftLength(8)
    assert length.next() == 6  # 0.8^6 >= 0.25
    for _ in range(4):
        length.observe(length.next(), 0)
    assert length.next() == 0  # rejections took k down to 0
    gaps = []
    for _ in range(6):  # every probe rejected: the wait before the next one doubles, up to MAX_PROBE_EVERY
        steps = 1
        while length.next() == 0:
            steps += 1
        length.observe(1, 0)
        gaps.append(steps)
    assert gaps[0] == PROBE_EVERY - 1 and gaps[1:] == [16, 32, 64, 64, 64] and MAX_PROBE_EVERY == 64
    assert [length.next() for _ in range(MAX_PROBE_EVERY)].count(1) == 1
    length.observe(1, 1)  # a kept probe: k is 1 again, and once it is back at 0 probes come PROBE_EVERY apart
    assert length.next() == 1 and length.probe_every == PROBE_EVERY
    for _ in range(10):
        length.observe(4, 4)
    assert length.next() == 8


def test_a_draft_length_at_zero_is_not_moved_by_steps_that_are_not_probes() -> None:
    length = DraftLength(8, rate=0.0)
    assert [length.next() for _ in range(PROBE_EVERY)] == [0] * (PROBE_EVERY - 1) + [1]
    length.observe(0, 0)  # the probe drafted nothing (no lookup match): it says nothing, the wait is unchanged
    assert length.probe_every == PROBE_EVERY


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Chi-squared goodness of fit, cells expected below 5 counts merged into one."""
    expected = expected_probs.flatten().double() * counts.sum()
    observed = counts.flatten().double()
    assert observed[expected == 0].sum() == 0, "a token that plain sampling never draws"
    small, big = (expected > 0) & (expected < 5), expected >= 5
    exp, obs = expected[big], observed[big]
    if bool(small.any()):
        exp, obs = torch.cat([exp, expected[small].sum()[None]]), torch.cat([obs, observed[small].sum()[None]])
    exp, obs = exp.numpy(), obs.numpy()
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def table(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.softmax(3 * torch.randn(*shape, generator=generator), dim=-1)


@pytest.mark.parametrize("point_mass", [True, False])
def test_verification_keeps_the_joint_distribution_of_two_tokens(point_mass: bool) -> None:
    """p0, p1(.|t1), p2(.|t1,t2) are the target's; drafts come from q (or are fixed, a lookup's point mass: the
    likeliest tokens). Token 1 and token 2 (from the same step when draft 1 is kept, else from the next step's plain
    sample) must be distributed as p0(t1) p1(t2|t1)."""
    vocab, rng = 6, torch.Generator().manual_seed(11)
    p0, p1, p2 = table(rng, vocab), table(rng, vocab, vocab), table(rng, vocab, vocab, vocab)
    q0, q1 = 0.6 * p0 + 0.4 * table(rng, vocab), 0.6 * p1 + 0.4 * table(rng, vocab, vocab)  # a fair drafter
    if point_mass:
        d0 = torch.full((SAMPLES,), int(p0.argmax()))  # a good guess, so that drafts are often kept
        d1 = p1[d0].argmax(dim=-1)
        draft_probs = None
    else:
        d0 = torch.multinomial(q0.expand(SAMPLES, -1), 1, generator=rng).squeeze(1)
        d1 = torch.multinomial(q1[d0], 1, generator=rng).squeeze(1)
        draft_probs = torch.stack([q0.expand(SAMPLES, -1), q1[d0]], dim=1)
    scores = torch.stack([p0.expand(SAMPLES, -1), p1[d0], p2[d0, d1]], dim=1).log()
    tokens, accepted = verify(scores, torch.stack([d0, d1], dim=1), draft_probs, True, rng)
    first = tokens[:, 0]
    second = torch.where(
        accepted >= 1, tokens[:, 1], torch.multinomial(p1[first], 1, generator=rng).squeeze(1)
    )  # a row that kept no draft samples its second token in the next step, as plain decoding would
    assert float((accepted >= 1).float().mean()) > 0.2  # the same-step path is well exercised
    counts = torch.zeros(vocab, vocab)
    counts.index_put_((first, second), torch.ones(SAMPLES), accumulate=True)
    assert chi2_pvalue(counts, p0[:, None] * p1) > 0.01


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft"])
def test_sampled_speculation_matches_plain_sampling_with_processors(drafter: str) -> None:
    """The whole loop, 20,000 rows at once: temperature, top-k and a repetition penalty applied per position. The
    exact distribution of the first two tokens comes from the target model itself."""
    vocab = 12
    target = tiny_llama(vocab, seed=3, sharpness=4.0)
    params = GenerationParams(max_new_tokens=2, do_sample=True, temperature=0.8, top_k=8, repetition_penalty=1.3)
    prompt = torch.tensor([[1, 4, 7, 1, 4]]).expand(SAMPLES, -1)
    draft = PromptLookup() if drafter == "prompt_lookup" else DraftModel(tiny_llama(vocab, 4, sharpness=4.0), vocab)
    with torch.inference_mode():
        out = speculative(target, prompt, params, draft, k=4, generator=torch.Generator().manual_seed(5))
        expected = exact_two_token_distribution(target, prompt[:1], params)
    counts = torch.zeros(vocab, vocab)
    counts.index_put_((out[:, 0], out[:, 1]), torch.ones(SAMPLES), accumulate=True)
    assert chi2_pvalue(counts, expected) > 0.01


def exact_two_token_distribution(model, prompt: torch.Tensor, params: GenerationParams) -> torch.Tensor:
    process = logits_processors(params)
    vocab = model.config.vocab_size
    first = torch.softmax(process(prompt, model(input_ids=prompt).logits[:, -1].float()), dim=-1)[0]
    grown = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
    second = torch.softmax(process(grown, model(input_ids=grown).logits[:, -1].float()), dim=-1)
    return first[:, None] * second


@pytest.mark.parametrize(
    ("speculative", "k", "argument"),
    [
        ("medusa", 4, "speculative"),
        ("draft:", 4, "speculative"),
        ("prompt_lookup", 0, "num_speculative_tokens"),
        ("prompt_lookup", 33, "num_speculative_tokens"),
        ("prompt_lookup", 2.5, "num_speculative_tokens"),
    ],
)
def test_bad_speculative_options_name_their_argument(speculative: str, k: object, argument: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        ClientConfig(speculative=speculative, num_speculative_tokens=k)  # type: ignore[arg-type]
    assert caught.value.argument == argument


def test_a_draft_path_that_is_no_checkpoint_is_named(tmp_path) -> None:
    from swarm.client.drafters import DraftModels

    with pytest.raises(InvalidArgument, match="not a checkpoint directory") as caught:
        DraftModels().check(f"draft:{tmp_path}")
    assert caught.value.argument == "speculative"
