"""The mistakes new users make, made as they would make them (a real `swarm` command or a real script, in a
subprocess, against a real swarm): each gets a clear error naming the argument at once, the process exits promptly,
and nothing it started is left running. Every flag's own range is checked in-process by
tests/unit/swarm/cli/test_arguments.py; here one case of each class runs as a user's process."""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

import pytest

from ...machine_pace import scaled
from ..shared_swarm import RunningSwarm
from ..user_process import UserProcess, UserRun, run_cli, run_script

EXIT_LAG_S = 2.0  # a process is gone this soon after its last word (on a quiet machine: tests/machine_pace.py)
INTERRUPT_LAG_S = 5.0  # and this soon after Ctrl-C
UNREACHABLE = "/ip4/127.0.0.1/tcp/1/p2p/QmXnBkqZqU1JmmjUcHHZxQmLkApvz6bDmVdDa2CQRo9Jcn"


def assert_clean_usage_error(run: UserRun, flag: str) -> None:
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert flag in run.stderr, run.stderr
    assert run.exit_lag_s <= scaled(EXIT_LAG_S), f"exited {run.exit_lag_s:.1f} s after its message"
    assert not run.survivors, run.survivors


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["peer", "join", "--open", "--blocks", "20:10"], "--blocks"),  # argparse: the value itself
        (["peer", "join", "--open", "--blocks", "0:999"], "--blocks"),  # against the model, before Ray starts
        (["up", "--open", "--peers", "1000"], "--peers"),
        (["generate", "--open", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "hi"], "--initial-peers"),
        (["generate", "--open", "--initial-peers", UNREACHABLE, "hi", "--codec", "BOGUS"], "--codec"),
    ],
)
def test_a_wrong_flag_is_a_one_line_error_and_nothing_is_left_running(
    smollm2_path: Path, args: list[str], flag: str
) -> None:
    if args[0] in ("peer", "up"):
        args = [*args, "--model", str(smollm2_path)]
    assert_clean_usage_error(run_cli(*args), flag)


