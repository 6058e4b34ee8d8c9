"""SharedHead: concurrent sessions' logits come from batched LM-head calls, each row exactly its own."""

from __future__ import annotations

import threading

import pytest
import torch

from swarm.client.head_batching import SharedHead
from swarm.partition.client_head import ClientHead

HIDDEN, VOCAB = 32, 500


def _head() -> ClientHead:
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(HIDDEN, eps=1e-5)
    return ClientHead(torch.randn(VOCAB, HIDDEN), norm, torch.randn(VOCAB, HIDDEN))


class _SlowHead(ClientHead):
    """A head whose every call takes a while (as a big vocabulary does), so that callers pile up behind a wave."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        threading.Event().wait(0.02)
        return super().logits(hidden)


def test_concurrent_callers_share_waves_and_each_gets_its_own_rows_logits() -> None:
    base = _head()
    head = _SlowHead(base.embed_tokens.weight.data, base.norm, base.lm_head.weight.data)
    shared = SharedHead(head)
    inputs = [torch.randn(1 + i % 3, 1, HIDDEN) for i in range(24)]
    results: dict[int, torch.Tensor] = {}
    start = threading.Barrier(len(inputs))

    def call(index: int) -> None:
        start.wait()
        for _ in range(3):
            results[index] = shared.logits(inputs[index])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    with torch.no_grad():
        for index, hidden in enumerate(inputs):
            assert results[index].shape == (hidden.shape[0], 1, VOCAB)
            torch.testing.assert_close(results[index], head.logits(hidden), atol=1e-5, rtol=1e-5)
    assert shared.waves < 3 * len(inputs) / 2, f"{shared.waves} waves for {3 * len(inputs)} calls: no batching"


def test_a_lone_caller_gets_the_heads_answer_in_every_shape() -> None:
    head = _head()
    shared = SharedHead(head)
    with torch.no_grad():
        for shape in ((2, 5, HIDDEN), (3, HIDDEN)):
            hidden = torch.randn(*shape)
            torch.testing.assert_close(shared.logits(hidden), head.logits(hidden))
    assert shared.waves == 2


def test_an_error_reaches_every_caller_of_its_wave_and_the_head_goes_on() -> None:
    shared = SharedHead(_head())
    with pytest.raises(RuntimeError):
        shared.logits(torch.randn(2, 1, HIDDEN + 1))  # wrong hidden size
    assert shared.logits(torch.randn(2, 1, HIDDEN)).shape == (2, 1, VOCAB)


def test_under_autograd_the_head_is_called_directly() -> None:
    shared = SharedHead(_head())
    hidden = torch.randn(2, 1, HIDDEN, requires_grad=True)
    shared.logits(hidden).sum().backward()
    assert hidden.grad is not None and shared.waves == 0


def test_a_caller_with_the_wrong_width_fails_alone_in_a_shared_wave() -> None:
    base = _head()
    shared = SharedHead(_SlowHead(base.embed_tokens.weight.data, base.norm, base.lm_head.weight.data))
    outcomes: dict[str, object] = {}
    start = threading.Barrier(9)

    def call(name: str, width: int) -> None:
        start.wait()
        try:
            outcomes[name] = shared.logits(torch.randn(1, 1, width)).shape
        except RuntimeError as error:
            outcomes[name] = error

    threads = [threading.Thread(target=call, args=(f"good-{i}", HIDDEN)) for i in range(8)]
    threads.append(threading.Thread(target=call, args=("bad", HIDDEN + 3)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert isinstance(outcomes.pop("bad"), RuntimeError)
    assert all(shape == (1, 1, VOCAB) for shape in outcomes.values()), outcomes
