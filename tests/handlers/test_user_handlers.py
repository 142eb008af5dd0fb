"""DJL-style handlers in the engine process, without a server: finding the entry point,
`import djl_python` without DJL installed, the load-time call, batches split by position,
streams, and a handler that raises. The end-to-end versions over HTTP are in
tests/integration/test_custom_handlers.py."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from lmserve.handlers.custom import djl_compat
from lmserve.handlers.custom.djl_io import Input, Output
from lmserve.handlers.custom.user_code import (
    EntryPoint,
    UserCodeError,
    defines_handle,
    find_entry_point,
    load,
)
from lmserve.handlers.python_engine.custom_service import (
    HandlerError,
    RawRequest,
    UserHandlerService,
)

ECHO = """
from djl_python import Input, Output

loaded_with = {}

def handle(inputs: Input) -> Output:
    if inputs.is_empty():  # DJL's load-time call carries the model's properties
        loaded_with.update(inputs.get_properties())
        return None
    data = inputs.get_as_json()
    return Output().add_as_json({"echo": data, "header": inputs.get_property("X-Custom")})
"""

BATCH = """
from djl_python.inputs import Input
from djl_python.outputs import Output

def handle(inputs: Input):
    if inputs.is_empty():
        return None
    outputs = Output()
    for index, item in enumerate(inputs.get_batches()):
        outputs.add_as_json({"n": item.get_as_json()["n"] * 10, "of": inputs.get_batch_size()},
                            batch_index=index)
    return outputs
