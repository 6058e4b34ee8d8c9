"""What the API accepts and refuses before any generation: request bodies, errors' OpenAI shape and statuses, the
Serve config in cluster/, and `build`'s arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from swarm.api.errors import api_error_for
from swarm.api.protocol import ChatCompletionRequest, CompletionRequest
from swarm.errors import InvalidArgument, LimitExceeded, MissingBlocks, Overloaded, PeerUnavailable

CLUSTER = Path(__file__).resolve().parents[4] / "cluster"
MESSAGES = [{"role": "user", "content": "hi"}]


def test_openai_defaults() -> None:
    request = ChatCompletionRequest(model="m", messages=MESSAGES)
    assert (request.temperature, request.top_p, request.n, request.stream, request.stop) == (1.0, 1.0, 1, False, [])
    assert request.token_limit is None and request.refused_fields() == []


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert ChatCompletionRequest(model="m", messages=MESSAGES, max_tokens=5, max_completion_tokens=9).token_limit == 9


@pytest.mark.parametrize(
    "field",
    [
        {"temperature": 2.5},
        {"top_p": 0},
        {"n": 0},
        {"n": 17},
        {"max_tokens": -1},
        {"presence_penalty": 3},
        {"stop": ["a", "b", "c", "d", "e"]},
        {"stop": [""]},
        {"messages": []},
        {"speculative": "draft:/etc"},  # a request never makes the server load a path
        {"num_speculative_tokens": 0},
    ],
)
def test_out_of_range_fields_are_refused(field: dict) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest(**{"model": "m", "messages": MESSAGES, **field})


def test_fields_not_implemented_yet_are_named() -> None:
    assert ChatCompletionRequest(
        model="m", messages=MESSAGES, response_format={"type": "grammar"}
    ).refused_fields() == ["response_format"]
    assert ChatCompletionRequest(model="m", messages=MESSAGES, response_format={"type": "text"}).refused_fields() == []
    assert CompletionRequest(model="m", prompt="x", suffix="y").refused_fields() == ["suffix"]


@pytest.mark.parametrize("prompt", ["text", [1, 2, 3], ["one", "two"], [[1, 2], [3]]])
def test_every_prompt_form_openai_takes_keeps_its_form(prompt: object) -> None:
    assert CompletionRequest(model="m", prompt=prompt).prompt == prompt


def test_log_probability_fields() -> None:
    assert ChatCompletionRequest(model="m", messages=MESSAGES).logprobs_top is None
    assert ChatCompletionRequest(model="m", messages=MESSAGES, logprobs=True).logprobs_top == 0
    assert ChatCompletionRequest(model="m", messages=MESSAGES, logprobs=True, top_logprobs=5).logprobs_top == 5
    assert CompletionRequest(model="m", prompt="x", logprobs=0).logprobs_top == 0
    assert CompletionRequest(model="m", prompt="x").logprobs_top is None
    for wrong in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):  # top without logprobs; past 20
        with pytest.raises(ValidationError):
            ChatCompletionRequest(model="m", messages=MESSAGES, **wrong)
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="x", logprobs=21)


def test_logit_bias_takes_token_ids_and_values_within_100() -> None:
    assert ChatCompletionRequest(model="m", messages=MESSAGES, logit_bias={"7": -100}).logit_bias == {7: -100.0}
    for wrong in ({"7": 101}, {"seven": 1}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(model="m", messages=MESSAGES, logit_bias=wrong)


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (InvalidArgument("top_k", "must be >= 0"), 400, "invalid_request_error"),
        (Overloaded("full"), 429, "rate_limit_error"),
        (LimitExceeded("sessions_per_client", "8 of 8"), 429, "rate_limit_error"),
        (MissingBlocks("no live peer serves blocks [3, 5)"), 503, "service_unavailable"),
        (PeerUnavailable("gone"), 503, "service_unavailable"),
        (RuntimeError("bug"), 500, "internal_error"),
    ],
)
def test_errors_map_to_statuses_in_openai_shape(error: Exception, status: int, kind: str) -> None:
    answer = api_error_for(error)
    assert answer.status == status
    assert answer.body()["error"]["type"] == kind
    assert set(answer.body()["error"]) == {"message", "type", "param", "code"}
    assert str(error) in answer.body()["error"]["message"]


def test_an_invalid_argument_names_its_param() -> None:
    assert api_error_for(InvalidArgument("messages[0].role", "no")).param == "messages[0].role"


def test_the_serve_config_is_valid_for_ray_serve() -> None:
    config = ServeDeploySchema.model_validate(yaml.safe_load((CLUSTER / "serve-api.yaml").read_text()))
    (application,) = config.applications
    assert application.import_path == "swarm.api.app:build"
    assert application.args["model"] and application.args["initial_peers"]


def test_build_refuses_to_guess_the_credentials(smollm2_path: Path) -> None:
    from swarm.api.app import build

    peers = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWNvWJZLu9wB1MksZMQFZjj39FbroVLf9rjcLFgcuCauTe"
    with pytest.raises(ValueError, match="open=true"):
        build({"model": str(smollm2_path), "initial_peers": peers})
    with pytest.raises(ValueError, match="model"):
        build({"initial_peers": peers, "open": "true"})
    application = build({"model": str(smollm2_path), "initial_peers": peers, "open": "true", "num_replicas": 2})
    assert application is not None