def test_a_port_in_use_is_named_before_anything_starts(smollm2_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = run_cli("peer", "join", "--open", "--model", str(smollm2_path), "--port", str(port))
    assert_clean_usage_error(run, "--port")
    assert f"127.0.0.1:{port}" in run.stderr


def test_the_default_model_outside_the_repository_is_explained(tmp_path: Path) -> None:
    run = UserProcess(["-m", "swarm", "generate", "--open", "--initial-peers", UNREACHABLE, "hi"], cwd=tmp_path)
    result = run.finish(120)
    assert_clean_usage_error(result, "--model")
    assert f"relative to {tmp_path}" in result.stderr


def test_an_unreachable_swarm_fails_at_once_with_nothing_left_behind(smollm2_path: Path) -> None:
    run = run_cli("status", "--open", "--initial-peers", UNREACHABLE)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "cannot join the DHT" in run.stderr
    assert run.exit_lag_s <= scaled(EXIT_LAG_S) and not run.survivors, (run.exit_lag_s, run.survivors)


PREAMBLE = """
import torch
from swarm import DistributedModelForCausalLM, SwarmCredentials, SwarmError

def expect_error(label, call):
    try:
        call()
    except SwarmError as error:
        print(f"{label}: {type(error).__name__} [{getattr(error, 'argument', '')}] {error}", flush=True)
    else:
        print(f"{label}: no error", flush=True)

def load(path, peers, **overrides):
    return DistributedModelForCausalLM.from_pretrained(path, peers, credentials=SwarmCredentials.open(), **overrides)
"""


def script(body: str, **values: object) -> str:
    assignments = "".join(f"{name} = {value!r}\n" for name, value in values.items())
    return PREAMBLE + assignments + textwrap.dedent(body)


def test_library_arguments_are_checked_before_anything_starts(running_swarm: RunningSwarm, smollm2_path: Path) -> None:
    run = run_script(
        script(
            """
            expect_error("missing dir", lambda: load("/nonexistent/model", PEERS))
            expect_error("no peers", lambda: load(MODEL, []))
            expect_error("bad address", lambda: load(MODEL, ["/ip4/127.0.0.1/tcp/1"]))
            expect_error("bad field", lambda: load(MODEL, PEERS, step_timeout=3))
            model = load(MODEL, PEERS[0])  # one address as a string is one address
            ids = torch.tensor([[1, 2, 3]])
            expect_error("float ids", lambda: model.generate(ids.float(), max_new_tokens=2))
            expect_error("1-D ids", lambda: model.generate(ids[0], max_new_tokens=2))
            expect_error("beyond vocab", lambda: model.generate(ids + 10**6, max_new_tokens=2))
            expect_error("no tokens", lambda: model.generate(ids[:, :0], max_new_tokens=2))
            expect_error("temperature", lambda: model.generate(ids, do_sample=True, temperature=-1))
            expect_error("max_length", lambda: model.inference_session(max_length=10**6))
            expect_error("batch_size", lambda: model.inference_session(max_length=8, batch_size=0))
            print("generated", model.generate(ids, max_new_tokens=2).shape[1], flush=True)
            """,
            MODEL=str(smollm2_path),
            PEERS=[running_swarm.initial_peers],
        )
    )
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert lines["missing dir"].startswith("CheckpointError") and "/nonexistent/model" in lines["missing dir"]
    expected = {
        "no peers": "initial_peers",
        "bad address": "initial_peers",
        "bad field": "step_timeout",
        "float ids": "input_ids",
        "1-D ids": "input_ids",
        "beyond vocab": "input_ids",
        "no tokens": "input_ids",
        "temperature": "temperature",
        "max_length": "max_length",
        "batch_size": "batch_size",
    }
    for label, argument in expected.items():
        assert lines[label].startswith(f"InvalidArgument [{argument}]"), (label, lines.get(label), run.stderr[-2000:])
    assert "generated 5" in run.stdout, run.stderr[-3000:]
    assert run.returncode == 0 and run.exit_lag_s <= scaled(EXIT_LAG_S), (run.returncode, run.exit_lag_s)
    assert not run.survivors, run.survivors


@pytest.mark.parametrize("ending", ["close", "no close", "exception"])
def test_a_script_exits_promptly_however_it_ends(running_swarm: RunningSwarm, smollm2_path: Path, ending: str) -> None:
    run = run_script(
        script(
            """
            model = load(MODEL, PEERS)
            model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
            print("done", flush=True)
            if ENDING == "close":
                model.close()
            elif ENDING == "exception":
                raise RuntimeError("the user's own bug")
            """,
            MODEL=str(smollm2_path),
            PEERS=[running_swarm.initial_peers],
            ENDING=ending,
        )
    )
    assert "done" in run.stdout, run.stderr[-3000:]
    assert run.returncode == (1 if ending == "exception" else 0)
    assert run.exit_lag_s <= scaled(EXIT_LAG_S), f"{ending}: exited {run.exit_lag_s:.1f} s after its last word"
    assert not run.survivors, run.survivors


def test_ctrl_c_on_generate_exits_at_once_and_leaves_nothing(running_swarm: RunningSwarm) -> None:
    args = ["generate", "--open", "--initial-peers", running_swarm.initial_peers, "--max-new-tokens", "2000", "--raw"]
    process = UserProcess(["-m", "swarm", *args, "Once upon a time"])
    process.wait_for_output("Once upon a time", timeout_s=120)
    process.interrupt()
    run = process.finish(60)
    assert run.returncode == 130 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.exit_lag_s <= scaled(INTERRUPT_LAG_S), f"exited {run.exit_lag_s:.1f} s after Ctrl-C"
    assert not run.survivors, run.survivors


STACK_DUMP_MARKS = ("Traceback", "*** SIG", "PC: @", "Exception ignored")  # Python's, and Ray's C++ (absl) dumps
RAY_LINGER_S = 10.0  # what `swarm up` started is gone this soon after it is SIGKILLed (Ray's own agents: 62 s)


def assert_no_dump(stderr: str) -> None:
    assert not any(mark in stderr for mark in STACK_DUMP_MARKS), stderr[-3000:]


@pytest.mark.parametrize("command", ["up", "peer join"])
def test_ctrl_c_while_a_daemon_starts_stops_it_at_once(
    running_swarm: RunningSwarm, smollm2_path: Path, command: str
) -> None:
    if command == "up":
        args = ["up", "--open", "--peers", "1"]
    else:  # a Ray of its own, joining the shared swarm
        args = ["peer", "join", "--open", "--initial-peers", running_swarm.initial_peers, "--num-blocks", "2"]
    process = UserProcess(["-m", "swarm", *args, "--model", str(smollm2_path)])
    process.wait_for_process("ray::StagePeer", timeout_s=120)  # Ray runs, the stage actor loads its blocks
    process.interrupt()
    run = process.finish(60)
    assert run.returncode == 130, run.stderr[-3000:]
    assert run.stderr.splitlines() == [f"swarm {command}: interrupted"], run.stderr[-3000:]
    lag = run.signal_lag_s
    assert lag is not None and lag <= scaled(INTERRUPT_LAG_S), f"exited {lag} s after"
    assert not run.survivors, run.survivors


@pytest.mark.parametrize("ending", ["ctrl-c", "sigkill"])
def test_swarm_up_leaves_nothing_running_however_it_ends(smollm2_path: Path, ending: str) -> None:
    """Ctrl-C once it serves drains it (exit 0, as SIGTERM does); SIGKILL takes Ray's processes along."""
    process = UserProcess(["-m", "swarm", "up", "--open", "--peers", "0", "--model", str(smollm2_path)])
    process.wait_for_output("initial peers", timeout_s=120)
    if ending == "ctrl-c":
        process.interrupt()
        run = process.finish(60)
        assert run.returncode == 0 and "swarm stopped (all work finished)" in run.stdout, run.stderr[-3000:]
        assert_no_dump(run.stderr)
        assert run.signal_lag_s is not None and run.signal_lag_s <= scaled(INTERRUPT_LAG_S), run.signal_lag_s
    else:
        process.kill()
        run = process.finish(10, children_grace_s=scaled(RAY_LINGER_S))
    assert not run.survivors, run.survivors


def test_ctrl_c_on_monitor_stops_it_at_once(running_swarm: RunningSwarm) -> None:
    process = UserProcess(["-m", "swarm", "monitor", "--open", "--initial-peers", running_swarm.initial_peers])
    process.wait_for_output("swarm map at", timeout_s=60)
    process.interrupt()
    run = process.finish(30)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_no_dump(run.stderr)
    assert run.signal_lag_s is not None and run.signal_lag_s <= scaled(INTERRUPT_LAG_S), run.signal_lag_s
    assert not run.survivors, run.survivors
