"""The built-in LLM handler: a request body in, the DJL/TGI/OpenAI-shaped answer out.

Text payloads (`{"inputs": ..., "parameters": ...}` or text/plain) get DJL's shape, TGI's with
option.tgi_compat; bodies with `messages` (and everything on /v1/chat/completions) are OpenAI
chat. A model.py's input and output formatters (handlers/formatters.py), if it has them,
reshape text requests on the way in and their answers on the way out. Generation itself, and the
promise that every accepted request ends in exactly one answer, is the Predictor's
(handlers/predictor.py).
"""

from __future__ import annotations

import dataclasses
import json

import msgspec

from lmserve.rolling_batch.runtime import Runtime

from .chat import is_chat, parse_chat
from .djl_io import Input
from .engine_events import ClientGone, PredictionError
from .formatters import FormattedGeneration, load_formatters
from .interface import OPENAI_ROUTES, EngineConnection, HandlerRequest, HandlerResponse, Route
from .openai_completions import CompletionResponder, parse_completion
from .predictor import Predictor
from .request_parsing import BadRequest, TextRequest, load_payload, parse_payload
from .stream_format import StreamFormat

_SSE = "text/event-stream"


class LLMHandler:
    def __init__(self, runtime: Runtime, engine: EngineConnection):
        self.config = runtime.config
        self.predictor = Predictor(runtime, engine)
        # With LoRA on, an OpenAI `model` other than this names an adapter.
        self._lora_base_model = runtime.model_name if self.config.enable_lora else None
        self.formatters = load_formatters(
            runtime.formatters, runtime.user_dir, self.config.output_formatter
        )

    def handle(self, request: HandlerRequest) -> HandlerResponse:
        answer = self._handle(request)
        if request.route in OPENAI_ROUTES and answer.status >= 400 and answer.json:
            return _openai_error(answer)
        return answer

    def _handle(self, request: HandlerRequest) -> HandlerResponse:
        try:
            return self._answer(request)
        except BadRequest as error:
            return HandlerResponse.error(error.status, str(error), field=error.field)
        except PredictionError as error:
            return error.response()
        except ClientGone:  # nobody reads this; the engine has dropped the request
            return HandlerResponse.error(499, "the client closed the connection")

    def _answer(self, request: HandlerRequest) -> HandlerResponse:
        payload = self._payload(request)
        if request.route is Route.COMPLETIONS:
            return self._completions(payload, request)
        if request.route is Route.CHAT_COMPLETIONS or is_chat(payload):
            chat = parse_chat(payload, self._lora_base_model)
            answer = self.predictor.chat(chat, request.request_id, request.client_gone)
            if chat.stream:
                return HandlerResponse(stream=answer, content_type=_SSE)
            return HandlerResponse(json=answer)
        parsed = parse_payload(payload, tgi_compat=self.config.tgi_compat)
        # A format the request names wins over the server's, a model.py's formatter included,
        # as in DJL (a request's `output_formatter` parameter is read before the option).
        if self.formatters.output is not None and parsed.output_formatter is None:
            return self._formatted(parsed, request)
        stream_kind = self._stream_kind(parsed, request.accept)
        if stream_kind is None:
            parsed = _log_probs_as_shown(parsed)
            answer = self.predictor.predict(parsed, request.request_id, request.client_gone)
            return HandlerResponse(json=answer)
        fmt = StreamFormat(
            stream_kind,
            self.config.tgi_compat,
            self.predictor.tokenizer,
            parsed.details,
            parsed.return_full_text,
        )
        stream = self.predictor.stream(parsed, request.request_id, fmt)
        return HandlerResponse(stream=stream, content_type=fmt.content_type)

    def _completions(self, payload: dict, request: HandlerRequest) -> HandlerResponse:
        parsed = parse_completion(payload, self._lora_base_model)
        sampling = parsed.sampling
        model = sampling.model or self.predictor.runtime.model_name
        responder = CompletionResponder(self.predictor.tokenizer, model, parsed)
        if sampling.stream:
            prompt = parsed.prompts[0]
            prompt_ids = self.predictor.prompt_ids(
                prompt, sampling.params.max_new_tokens, "prompt", "max_tokens"
            )
            stream = self.predictor.stream_prompt(
                prompt,
                prompt_ids,
                sampling.params,
                sampling.stop,
                request.request_id,
                responder,
                sampling.n,
            )
            return HandlerResponse(stream=stream, content_type=responder.content_type)
        answers = self.predictor.complete_prompts(
            parsed.prompts,
            sampling.params,
            sampling.stop,
            request.request_id,
            request.client_gone,
            sampling.n,
        )
        return HandlerResponse(json=responder.completion(answers))

    def _payload(self, request: HandlerRequest) -> dict:
        """The request's JSON payload, through the model.py's input formatter if it has one."""
        if self.formatters.input is None:
            return load_payload(request.body, request.content_type)
        headers = dict(request.headers)
        if request.content_type:
            headers["content-type"] = request.content_type
        try:
            formatted = self.formatters.input(Input.from_request(headers, request.body))
        except Exception as error:  # noqa: BLE001 - the user's code: its failure, named
            raise BadRequest("body", f"the input formatter failed: {error!r}") from None
        if isinstance(formatted, dict):
            return formatted
        if hasattr(formatted, "input_text"):  # DJL's TextInput
            return {"inputs": formatted.input_text, "parameters": formatted.parameters or {}}
        kind = type(formatted).__name__
        raise BadRequest("body", f"the input formatter returned a {kind}, not a dict or TextInput")

    def _formatted(self, parsed, request: HandlerRequest) -> HandlerResponse:
        """A text request answered through the model.py's output formatter."""
        formatter = self.formatters.output
        request_id = request.request_id
        shaped = FormattedGeneration(
            formatter,
            parsed.inputs[0],
            _djl_parameters(parsed),
            request_id,
            self.config.tgi_compat,
            self.predictor.tokenizer,
        )
        if parsed.stream:
            stream = self.predictor.stream(parsed, request_id, shaped)
            return HandlerResponse(stream=stream, content_type=shaped.content_type)
        body = self.predictor.predict_shaped(parsed, request_id, shaped, request.client_gone)
        return HandlerResponse(body=body.encode(), content_type=_content_type_of(body))

    def _stream_kind(self, parsed: TextRequest, accept: str) -> str | None:
        """jsonlines or sse when the request's `output_formatter`, option.output_formatter or
        the request's `stream` asks for a stream, None for one JSON answer. A format the
        request names decides alone (DJL: a named formatter wins over `stream`); a stream
        nothing names is SSE under tgi_compat (TGI streams SSE) or when the client accepts
        text/event-stream, jsonlines otherwise."""
        if parsed.output_formatter is not None:
            return None if parsed.output_formatter == "json" else parsed.output_formatter
        if self.config.output_formatter in ("jsonlines", "sse"):
            return self.config.output_formatter
        if not parsed.stream:
            return None
        return "sse" if self.config.tgi_compat or _SSE in accept else "jsonlines"


