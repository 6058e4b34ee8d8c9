"""The OpenAI-compatible HTTP API as a Ray Serve application: FastAPI routes over OpenAIService (service.py).

No `from __future__ import annotations` here: Serve's ingress wraps the methods, and FastAPI then cannot resolve
string annotations (a `Request` parameter would be taken for a query field).

`swarm api` deploys it on a local or existing Ray cluster; `serve run swarm.api.app:build model=DIR
initial_peers=ADDR open=true` and the Serve config cluster/serve-api.yaml deploy the same application, with as
many replicas as asked. Every replica is a client of the swarm of its own: it holds the models' heads and opens
one inference session per request on the peers, which batch sessions from all replicas together.
"""

import hmac
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

import swarm
from swarm.api import metrics as api_metrics
from swarm.api.errors import ApiError, api_error_for, invalid, unauthorized
from swarm.api.keys import read_api_keys
from swarm.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from swarm.api.responses import ResponsesRequest
from swarm.api.service import DEFAULT_MAX_SESSIONS, OpenAIService
from swarm.registry.addresses import initial_peer_list
from swarm.security import SwarmCredentials

CHAT_PAGE = Path(__file__).with_name("chat.html")
MAX_ONGOING_REQUESTS = 256  # per replica; each is a worker thread waiting on the peers most of the time

app = FastAPI(title="RaySwarm OpenAI-compatible API")


def _counted(request: Request, status: int) -> None:
    """Count an answer by its route's template (not its path: unknown paths would grow the series) and status,
    where each answer is made (the routes and the error handlers)."""
    api_metrics.REPLICA.requests.labels(getattr(request.scope.get("route"), "path", "unmatched"), str(status)).inc()


def _answered(request: Request, result: Any) -> Any:
    _counted(request, 200)
    return result


@app.exception_handler(Exception)
async def _api_error(request: Request, error: Exception) -> JSONResponse:
    """Every error in OpenAI's shape: ours by api_error_for's table, anything unexpected as a 500."""
    answer = api_error_for(error)
    _counted(request, answer.status)
    return JSONResponse(answer.body(), status_code=answer.status)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """An unknown route (404) or method (405) in OpenAI's error shape, not the web framework's."""
    message = f"{request.method} {request.url.path}: {error.detail}"
    answer = ApiError(error.status_code, message, "invalid_request_error", None, "not_found")
    _counted(request, answer.status)
    return JSONResponse(answer.body(), status_code=answer.status, headers=getattr(error, "headers", None))


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
    return await _api_error(request, invalid(f"{param or 'body'}: {first.get('msg')}", param=param))


class _EventsResponse(StreamingResponse):
    """A streamed answer that closes its events however the response ends: sent whole, failed, or cancelled (the
    client went away) before or after its first chunk. Closing them stops the generation (service.py)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _respond(result: dict[str, Any] | AsyncIterator[str]) -> Any:
    if isinstance(result, dict):
        return result
    return _EventsResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# Serve pickles the class when it is decorated: whatever its methods use must be defined above it.
@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class SwarmOpenAI:
    """One replica: the models' client parts, joined to the swarm through `initial_peers`."""

    def __init__(
        self,
        models: Sequence[str],
        initial_peers: Sequence[str],
        credentials: str | None = None,
        api_keys: Sequence[str] = (),
        client_options: dict[str, Any] | None = None,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        chosen = SwarmCredentials.load(Path(credentials)) if credentials else SwarmCredentials.open()
        paths = [Path(model) for model in models]
        options = client_options or {}
        self.service = OpenAIService.connect(
            paths, initial_peers, chosen, MAX_ONGOING_REQUESTS, max_sessions, api_metrics.REPLICA, **options
        )
        self.api_keys = tuple(api_keys)

    def _authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise unauthorized("no API key: send the header 'Authorization: Bearer KEY'")
        if not any(hmac.compare_digest(key.encode(), known.encode()) for known in self.api_keys):
            raise unauthorized("the API key is not one this server accepts")

    @app.get("/")
    async def page(self) -> FileResponse:
        return FileResponse(CHAT_PAGE, media_type="text/html")

    @app.get("/health")
    async def health(self) -> dict[str, Any]:
        return self.service.health()

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return _answered(request, self.service.list_models())

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        self._authorize(request)
        return _answered(request, _respond(await self.service.chat(body)))

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._authorize(request)
        return _answered(request, _respond(await self.service.complete(body)))

    @app.post("/v1/responses")
    async def responses(self, body: ResponsesRequest, request: Request) -> Any:
        self._authorize(request)
        return _answered(request, _respond(await self.service.respond(body)))

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return _answered(request, self.service.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return _answered(request, self.service.detokenize(body))

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus' scrape, unauthenticated as /health is (counts and latencies, no request content)."""
        return Response(api_metrics.REPLICA.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version(self) -> dict[str, Any]:
        return {"version": swarm.__version__}

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.close()


def build(args: dict[str, Any]) -> serve.Application:
    """The application builder for `serve run swarm.api.app:build KEY=VALUE ...` and Serve config files.

    args: `model` (a checkpoint directory, or several separated by commas), `initial_peers` (one multiaddress or
    several separated by commas), `credentials` (a member's credential directory) or `open: true`, `api_keys`
    (a file of keys), `num_replicas`, `max_sessions` (sessions each replica holds on a model's peers at once; more
    requests wait), and ClientConfig fields in `client_options` (a mapping, config files only).
    """
    models = _list(args.get("model") or args.get("models"))
    if not models:
        raise ValueError("model: give at least one checkpoint directory")
    credentials = args.get("credentials")
    if not credentials and str(args.get("open", "")).lower() not in ("1", "true", "yes"):
        raise ValueError("give credentials=DIR (a private swarm's member) or open=true (an open swarm)")
    keys = read_api_keys(Path(args["api_keys"])) if args.get("api_keys") else []
    deployment = SwarmOpenAI.options(num_replicas=int(args.get("num_replicas", 1)))
    return deployment.bind(
        models,
        initial_peer_list(_list(args.get("initial_peers"))),
        credentials or None,
        keys,
        dict(args.get("client_options") or {}),
        int(args.get("max_sessions", DEFAULT_MAX_SESSIONS)),
    )


def _list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return [str(part) for part in value]
