"""How the model's shared decoding loop (swarm/client/decode_batcher.py) takes its turns, on a scripted session
and head whose next token is always the last one plus 1: concurrent calls share turns and each gets its own tokens;
a turn that fails (a bug of the head) fails its calls and the loop goes on serving. The real path, over peers, is
tests/integration/peers/test_distributed_model.py's."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from swarm.client.decode_batcher import DecodeBatcher
from swarm.client.generate import Decoding, GenerationParams

VOCAB = 64


class NextIdHead:
    """Embeds an id as its one-hot row; the logits of a row favour the id after it."""

    def __init__(self, fail_on_call: int = 0) -> None:
        self.calls, self.fail_on_call = 0, fail_on_call

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(ids, VOCAB).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("the head failed")
        return torch.roll(hidden, 1, dims=-1)


class EchoSession:
    """A session whose peers hand back what they are given (a step alone, in a thread of its own)."""

    engine = None

    def step_alone(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class ScriptedModelSession:
    def __init__(self, head: NextIdHead) -> None:
        self.head, self.session, self.tokens = head, EchoSession(), torch.zeros(1, 0, dtype=torch.long)

    def next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        self.fed(ids)
        return self.head.logits(self.head.embed(ids)[:, -1])

    def check_room(self, tokens: int) -> None:
        pass

    def fed(self, ids: torch.Tensor) -> None:
        self.tokens = torch.cat([self.tokens, ids], dim=1)


def decode(batcher: DecodeBatcher, head: NextIdHead, first: int, new_tokens: int) -> list[int]:
    decoding = Decoding(torch.zeros(1, 0, dtype=torch.long), torch.tensor([[first]]), GenerationParams(new_tokens))
    return batcher.decode(ScriptedModelSession(head), decoding)[0].tolist()


def test_concurrent_calls_share_turns_and_each_gets_its_own_tokens() -> None:
    head = NextIdHead()
    batcher = DecodeBatcher(head)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda first: decode(batcher, head, first, 6), range(0, 40, 5)))
    assert results == [list(range(first + 1, first + 7)) for first in range(0, 40, 5)]
    assert 0 < batcher.turns < 8 * 5  # 5 picks each in the loop (the first is the caller's own)


def test_a_turn_that_fails_fails_its_calls_and_the_loop_goes_on() -> None:
    head = NextIdHead(fail_on_call=3)  # call 1: the prompt's logits, in the caller's thread; 3: the loop's 2nd turn
    batcher = DecodeBatcher(head)
    failed = threading.Event()

    def first_call() -> None:
        with pytest.raises(RuntimeError, match="the head failed"):
            decode(batcher, head, 3, 4)
        failed.set()

    worker = threading.Thread(target=first_call)
    worker.start()
    worker.join(timeout=30)
    assert failed.is_set()
    assert decode(batcher, head, 10, 4) == [11, 12, 13, 14]
