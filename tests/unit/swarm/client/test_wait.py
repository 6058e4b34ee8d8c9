"""When a session gives up on a hop's answer (span_session.py: _Wait): a late answer from a peer that answers a health
probe is awaited up to the step timeout; one from a silent peer is given up at the late point, the probe having
started before it."""

from __future__ import annotations

import time

import pytest

from swarm.client.span_session import PROBE_TIMEOUT_S, _Wait

LATE_S, PATIENCE_S = 0.6, 5.0


def _run_out(wait: _Wait) -> None:
    time.sleep(wait.remaining_s())


def test_a_silent_peer_is_late_at_the_late_point() -> None:
    probes = []
    wait = _Wait(LATE_S, PATIENCE_S, lambda: probes.append(1) or (lambda: False))
    assert wait.remaining_s() == pytest.approx(LATE_S - PROBE_TIMEOUT_S, abs=0.05)  # the probe starts early
    _run_out(wait)
    assert wait.go_on() and probes == [1]
    _run_out(wait)
    assert not wait.go_on()
    assert wait.waited_s() == pytest.approx(LATE_S, abs=0.1)
    assert probes == [1]


def test_a_busy_peer_gets_until_the_step_timeout_once() -> None:
    wait = _Wait(LATE_S, PATIENCE_S, lambda: lambda: True)
    _run_out(wait)
    assert wait.go_on()
    _run_out(wait)
    assert wait.go_on()
    assert wait.remaining_s() == pytest.approx(PATIENCE_S - LATE_S, abs=0.1)
    assert not wait.go_on()  # once: when the limit comes, the answer is late


def test_without_patience_there_is_no_probe() -> None:
    wait = _Wait(LATE_S, LATE_S, lambda: pytest.fail("no probe without patience"))
    assert wait.remaining_s() == pytest.approx(LATE_S, abs=0.05)
    _run_out(wait)
    assert not wait.go_on()


def test_a_late_hop_that_was_pushed_its_step_is_sent_it_again_once() -> None:
    """A push may be lost after the previous peer answered: when the answer is late, the client sends the step
    itself (the peer runs a step id once), then probes as usual."""
    events: list[str] = []
    wait = _Wait(LATE_S, PATIENCE_S, lambda: events.append("probe") or (lambda: True), lambda: events.append("resend"))
    _run_out(wait)
    assert wait.go_on() and events == ["resend", "probe"]
    _run_out(wait)
    assert wait.go_on() and events == ["resend", "probe"]
