"""DJL/TGI request bodies -> a validated GenerationJob (job.py). Bad input raises BadRequest
naming the field; nothing invalid reaches the engine.

Unknown parameters are dropped with a warning (DJL's behaviour: clients send vendor-specific
knobs); wrong types and impossible values of known ones are refused. TGI's spellings are read
too: `stop` beside `stop_sequences`, and `truncate`.

Several sequences per input (`n`, `best_of`, as LMI reads them): `best_of` sequences (default
`n`) are sampled and the `n` most likely by cumulative log-prob are kept; the answer is the
most likely, its details list the others as `best_of_sequences`. Log-probs on request:
`top_n_tokens` alternatives of each generated token and `decoder_input_details` (the prompt's
tokens with their log-probs) come in `details`, which they turn on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import msgspec

from lmserve.rolling_batch.ipc.protocol import MAX_TOP_LOGPROBS, GenerationParams

from ..agents.structured_output import tgi_grammar
from ..job import MAX_SEQUENCES, BadRequest, Dialect, FieldReader, GenerationJob

# The formats a request may name in `parameters.output_formatter` (a model.py's function is
# chosen by the server's configuration, never by a client).
OUTPUT_FORMATS = ("json", "jsonlines", "sse")

log = logging.getLogger(__name__)


def parse_body(body: bytes, content_type: str | None) -> GenerationJob:
    return parse_payload(load_payload(body, content_type))


def streamed(job: GenerationJob) -> GenerationJob:
    """The DJL job as a stream: one input and one sequence (as in LMI, the best of several is
    known only at the end), without the prompt's log-probs."""
    if job.batched:
        raise BadRequest("inputs", "streaming takes one input, not a list")
    if job.best_of > 1:
        name = "best_of" if job.best_of > job.n else "n"
        raise BadRequest(f"parameters.{name}", "several sequences are not streamed")
    if job.params.prompt_logprobs:
        raise BadRequest("parameters.decoder_input_details", "not with streaming")
    return dataclasses.replace(job, stream=True)


def load_payload(body: bytes, content_type: str | None) -> dict[str, Any]:
    """The request's JSON object; a text/plain body becomes `{"inputs": body}`."""
    media_type = (content_type or "").split(";")[0].strip().lower()
    text = _decode(body)
    if media_type == "text/plain":
        if not text.strip():
            raise BadRequest("inputs", "the text/plain body is empty")
        return {"inputs": text}
    # Anything else is read as JSON: `curl -d` without -H sends form-urlencoded JSON.
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as error:
        raise BadRequest("body", f"malformed JSON: {error}") from None
    if not isinstance(payload, dict):
        raise BadRequest("body", "expected a JSON object with an `inputs` field")
    return payload


def parse_payload(payload: dict[str, Any], tgi_compat: bool = False) -> GenerationJob:
    """A DJL/TGI body's job. `tgi_compat` (option.tgi_compat) turns `details` on unless the
    request says otherwise, as DJL does (`parameters.get("details", tgi_compat)`)."""
    if "inputs" not in payload:
        raise BadRequest("inputs", "missing (a string or a list of strings)")
    inputs = payload["inputs"]
    batched = isinstance(inputs, list)
    items = inputs if batched else [inputs]
    if not items or not all(isinstance(item, str) for item in items):
        raise BadRequest("inputs", "expected a string or a non-empty list of strings")
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream", "expected true or false")
    parameters = payload.get("parameters", {})
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise BadRequest("parameters", "expected a JSON object")
    parsed = _parse_parameters(parameters, tgi_compat)
    adapters = _adapters(payload.get("adapters"), len(items), batched)
    if isinstance(adapters, tuple):
        parsed["adapters"] = adapters
    elif adapters is not None:
        parsed["params"] = msgspec.structs.replace(parsed["params"], adapter=adapters)
    # DJL moves a top-level `stream` into the parameters (over one already there) and streams
    # on `parameters.stream`: both places are honoured, the top level winning.
    if stream is not None:
        parsed["stream"] = stream
    return GenerationJob(Dialect.DJL, items, batched, **parsed)


