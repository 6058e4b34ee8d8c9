"""Function calling for chat completions (`tools`, `tool_choice`): the tools offered to the model in the prompt, a
call enforced by constrained decoding when one is required, and the model's text parsed back into `tool_calls`.

The prompt: every checkpoint gets the same documented offer (RaySwarm's fallback, also for templates that have
their own tools support, so that parsing needs one format), a system message listing each function's name,
description and JSON-schema parameters, asking for `{"name": ..., "arguments": {...}}` and nothing else to call
one. Assistant messages with `tool_calls` and `tool` messages of the history are rendered as that text.
`tool_choice` "required" or a named function decodes under a grammar (structured.py) that admits only a call
whose arguments validate against the function's schema: even a small model answers with a valid call. "auto"
decodes freely and parses the answer: a call if it is one, text otherwise. One call per turn.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from swarm.api.errors import invalid

OFFER = (
    "You can call functions. To call one, answer with only a JSON object "
    '{{"name": FUNCTION_NAME, "arguments": {{...}}}} whose arguments follow its parameters, and nothing else. '
    "Otherwise answer normally. The functions:\n{functions}"
)


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class Tools:
    """A chat request's tools and its tool_choice, checked."""

    def __init__(self, tools: list[Any], choice: Any) -> None:
        self.functions: dict[str, dict[str, Any]] = {}
        for index, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise invalid(f"tools[{index}]: expected {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
            parameters = function.get("parameters") or {"type": "object", "properties": {}}
            self.functions[function["name"]] = {**function, "parameters": parameters}
        self.required = self._required(choice)

    def _required(self, choice: Any) -> list[str]:
        """The functions one of which the answer must call (none: "auto")."""
        if choice in (None, "auto"):
            return []
        if choice == "required":
            return list(self.functions)
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if name not in self.functions:
            raise invalid(
                f"tool_choice: expected auto, none, required or one of the tools, got {choice!r}", "tool_choice"
            )
        return [name]

    @classmethod
    def of(cls, request: Any) -> Tools | None:
        """The request's tools, or None when it has none or asks for none."""
        if not request.tools or request.tool_choice == "none":
            return None
        return cls(request.tools, request.tool_choice)

    def offered(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` after a system message that offers the tools."""
        listed = [{key: f.get(key) for key in ("name", "description", "parameters")} for f in self.functions.values()]
        offer = OFFER.format(functions="\n".join(json.dumps(function) for function in listed))
        return [{"role": "system", "content": offer}, *messages]

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema of a required call (None: "auto")."""
        calls = [_call_schema(name, self.functions[name]["parameters"]) for name in self.required]
        return None if not calls else calls[0] if len(calls) == 1 else {"anyOf": calls}

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The tool calls `text` makes, in OpenAI's shape, or None if it is an answer in words."""
        try:
            call = json.loads(text)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.functions:
            return None
        arguments = call.get("arguments", {})
        function = {"name": call["name"], "arguments": json.dumps(arguments)}
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}]


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": closed_objects(parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not say (as xgrammar's strict
    mode reads a schema): a function takes the arguments it declares. Left open, a tool without parameters
    (`{"type": "object", "properties": {}}`) let a sampled small model invent arguments until max_tokens cut the
    call (seen: 1 of 20 `required` calls)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):  # names to schemas: a name is not a keyword
            closed[key] = {name: closed_objects(item) for name, item in value.items()}
        else:
            closed[key] = closed_objects(value)
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def history_as_text(messages: list[Any]) -> list[Any]:
    """Assistant messages with `tool_calls` as the JSON text a call is made of; `tool` messages as their content."""
    rendered = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if calls:
            made = [{"name": c["function"]["name"], "arguments": _arguments(c)} for c in calls]
            message = {"role": "assistant", "content": json.dumps(made[0] if len(made) == 1 else made)}
        rendered.append(message)
    return rendered


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call["function"].get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments
