"""A push that overtakes the client's opening of its session waits for it (peers/push.py: Inboxes.deliver)."""

from __future__ import annotations

import asyncio

import pytest

from peers.push import PUSH_OPEN_GRACE_S, Inbox, Inboxes
from swarm._proto import swarm_pb2 as pb
from swarm.errors import SessionNotFound


async def _nothing_from_the_client():
    await asyncio.Event().wait()  # the client's stream: open, nothing sent yet
    yield pb.InferenceRequest()


async def _first_pushed_step(inbox: Inbox) -> pb.InferenceStep:
    async for source, step in inbox.steps():
        assert source == "push"
        return step
    raise AssertionError("the inbox ended")


def test_a_push_waits_for_its_session_to_open() -> None:
    async def scenario() -> int:
        inboxes = Inboxes()
        delivering = asyncio.create_task(inboxes.deliver("s1", pb.InferenceStep(step_id=7)))
        await asyncio.sleep(PUSH_OPEN_GRACE_S / 4)  # the push came first; the client's opening lands now
        inbox = Inbox(_nothing_from_the_client())
        inboxes.add("s1", inbox)
        await delivering
        step = await _first_pushed_step(inbox)
        inbox.close()
        return step.step_id

    assert asyncio.run(scenario()) == 7


def test_a_push_for_a_session_that_never_opens_is_not_found() -> None:
    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(SessionNotFound):
            await Inboxes().deliver("nobody", pb.InferenceStep(step_id=1))
        return loop.time() - started

    assert PUSH_OPEN_GRACE_S <= asyncio.run(scenario()) < PUSH_OPEN_GRACE_S + 0.5
