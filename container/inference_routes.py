"""SageMaker's /ping and the inference routes: /invocations, DJL's /predictions/<model> and
OpenAI's chat and completions. A route checks the model name and the engine's readiness, then
hands the body to the handler (lmserve's LLM handler, or one forwarding to a user's handle())
and sends what it answers. Also what vLLM's clients probe: /health, /version, /tokenize and
/detokenize (the handler's tokenizer, ready or not)."""

from __future__ import annotations

import importlib.metadata
import select
import socket

from flask import Flask, Response, g, jsonify, request

from lmserve.handlers.interface import (
    TOKENIZER_ROUTES,
    Handler,
    HandlerRequest,
    HandlerResponse,
    Route,
)
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import Runtime

from . import model_status
from .engine_client import EngineClient
from .http_errors import error_response, unknown_model

# Flask's names for the routes whose answers the engine counts (container/app.py).
INFERENCE_ENDPOINTS = ("invocations", "predictions", "chat_completions", "completions")


class InferenceRoutes:
    def __init__(self, runtime: Runtime, client: EngineClient, handler: Handler):
        self.client = client
        self.handler = handler
        self.name = runtime.model_name

    def register(self, app: Flask) -> None:
        app.add_url_rule("/ping", "ping", self.ping, methods=["GET"])
        app.add_url_rule("/invocations", "invocations", self.invocations, methods=["POST"])
        app.add_url_rule("/predictions/<model>", "predictions", self.predictions, methods=["POST"])
        chat = lambda: self.predict(self.name, Route.CHAT_COMPLETIONS)  # noqa: E731
        app.add_url_rule("/v1/chat/completions", "chat_completions", chat, methods=["POST"])
        completions = lambda: self.predict(self.name, Route.COMPLETIONS)  # noqa: E731
        app.add_url_rule("/v1/completions", "completions", completions, methods=["POST"])
        app.add_url_rule("/health", "health", self.health, methods=["GET"])
        app.add_url_rule("/version", "version", self.version, methods=["GET"])
        for route in TOKENIZER_ROUTES:
            answer = lambda route=route: self._handled(route)  # noqa: E731
            app.add_url_rule(f"/{route}", route.value, answer, methods=["POST"])

    def ping(self):
        state = self.client.state()
        status = model_status.health_status(state["state"])
        if state["state"] == protocol.EngineState.READY:
            return jsonify({self.name: {"status": status}})
        code = 500 if state["state"] == protocol.EngineState.FAILED else 503
        return jsonify({self.name: {"status": status, "reason": state.get("reason")}}), code

    def health(self):
        """vLLM's: 200 with no body once the engine is ready; 503 while it loads, 500 once it
        failed (the reason in the body)."""
        state = self.client.state()
        if state["state"] == protocol.EngineState.READY:
            return Response(status=200)
        code = 500 if state["state"] == protocol.EngineState.FAILED else 503
        return error_response(code, f"model {self.name} is not ready: {state.get('reason', '')}")

    def version(self):
        return jsonify({"version": importlib.metadata.version("lmserve")})

    def invocations(self):
        requested = request.args.get("model_name") or request.headers.get("model_name")
        return self.predict(requested or self.name, Route.INVOCATIONS)

    def predictions(self, model: str):
        return self.predict(model, Route.INVOCATIONS)

    def predict(self, model: str, route: Route) -> Response:
        refusal = unknown_model(model, self.name)
        if refusal is not None:
            return refusal
        state = self.client.state()
        if state["state"] != protocol.EngineState.READY:
            status = 500 if state["state"] == protocol.EngineState.FAILED else 503
            reason = state.get("reason", "")
            return error_response(status, f"model {self.name} is not ready: {reason}")
        return self._handled(route)

    def _handled(self, route: Route) -> Response:
        handler_request = HandlerRequest(
            body=request.get_data(cache=False),
            content_type=request.content_type,
            request_id=g.request_id,
            route=route,
            headers=dict(request.headers),
            client_gone=_hang_up_check(request.environ),
        )
        return _http_response(self.handler.handle(handler_request))


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