def _adapters(value: Any, num_inputs: int, batched: bool) -> str | tuple | None:
    """LMI's `adapters`: one name for every input, or (with a list of inputs) a list of names,
    one per input. An empty name or null means the base model."""
    if value is None or isinstance(value, str):
        return value or None
    if batched and isinstance(value, list) and all(v is None or isinstance(v, str) for v in value):
        if len(value) != num_inputs:
            raise BadRequest(
                "adapters", f"{len(value)} adapters for {num_inputs} inputs: expected one each"
            )
        return tuple(v or None for v in value)
    expected = "a string, or a list of strings as long as `inputs`" if batched else "a string"
    raise BadRequest("adapters", f"expected {expected}, got {value!r}")


def _parse_parameters(raw: dict[str, Any], tgi_compat: bool) -> dict[str, Any]:
    reader = FieldReader(raw)
    do_sample = reader.boolean("do_sample", False)
    temperature = reader.number("temperature", 1.0, minimum=0.0)
    if do_sample and temperature == 0.0:
        do_sample = False  # vLLM/OpenAI meaning of temperature 0: greedy
    params = GenerationParams(
        max_new_tokens=reader.integer("max_new_tokens", 30, minimum=1),
        do_sample=do_sample,
        temperature=temperature if temperature > 0 else 1.0,
        top_k=reader.integer("top_k", 0, minimum=0),
        top_p=reader.number("top_p", 1.0, minimum=0.0, exclusive_minimum=True, maximum=1.0),
        repetition_penalty=reader.number(
            "repetition_penalty", 1.0, minimum=0.0, exclusive_minimum=True
        ),
        seed=reader.integer("seed", None, minimum=0),
        ignore_eos=reader.boolean("ignore_eos_token", False),
        top_logprobs=reader.integer("top_n_tokens", 0, minimum=0, maximum=MAX_TOP_LOGPROBS),
        prompt_logprobs=reader.boolean("decoder_input_details", False),
        cache_salt=reader.text("cache_salt"),
        grammar=tgi_grammar(reader._get("grammar")),
    )
    n, best_of = _sequences(reader, do_sample)
    stop_sequences = reader.stop_sequences() + reader.stop_sequences("stop")  # TGI's name
    parsed = {
        "params": params,
        "stop_sequences": tuple(dict.fromkeys(stop_sequences)),  # each once, in order
        # Asked-for log-probs and other sequences are answered in `details`.
        "details": reader.boolean("details", tgi_compat)
        or best_of > 1
        or params.top_logprobs > 0
        or params.prompt_logprobs,
        "return_full_text": reader.boolean("return_full_text", False),
        "stream": reader.boolean("stream", False),
        "truncate": reader.integer("truncate", None, minimum=1),
        "output_formatter": reader.choice("output_formatter", OUTPUT_FORMATS),
        "n": n,
        "best_of": best_of,
    }
    for name in sorted(set(raw) - reader.known):
        log.warning("ignoring unknown parameter %r", name)
    return parsed


def _sequences(reader: FieldReader, do_sample: bool) -> tuple[int, int]:
    """(`n`, `best_of`): best_of defaults to n and may not be below it."""
    n = reader.integer("n", 1, minimum=1, maximum=MAX_SEQUENCES)
    best_of = reader.integer("best_of", n, minimum=1, maximum=MAX_SEQUENCES)
    if best_of < n:
        raise BadRequest(f"{reader.prefix}best_of", f"must be >= n ({n}), got {best_of}")
    if best_of > 1 and not do_sample:
        name = "best_of" if best_of > n else "n"
        raise BadRequest(
            f"{reader.prefix}{name}",
            "several sequences need sampling (do_sample: true): greedy decoding repeats one",
        )
    return n, best_of


def _decode(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadRequest("body", f"not valid UTF-8: {error}") from None