"""


def write_handler(folder, source, name="model.py"):
    (folder / name).write_text(textwrap.dedent(source))
    return folder


def service_for(folder, entry_point=None) -> UserHandlerService:
    entry = find_entry_point(entry_point, folder)
    assert entry is not None
    return UserHandlerService(load(entry, folder), entry.name)


@pytest.fixture(autouse=True)
def forget_user_modules():
    """Each test's model.py is a new module, not the previous test's from sys.modules."""
    yield
    for name in ("model", "my_handler", "helpers"):
        sys.modules.pop(name, None)


def request(payload, **headers) -> RawRequest:
    return RawRequest(json.dumps(payload).encode(), {"content-type": "application/json", **headers})


def test_model_py_in_the_model_dir_is_the_entry_point(tmp_path):
    assert find_entry_point(None, tmp_path) is None  # no model.py: the built-in LLM handler
    write_handler(tmp_path, ECHO)
    assert find_entry_point(None, tmp_path).path == tmp_path / "model.py"


def test_djl_builtin_handlers_mean_the_llm_handler(tmp_path):
    write_handler(tmp_path, ECHO)
    assert find_entry_point("djl_python.huggingface", tmp_path) is None
    assert find_entry_point("djl_python.lmi_vllm.vllm_async_service", tmp_path) is None
    with pytest.raises(UserCodeError, match="not a DJL handler lmserve provides"):
        find_entry_point("djl_python.stable_diffusion", tmp_path)


def test_entry_point_file_must_exist(tmp_path):
    with pytest.raises(UserCodeError, match="no such file"):
        find_entry_point("handler.py", tmp_path)


def test_echo_handler_gets_body_headers_and_load_time_properties(tmp_path):
    service = service_for(write_handler(tmp_path, ECHO))
    service.initialize({"model_dir": str(tmp_path), "tensor_parallel_degree": "1"})
    module = sys.modules["model"]
    assert module.loaded_with["model_dir"] == str(tmp_path)
    (answer,) = service.answer([request({"a": 1}, **{"x-custom": "yes"})])
    assert answer.status == 200
    assert json.loads(answer.body) == {"echo": {"a": 1}, "header": "yes"}
    assert answer.headers["content-type"] == "application/json"


def test_entry_point_by_file_name_and_helper_imports_next_to_it(tmp_path):
    (tmp_path / "helpers.py").write_text("def shout(text):\n    return text.upper() + '!'\n")
    source = """
    from djl_python import Output
    import helpers

    def handle(inputs):
        if inputs.is_empty():
            return None
        return Output().add(helpers.shout(inputs.get_as_string()))
    """
    service = service_for(write_handler(tmp_path, source, "my_handler.py"), "my_handler.py")
    (answer,) = service.answer([RawRequest(b"hi", {"content-type": "text/plain"})])
    assert (answer.body, answer.headers["content-type"]) == (b"HI!", "text/plain; charset=utf-8")


def test_batch_answers_match_requests_by_position(tmp_path):
    service = service_for(write_handler(tmp_path, BATCH))
    answers = service.answer([request({"n": 1}), request({"n": 2}), request({"n": 3})])
    assert [json.loads(a.body) for a in answers] == [
        {"n": 10, "of": 3},
        {"n": 20, "of": 3},
        {"n": 30, "of": 3},
    ]


def test_untagged_entries_answer_by_position_and_a_wrong_count_is_an_error(tmp_path):
    source = """
    from djl_python import Output

    def handle(inputs):
        outputs = Output()
        for item in inputs.get_batches()[: int(inputs.get_batches()[0].get_as_string())]:
            outputs.add(item.get_as_string() + "!")
        return outputs
    """
    service = service_for(write_handler(tmp_path, source))
    two = [RawRequest(b"2", {}), RawRequest(b"x", {})]
    assert [a.body for a in service.answer(two)] == [b"2!", b"x!"]
    short = [RawRequest(b"1", {}), RawRequest(b"y", {})]
    answers = service.answer(short)
    assert [a.status for a in answers] == [500, 500]
    assert "1 untagged entries for a batch of 2" in json.loads(answers[0].body)["message"]


def test_streamed_output_yields_pieces(tmp_path):
    source = """
    from djl_python import Output

    def handle(inputs):
        words = inputs.get_as_string().split()
        output = Output().add_property("content-type", "text/plain")
        output.add_stream_content(word + " " for word in words)
        return output
    """
    service = service_for(write_handler(tmp_path, source))
    (answer,) = service.answer([RawRequest(b"one two three", {})])
    assert answer.headers["content-type"] == "text/plain"
    assert list(answer.stream) == [b"one ", b"two ", b"three "]


def test_streamed_objects_are_json_lines(tmp_path):
    source = """
    from djl_python import Output

    def handle(inputs):
        return Output().add_stream_content({"n": n} for n in range(2))
    """
    (answer,) = service_for(write_handler(tmp_path, source)).answer([RawRequest(b"", {})])
    assert answer.headers["content-type"] == "application/jsonlines"
    assert b"".join(answer.stream) == b'{"n": 0}\n{"n": 1}\n'


def test_handler_error_output_keeps_its_status(tmp_path):
    source = """
    from djl_python import Output

    def handle(inputs):
        return Output().error("bad prompt", code=422)
    """
    (answer,) = service_for(write_handler(tmp_path, source)).answer([RawRequest(b"{}", {})])
    assert answer.status == 422
    assert json.loads(answer.body)["error"] == "bad prompt"


def test_handler_that_raises_is_a_handler_error(tmp_path):
    source = """
    def handle(inputs):
        if inputs.is_empty():
            return None
        raise ValueError("model exploded")
    """
    service = service_for(write_handler(tmp_path, source))
    service.initialize({})
    with pytest.raises(HandlerError, match="ValueError: model exploded"):
        service.answer([RawRequest(b"{}", {})])


def test_import_errors_name_the_entry_point(tmp_path):
    write_handler(tmp_path, "import package_that_is_not_installed\n")
    with pytest.raises(UserCodeError, match="model.py: No module named"):
        service_for(tmp_path)


def test_input_api_matches_djl():
    batch = Input.batch_of(
        [Input.from_request({"Content-Type": "text/plain"}, b"a"), Input.from_request({}, b"b")]
    )
    assert batch.is_batch() and batch.get_batch_size() == 2
    first, second = batch.get_batches()
    assert first.get_property("content-type") == "text/plain"  # header names ignore case
    assert first.content_type == "text/plain"
    assert first.get_data() == "a"
    assert (second.get_as_bytes(), second.contains_key("data")) == (b"b", True)
    single = Input.from_request({}, b"{}")
    assert (single.is_batch(), single.get_batches()) == (False, [single])


def test_output_api_matches_djl():
    output = Output().set_code(201).set_message("Created").add_property("X-A", "1")
    output.add({"k": [1, 2]}).add("text").add(b"\x00raw")
    assert (output.code, output.message, output.properties) == (201, "Created", {"X-A": "1"})
    assert output.content.get_values() == [b'{"k": [1, 2]}', b"text", b"\x00raw"]


def test_real_djl_python_is_left_alone(monkeypatch):
    real = type(sys)("djl_python")
    monkeypatch.setitem(sys.modules, "djl_python", real)
    djl_compat.install()
    assert sys.modules["djl_python"] is real


def test_a_model_py_is_a_handler_only_if_it_defines_handle(tmp_path):
    formatters_only = "from djl_python.output_formatter import output_formatter\n"
    write_handler(
        tmp_path, formatters_only + "@output_formatter\ndef shape(output):\n    return ''\n"
    )
    assert not defines_handle(find_entry_point(None, tmp_path))  # read, not run: no import
    write_handler(tmp_path, ECHO)
    assert defines_handle(find_entry_point(None, tmp_path))
    assert defines_handle(EntryPoint("x", module="package_that_is_not_there.handler"))
