"""Every flag checks its value while parsing (exit 2, one line naming the flag), and the checks that need the model
or the machine run before anything starts; the library checks its arguments the same way (InvalidArgument)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from peers.config import PeerConfig
from swarm.cli import build_parser, main
from swarm.client.arguments import check_session_shape, checked_input_ids
from swarm.client.generate import GenerationParams
from swarm.errors import InvalidArgument
from swarm.registry.addresses import initial_peer_list

ADDRESS = "/ip4/127.0.0.1/tcp/1/p2p/QmXnBkqZqU1JmmjUcHHZxQmLkApvz6bDmVdDa2CQRo9Jcn"
JOIN = ["peer", "join", "--open", "--model", "m"]
GENERATE = ["generate", "--open", "--initial-peers", ADDRESS, "hi"]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ([*JOIN, "--blocks", "abc"], "--blocks"),
        ([*JOIN, "--blocks", "20:10"], "--blocks"),
        ([*JOIN, "--num-blocks", "0"], "--num-blocks"),
        ([*JOIN, "--memory-gib", "-1"], "--memory-gib"),
        ([*JOIN, "--port", "99999"], "--port"),
        ([*JOIN, "--page-size", "x"], "--page-size"),
        ([*JOIN, "--ray-resources", "[1]"], "--ray-resources"),
        ([*JOIN, "--initial-peers", "127.0.0.1:5"], "--initial-peers"),
        (["up", "--open", "--model", "m", "--peers", "-1"], "--peers"),
        (["up", "--open", "--model", "m", "--dht-port", "99999"], "--dht-port"),
        (["monitor", "--open", "--initial-peers", ADDRESS, "--port", "99999"], "--port"),
        (["monitor", "--open", "--initial-peers", ADDRESS, "--refresh", "0"], "--refresh"),
        ([*GENERATE, "--codec", "BOGUS"], "--codec"),
        ([*GENERATE, "--temperature", "-1"], "--temperature"),
        ([*GENERATE, "--top-p", "2"], "--top-p"),
        ([*GENERATE, "--max-new-tokens", "-3"], "--max-new-tokens"),
        ([*GENERATE, "--speculative", "medusa"], "--speculative"),
        ([*GENERATE, "--speculative", "draft:"], "--speculative"),
        ([*GENERATE, "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
        ([*GENERATE, "--num-speculative-tokens", "33"], "--num-speculative-tokens"),
        ([*GENERATE, "--wait-for-blocks", "-1"], "--wait-for-blocks"),
        (["--log-level", "LOUD", "status", "--open", "--initial-peers", ADDRESS], "--log-level"),
        (["stage", "job.yaml", "--open", "--initial-peers", ADDRESS, "--span", "4:2"], "--span"),
        ([*GENERATE[:-1], ""], "prompt"),
        ([*GENERATE[:-1], "  "], "prompt"),
    ],
)
def test_a_bad_flag_value_is_a_usage_error_naming_the_flag(args: list[str], flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(args)
    assert exit_.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_initial_peers_is_one_address_per_flag_so_the_prompt_after_it_is_not_swallowed() -> None:
    ns = build_parser().parse_args(["generate", "--open", "--initial-peers", ADDRESS, "The river rose"])
    assert ns.initial_peers == [ADDRESS] and ns.prompt == "The river rose"
    ns = build_parser().parse_args([*JOIN, "--initial-peers", f"{ADDRESS},{ADDRESS}", "--initial-peers", ADDRESS])
    assert ns.initial_peers == [ADDRESS] * 3


@pytest.mark.parametrize("command", [GENERATE, ["demo"]], ids=["generate", "demo"])
def test_raw_turns_the_chat_template_off(command: list[str]) -> None:
    """What --raw changes is swarm.client.chat.prompt_ids (tests/unit/swarm/client/test_chat.py)."""
    assert build_parser().parse_args(command).raw is False
    assert build_parser().parse_args([*command, "--raw"]).raw is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["peer", "join", "--blocks", "0:999"], "--blocks: 0:999 goes past the model's 30 blocks"),
        (["peer", "join", "--num-blocks", "31"], "--num-blocks: 31 is more than the model's 30 blocks"),
        (["up", "--peers", "1000"], "--peers: 1000 peers cannot split the model's 30 blocks"),
    ],
)
def test_checks_against_the_model_run_before_anything_starts(
    smollm2_path: Path, args: list[str], message: str, capsys
) -> None:
    assert main([*args, "--open", "--model", str(smollm2_path)]) == 2
    assert message in capsys.readouterr().err


def test_adapters_are_checked_before_anything_starts(smollm2_path: Path, tmp_path: Path, capsys) -> None:
    join = ["peer", "join", "--open", "--model", str(smollm2_path), "--adapters"]
    assert main([*join, str(tmp_path / "none")]) == 2
    assert f"--adapters: {tmp_path / 'none'} is not a directory" in capsys.readouterr().err
    (tmp_path / "chat").mkdir()
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": True, "target_modules": ["q_proj"]}
    (tmp_path / "chat" / "adapter_config.json").write_text(json.dumps(config))
    assert main([*join, str(tmp_path)]) == 2
    assert "chat/adapter_config.json" in capsys.readouterr().err
    ns = build_parser().parse_args([*JOIN, "--adapters", str(tmp_path)])
    assert PeerConfig.from_args(ns).server.adapters == str(tmp_path)


@pytest.mark.parametrize("ray_flag", [["--ray-address", "auto"], ["--ray-dashboard"], ["--ray-resources", '{"a": 1}']])
def test_no_ray_refuses_the_ray_flags_before_anything_starts(smollm2_path: Path, ray_flag: list[str], capsys) -> None:
    assert main(["peer", "join", "--open", "--model", str(smollm2_path), "--no-ray", *ray_flag]) == 2
    assert f"--no-ray: runs no Ray: drop {ray_flag[0]}" in capsys.readouterr().err
    assert PeerConfig.from_args(build_parser().parse_args([*JOIN, "--no-ray"])).in_process is True
    assert PeerConfig.from_args(build_parser().parse_args(JOIN)).in_process is False


def test_a_missing_checkpoint_names_the_flag_and_the_directory(tmp_path: Path, capsys) -> None:
    assert main(["generate", "--open", "--initial-peers", ADDRESS, "hi", "--model", str(tmp_path)]) == 2
    assert f"swarm generate: --model: {tmp_path} has no config.json" in capsys.readouterr().err


def test_a_missing_draft_checkpoint_names_the_flag(smollm2_path: Path, tmp_path: Path, capsys) -> None:
    args = ["generate", "--open", "--initial-peers", ADDRESS, "hi", "--model", str(smollm2_path)]
    assert main([*args, "--speculative", f"draft:{tmp_path}"]) == 2
    assert f"swarm generate: --speculative: {tmp_path} has no config.json" in capsys.readouterr().err


def test_speculative_flags_parse() -> None:
    ns = build_parser().parse_args([*GENERATE, "--speculative", "prompt_lookup", "--num-speculative-tokens", "8"])
    assert (ns.speculative, ns.num_speculative_tokens) == ("prompt_lookup", 8)
    assert build_parser().parse_args([*GENERATE, "--speculative", "off"]).speculative == ""
    assert build_parser().parse_args(GENERATE).speculative == ""


def test_initial_peer_list_takes_a_string_a_comma_list_or_a_list() -> None:
    assert initial_peer_list(ADDRESS) == [ADDRESS]
    assert initial_peer_list(f" {ADDRESS} ,{ADDRESS}") == [ADDRESS, ADDRESS]
    assert initial_peer_list((ADDRESS,)) == [ADDRESS]
    for bad, words in [([], "no initial peer"), ("", "no initial peer"), ([1], "list of multiaddresses")]:
        with pytest.raises(InvalidArgument, match=words) as error:
            initial_peer_list(bad)
        assert error.value.argument == "initial_peers"
    with pytest.raises(InvalidArgument, match="lacks the /p2p/ID"):
        initial_peer_list("/ip4/127.0.0.1/tcp/1")
    with pytest.raises(InvalidArgument, match="is not a multiaddress"):
        initial_peer_list("localhost:31337")


@pytest.mark.parametrize(
    ("ids", "words"),
    [
        ([[1, 2]], None),
        (torch.tensor([1, 2]), "expected shape \\[batch, tokens\\]"),
        (torch.tensor([[1.0, 2.0]]), "integer token ids"),
        (torch.tensor([[1, 49152]]), "token id 49152 is outside the vocabulary \\[0, 49152\\)"),
        (torch.tensor([[-1, 2]]), "token id -1 is outside"),
        (torch.zeros(0, 3, dtype=torch.long), "the batch is empty"),
    ],
)
def test_input_ids_are_checked_before_any_step(ids, words: str | None) -> None:
    with pytest.raises(InvalidArgument, match=words or "expected a torch.Tensor") as error:
        checked_input_ids(ids, vocab_size=49152)
    assert error.value.argument == "input_ids"


def test_no_tokens_are_refused_unless_a_session_continues() -> None:
    """generate() with an empty prompt has nothing to continue; a turn of a session may add none to it."""
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(InvalidArgument, match="no tokens") as error:
        checked_input_ids(empty, vocab_size=49152, empty_ok=False)
    assert error.value.argument == "input_ids"
    assert checked_input_ids(empty, vocab_size=49152).shape == (1, 0)


def test_session_shape_and_sampling_arguments_name_what_is_wrong() -> None:
    check_session_shape(8192, 1, context_length=8192)
    for max_length, batch_size, argument in [(10**6, 1, "max_length"), (0, 1, "max_length"), (8, 0, "batch_size")]:
        with pytest.raises(InvalidArgument) as error:
            check_session_shape(max_length, batch_size, context_length=8192)
        assert error.value.argument == argument
    for kwargs, argument in [
        ({"temperature": -1.0}, "temperature"),
        ({"do_sample": True, "temperature": 0.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ]:
        with pytest.raises(InvalidArgument) as error:
            GenerationParams(**kwargs)
        assert error.value.argument == argument
