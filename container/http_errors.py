"""The front end's own error answers (the project's JSON error body), shared by its routes."""

from __future__ import annotations

from flask import Response, jsonify

from lmserve.handlers.interface import HandlerResponse


def error_response(status: int, message: str, **extra) -> Response:
    response = jsonify(HandlerResponse.error(status, message, **extra).json)
    response.status_code = status
    return response


def unknown_model(model: str, served: str) -> Response | None:
    """The 404 for a route naming a model this server does not serve; None when it does."""
    if model == served:
        return None
    return error_response(404, f"model {model!r} not found; this server serves {served!r}")
