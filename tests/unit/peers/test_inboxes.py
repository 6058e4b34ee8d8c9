"""A push that overtakes the client's opening of its session waits for it (peers/push.py: Inboxes.deliver), and
only the holder of the session's current push token may push, appending at its length (PushFence)."""

from __future__ import annotations

import asyncio

import pytest

from peers.push import PUSH_OPEN_GRACE_S, Inbox, Inboxes
from swarm._proto import swarm_pb2 as pb
from swarm.errors import PermissionDenied, SessionNotFound


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
        delivering = asyncio.create_task(inboxes.deliver("s1", pb.InferenceStep(step_id=7), b"token"))
        await asyncio.sleep(PUSH_OPEN_GRACE_S / 4)  # the push came first; the client's opening lands now
        inbox = Inbox(_nothing_from_the_client(), b"token")
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
            await Inboxes().deliver("nobody", pb.InferenceStep(step_id=1), b"")
        return loop.time() - started

    assert PUSH_OPEN_GRACE_S <= asyncio.run(scenario()) < PUSH_OPEN_GRACE_S + 0.5


async def _fence_then_nothing(token: bytes, arrived: asyncio.Event):
    await arrived.wait()  # the client's fence comes once a push is queued already
    yield pb.InferenceRequest(fence=pb.InferenceFence(push_token=token))
    await asyncio.Event().wait()


def test_a_push_needs_the_current_token_and_the_length_and_no_hypo_ids() -> None:
    async def scenario() -> None:
        inbox = Inbox(_nothing_from_the_client(), b"token")
        for token, step in (
            (b"", pb.InferenceStep(step_id=1)),
            (b"other", pb.InferenceStep(step_id=1)),
            (b"token", pb.InferenceStep(step_id=1, position=1)),
            (b"token", pb.InferenceStep(step_id=1, hypo_ids=[0])),
        ):
            with pytest.raises(PermissionDenied):
                await inbox.push(step, token)
        inbox.close()

    asyncio.run(scenario())


def test_a_session_opened_without_a_token_takes_no_pushes() -> None:
    async def scenario() -> None:
        inbox = Inbox(_nothing_from_the_client())
        with pytest.raises(PermissionDenied):
            await inbox.push(pb.InferenceStep(step_id=1), b"")
        inbox.close()

    asyncio.run(scenario())


def test_a_fence_drops_pushes_queued_before_it_and_takes_the_new_token() -> None:
    """A replaced peer's push that was queued before the client's fence arrived is never run."""

    async def scenario() -> list[int]:
        arrived = asyncio.Event()
        inbox = Inbox(_fence_then_nothing(b"new", arrived), b"old")
        await inbox.push(pb.InferenceStep(step_id=1), b"old")
        arrived.set()
        await asyncio.sleep(0.01)  # the reader applies the fence
        with pytest.raises(PermissionDenied):
            await inbox.push(pb.InferenceStep(step_id=2), b"old")
        await inbox.push(pb.InferenceStep(step_id=3), b"new")
        step = await _first_pushed_step(inbox)
        inbox.close()
        return [step.step_id]

    assert asyncio.run(scenario()) == [3]


def test_a_queued_push_overtaken_by_the_length_is_dropped() -> None:
    async def scenario() -> int:
        inbox = Inbox(_nothing_from_the_client(), b"token")
        await inbox.push(pb.InferenceStep(step_id=1, position=0), b"token")
        inbox.fence.length = 1  # the client's own step ran first
        await inbox.push(pb.InferenceStep(step_id=2, position=1), b"token")
        step = await _first_pushed_step(inbox)
        inbox.close()
        return step.step_id

    assert asyncio.run(scenario()) == 2
