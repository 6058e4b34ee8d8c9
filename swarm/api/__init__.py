"""The OpenAI-compatible HTTP API in front of a swarm, on Ray Serve.

protocol.py: OpenAI's request bodies (pydantic) and response objects; errors.py: OpenAI's error shape and the map
from RaySwarm's errors to HTTP statuses; text.py: token ids to streamed text (stop sequences, UTF-8) and OpenAI's
penalties, logit bias and min_tokens; logprobs.py: log-probabilities recorded from the client's logits and rendered
in OpenAI's shapes; sampling.py: a request's prompts as token ids and its checked Sampling; generation.py: one
request's generations (a session per prompt) in worker threads, as events; service.py: OpenAIService, the API
without the web framework; app.py: the FastAPI routes as a Ray Serve deployment, and `build` for `serve run`;
chat.html: the chat page served at `/`; keys.py: the API keys file; metrics.py: the API's own Prometheus metrics
(`/metrics`); responses.py: the Responses API (`/v1/responses`) over chat completions; structured.py: JSON and
regex output by constrained decoding (llguidance); tools.py: function calling (tools offered in the prompt, a call
enforced by a grammar, parsed back into tool_calls); reply.py: a request's events as OpenAI's response or its
server-sent events.

Nothing here imports the server package (`peers`): the API runs on machines with no peer code.
"""
