"""The HTTP front end: SageMaker's /ping and /invocations plus DJL's model routes.

gunicorn calls `create_app(RUNTIME_JSON)` in each worker after forking, so each worker opens its
own engine socket and I/O thread. Every response, errors included, is JSON and carries
`x-request-id`; no handler lets a stack trace reach the client.
"""

from __future__ import annotations

import logging
import select
import socket
import time
import uuid
from pathlib import Path

import yaml
from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from lmserve.handlers.forwarding_handler import ForwardingHandler
from lmserve.handlers.interface import Handler, HandlerRequest, HandlerResponse, Route
from lmserve.handlers.llm_handler import LLMHandler
from lmserve.rolling_batch import protocol
from lmserve.rolling_batch.runtime import Runtime

from . import metrics, model_status
from .adapter_routes import add_adapter_routes
from .engine_client import EngineClient
from .http_errors import error_response, unknown_model

log = logging.getLogger("lmserve.http")

_OPENAPI = Path(__file__).with_name("openapi.yaml")  # every route, request and answer

# A scrape waits this long for a fresh answer: the rolling engine answers between steps (tens
# of ms), engine=Python between batches (seconds), when the engine client's copy serves.
_STATS_TIMEOUT_S = 0.5
_INFERENCE_ROUTES = ("invocations", "predictions", "chat_completions", "completions")


def create_app(runtime_path: str) -> Flask:
    runtime = Runtime.read(runtime_path)
    client = EngineClient(runtime)
    # A user's handle() runs in the engine process; lmserve's LLM handler runs here.
    handler: Handler = (
        LLMHandler(runtime, client)
        if runtime.entry_point is None
        else ForwardingHandler(runtime, client)
    )
    app = Flask(__name__)
    started_at = time.time()
    app.config["MAX_CONTENT_LENGTH"] = runtime.config.max_request_size
    name = runtime.model_name

    @app.before_request
    def assign_request_id() -> None:
        g.request_id = request.headers.get("x-request-id") or uuid.uuid4().hex

    @app.after_request
    def tag_response(response: Response) -> Response:
        response.headers["x-request-id"] = g.get("request_id") or uuid.uuid4().hex
        if request.endpoint in _INFERENCE_ROUTES:
            # Counted in the engine so every gunicorn worker's /metrics agrees.
            client.notify(protocol.CountResponse(response.status_code))
        return response

    @app.errorhandler(HTTPException)
    def httperror_response(error: HTTPException):
        return error_response(error.code or 500, error.description or error.name)

    @app.errorhandler(RequestEntityTooLarge)
    def too_large(_: RequestEntityTooLarge):
        limit = runtime.config.max_request_size
        return error_response(413, f"request body over max_request_size ({limit} bytes)")

    @app.errorhandler(Exception)
    def unexpectederror_response(error: Exception):
        log.exception("request %s failed inside the front end", g.get("request_id"))
        return error_response(500, f"internal error: {type(error).__name__}")

    @app.get("/ping")
    def ping():
        state = client.state()
        status = model_status.health_status(state["state"])
        if state["state"] == protocol.EngineState.READY:
            return jsonify({name: {"status": status}})
        code = 500 if state["state"] == protocol.EngineState.FAILED else 503
        return jsonify({name: {"status": status, "reason": state.get("reason")}}), code

    @app.post("/invocations")
    def invocations():
        requested = request.args.get("model_name") or request.headers.get("model_name")
        return _predict(requested or name, Route.INVOCATIONS)

    @app.post("/predictions/<model>")
    def predictions(model: str):
        return _predict(model, Route.INVOCATIONS)

    @app.post("/v1/chat/completions")
    def chat_completions():
        return _predict(name, Route.CHAT_COMPLETIONS)

    @app.post("/v1/completions")
    def completions():
        return _predict(name, Route.COMPLETIONS)

    add_adapter_routes(app, runtime, client)
    api_document = yaml.safe_load(_OPENAPI.read_text())

    @app.get("/openapi.json")
    def openapi():
        return jsonify(api_document)

    @app.get("/v1/models")
    def openai_models():
        created = int(started_at)
        card = {"id": name, "object": "model", "created": created, "owned_by": "lmserve"}
        return jsonify({"object": "list", "data": [card]})

    @app.get("/models")
    def list_models():
        return jsonify({"models": [_describe(detailed=False)]})

    @app.get("/models/<model>")
    def describe_model(model: str):
        return unknown_model(model, name) or jsonify(_describe(detailed=True))

    def _predict(model: str, route: Route):
        refusal = unknown_model(model, name)
        if refusal is not None:
            return refusal
        state = client.state()
        if state["state"] != protocol.EngineState.READY:
            status = 500 if state["state"] == protocol.EngineState.FAILED else 503
            return error_response(status, f"model {name} is not ready: {state.get('reason', '')}")
        handler_request = HandlerRequest(
            body=request.get_data(cache=False),
            content_type=request.content_type,
            request_id=g.request_id,
            route=route,
            headers=dict(request.headers),
            client_gone=_hang_up_check(request.environ),
        )
        return _http_response(handler.handle(handler_request))

    @app.get("/metrics")
    @app.get("/server/metrics")  # DJL's path for its Prometheus text (GET only there too)
    def prometheus_metrics():
        state = client.state()
        body = metrics.render(_engine_stats(state), name)
        return Response(body, mimetype="text/plain; version=0.0.4")

    def _describe(detailed: bool) -> dict:
        state = client.state()
        description = {
            "modelName": name,
            "modelUrl": runtime.model_source,
            "status": model_status.listed_status(state["state"]),
        }
        if detailed:
            stats = _engine_stats(state)
            description["status"] = model_status.health_status(state["state"], stats is not None)
            description["config"] = runtime.config.to_dict()
            description["engine"] = {**state, "stats": stats}
        return description

    def _engine_stats(state: dict) -> dict | None:
        """The engine's stats, fresh or (while a long batch or step keeps it from answering)
        the newest this worker has, at most predict_timeout old: an engine silent for longer
        than a request may take counts as down."""
        if state["state"] != protocol.EngineState.READY:
            return None
        answer = client.stats(_STATS_TIMEOUT_S)
        if answer is None or answer[1] > runtime.config.predict_timeout:
            return None
        stats, age = answer
        return {**stats, "stats_age_seconds": round(age, 3)}

    return app


def _hang_up_check(environ: dict):
    """A check whether the client closed its connection: gunicorn hands over the socket, and a
    closed peer makes it readable with nothing to read."""
    client = environ.get("gunicorn.socket")
    if client is None:
        return lambda: False

    def gone() -> bool:
        try:
            readable, _, _ = select.select([client], [], [], 0)
            return bool(readable) and client.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):  # reset by the peer, or already closed
            return True

    return gone


def _http_response(answer: HandlerResponse) -> Response:
    if answer.stream is not None:
        response = Response(answer.stream, status=answer.status, mimetype=answer.content_type)
    elif answer.body is not None:
        response = Response(answer.body, status=answer.status, content_type=answer.content_type)
    else:
        response = jsonify(answer.json)
        response.status_code = answer.status
    response.headers.update(answer.headers)
    return response
