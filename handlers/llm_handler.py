"""The built-in LLM handler: a request body in, the DJL/TGI/OpenAI-shaped answer out.

A table from route and body to a plan: which parser makes the body a GenerationJob (job.py)
and which Responder shapes its answer. Text payloads (`{"inputs": ..., "parameters": ...}` or
text/plain) get DJL's shape, TGI's with option.tgi_compat; bodies with `messages` (and
everything on /v1/chat/completions) are OpenAI chat; bodies with `prompt` (and everything on
/v1/completions) OpenAI completions. A model.py's input and output formatters
(handlers/custom/formatters.py), if it has them, reshape text requests on the way in and their
answers on the way out. Generation itself, and the promise that every accepted request ends in
exactly one answer, is the Predictor's (handlers/predictor.py).
"""

from __future__ import annotations

import dataclasses
import json

import msgspec

from lmserve.rolling_batch.ipc.runtime import Runtime

from .agents.assistant_message import MessageFormat
from .agents.tool_calls import tool_call_format
from .custom.djl_io import Input
from .custom.formatters import FormattedGeneration, load_formatters
from .djl.answers import DjlResponder
from .djl.request_parsing import BadRequest, load_payload, parse_payload, streamed
from .interface import (
    OPENAI_ROUTES,
    TOKENIZER_ROUTES,
    ClientGone,
    EngineConnection,
    HandlerRequest,
    HandlerResponse,
    PredictionError,
    Route,
)
from .job import Dialect, GenerationJob
from .openai.chat import ChatResponder, parse_chat
from .openai.completions import CompletionResponder, parse_completion
from .openai.tokenize_api import detokenize, tokenize
from .predictor import Predictor
from .responder import Responder

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
        # How each dialect's body becomes a job, and who shapes its answer.
        self._plans = {
            Dialect.DJL: self._djl,
            Dialect.CHAT: self._chat,
            Dialect.COMPLETION: self._completion,
        }

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
        if request.route in TOKENIZER_ROUTES:
            return HandlerResponse(json=self._tokenizer_answer(request))
        payload = self._payload(request)
        plan = self._plans[dialect_of(request.route, payload)]
        job, responder = plan(payload, request)
        answer = self.predictor.run(job, request.request_id, responder, request.client_gone)
        if job.stream:
            return HandlerResponse(stream=answer, content_type=responder.content_type)
        if isinstance(answer, str):  # a model.py's output formatter's strings
            return HandlerResponse(body=answer.encode(), content_type=_content_type_of(answer))
        return HandlerResponse(json=answer)

    def _chat(self, payload: dict, request: HandlerRequest) -> tuple[GenerationJob, Responder]:
        job = parse_chat(payload, self._lora_base_model)
        config = self.config
        if job.tool_choice.mode == "auto" and not config.enable_auto_tool_choice:
            raise BadRequest(
                "tool_choice",
                '"auto" (the default with `tools`) needs the server\'s'
                " option.enable_auto_tool_choice=true and option.tool_call_parser; or send"
                ' "none", "required" or a named function',
            )
        message_format = MessageFormat(
            tool_call_format(job.tool_choice, config.tool_call_parser),
            self.predictor.reasoning,  # the predictor's: it wraps grammars behind thinking
        )
        responder = ChatResponder(
            self.predictor.tokenizer, self._model_named(job), job, message_format
        )
        return job, responder

    def _completion(
        self, payload: dict, request: HandlerRequest
    ) -> tuple[GenerationJob, Responder]:
        job = parse_completion(payload, self._lora_base_model)
        return job, CompletionResponder(self.predictor.tokenizer, self._model_named(job), job)

    def _djl(self, payload: dict, request: HandlerRequest) -> tuple[GenerationJob, Responder]:
        job = parse_payload(payload, tgi_compat=self.config.tgi_compat)
        # A format the request names wins over the server's, a model.py's formatter included,
        # as in DJL (a request's `output_formatter` parameter is read before the option).
        if self.formatters.output is not None and job.output_formatter is None:
            return self._formatted(job, request)
        kind = self._stream_kind(job, request.accept)
        if kind == "json":
            job = dataclasses.replace(_log_probs_as_shown(job), stream=False)
        else:
            job = streamed(job)
        responder = DjlResponder(
            kind,
            self.config.tgi_compat,
            self.predictor.tokenizer,
            job.details,
            job.return_full_text,
            job.batched,
            job.n,
        )
        return job, responder

    def _tokenizer_answer(self, request: HandlerRequest) -> dict:
        payload = load_payload(request.body, request.content_type)
        predictor = self.predictor
        if request.route == Route.DETOKENIZE:
            return detokenize(payload, predictor.tokenizer)
        return tokenize(
            payload, predictor.tokenizer, predictor.chat_template, predictor.max_model_len
        )

    def _model_named(self, job: GenerationJob) -> str:
        """The model an OpenAI answer names: the request's, else the served one."""
        return job.model or self.predictor.runtime.model_name

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

    def _formatted(
        self, job: GenerationJob, request: HandlerRequest
    ) -> tuple[GenerationJob, Responder]:
        """A text request answered through the model.py's output formatter: one input, one
        sequence, streamed or its strings joined."""
        if job.stream:
            job = streamed(job)
        elif job.batched:
            raise BadRequest("inputs", "a custom output formatter answers one input per request")
        elif job.best_of > 1:
            name = "best_of" if job.best_of > job.n else "n"
            raise BadRequest(f"parameters.{name}", "a custom output formatter answers one sequence")
        shaped = FormattedGeneration(
            self.formatters.output,
            job.prompts[0],
            _djl_parameters(job),
            request.request_id,
            self.config.tgi_compat,
            self.predictor.tokenizer,
            job.stop_sequences,
        )
        return job, shaped

    def _stream_kind(self, parsed: GenerationJob, accept: str) -> str:
        """jsonlines or sse when the request's `output_formatter`, option.output_formatter or
        the request's `stream` asks for a stream, json for one JSON answer. A format the
        request names decides alone (DJL: a named formatter wins over `stream`); a stream
        nothing names is SSE under tgi_compat (TGI streams SSE) or when the client accepts
        text/event-stream, jsonlines otherwise."""
        if parsed.output_formatter is not None:
            return parsed.output_formatter
        if self.config.output_formatter in ("jsonlines", "sse"):
            return self.config.output_formatter
        if not parsed.stream:
            return "json"
        return "sse" if self.config.tgi_compat or _SSE in accept else "jsonlines"


def dialect_of(route: Route, payload: dict) -> Dialect:
    """The OpenAI routes take their own dialect. /invocations (and /predictions) read the
    body, as LMI's vLLM-based handler does: `messages` is chat, `prompt` (without `inputs`)
    OpenAI completions, anything else DJL/TGI's `inputs`."""
    if route is Route.COMPLETIONS:
        return Dialect.COMPLETION
    if route is Route.CHAT_COMPLETIONS or "messages" in payload:
        return Dialect.CHAT
    if "prompt" in payload and "inputs" not in payload:
        return Dialect.COMPLETION
    return Dialect.DJL


def _log_probs_as_shown(parsed: GenerationJob) -> GenerationJob:
    """One JSON answer shows its tokens' log-probs only in `details` (where best_of's ranking
    reads them too): without, the engine need not compute them (GenerationParams.log_probs).
    Streams and formatters show them in every token."""
    if parsed.details or parsed.best_of > 1:
        return parsed
    params = msgspec.structs.replace(parsed.params, log_probs=False)
    return dataclasses.replace(parsed, params=params)


def _djl_parameters(parsed: GenerationJob) -> dict:
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