def _log_probs_as_shown(parsed: TextRequest) -> TextRequest:
    """One JSON answer shows its tokens' log-probs only in `details` (where best_of's ranking
    reads them too): without, the engine need not compute them (GenerationParams.log_probs).
    Streams and formatters show them in every token."""
    if parsed.details or parsed.best_of > 1:
        return parsed
    params = msgspec.structs.replace(parsed.params, log_probs=False)
    return dataclasses.replace(parsed, params=params)


def _djl_parameters(parsed: TextRequest) -> dict:
    """The request's parameters under the names DJL's formatters read."""
    params = parsed.params
    return {
        **msgspec.structs.asdict(params),
        "stop_sequences": list(parsed.stop_sequences),
        "details": parsed.details,
        "return_full_text": parsed.return_full_text,
        "ignore_eos_token": params.ignore_eos,
        "top_n_tokens": params.top_logprobs,
        "decoder_input_details": params.prompt_logprobs,
        "n": parsed.n,
        "best_of": parsed.best_of,
    }


def _content_type_of(body: str) -> str:
    try:
        json.loads(body)
    except ValueError:
        return "text/plain; charset=utf-8"
    return "application/json"


def _openai_error(answer: HandlerResponse) -> HandlerResponse:
    """The project's error body in OpenAI's shape, which OpenAI clients parse."""
    body = answer.json
    kind = "invalid_request_error" if answer.status < 500 else "server_error"
    error = {
        "message": body.get("error") or body.get("message"),
        "type": kind,
        "param": body.get("field"),
        "code": answer.status,
    }
    return HandlerResponse(status=answer.status, json={"error": error})
