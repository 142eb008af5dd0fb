"""SageMaker's X-Amzn-SageMaker-Custom-Attributes, read as DJL reads it: `key=value;...` pairs a
handler gets as a dict (HandlerRequest) or as properties of its Input (a DJL model.py), while
the header itself passes through unchanged."""

from __future__ import annotations

import pytest

from lmserve.handlers.custom.djl_io import Input
from lmserve.handlers.djl.custom_attributes import parse_custom_attributes
from lmserve.handlers.interface import HandlerRequest

HEADER = "X-Amzn-SageMaker-Custom-Attributes"


@pytest.mark.parametrize(
    ("value", "attributes"),
    [
        ("trace_id=abc", {"trace_id": "abc"}),
        (" a = 1 ;b=2;", {"a": "1", "b": "2"}),  # trimmed, an empty piece skipped
        ("ids=1,2,3;x-synchronous=false", {"ids": "1,2,3", "x-synchronous": "false"}),
        ("token=a=b", {"token": "a=b"}),  # split at the first '='
        ("flag;k=v", {"k": "v"}),  # a piece without '=' is skipped
        ("k=", {"k": ""}),
        ("=v;Trace ID: 42", {}),  # no key, no '=': nothing parses, nothing fails
        ("", {}),
    ],
)
def test_pairs_parse_as_djl_parses_them(value, attributes):
    assert parse_custom_attributes(value) == attributes


def test_handler_request_offers_the_attributes_and_keeps_the_header():
    request = HandlerRequest(
        body=b"{}",
        content_type="application/json",
        request_id="r1",
        headers={HEADER.lower(): "trace_id=abc; tenant=t1"},
    )
    assert request.custom_attributes == {"trace_id": "abc", "tenant": "t1"}
    assert request.headers[HEADER.lower()] == "trace_id=abc; tenant=t1"
    assert HandlerRequest(b"", None, "r2").custom_attributes == {}


def test_a_djl_input_gets_each_attribute_as_a_property():
    inputs = Input.from_request({HEADER: "trace_id=abc;Tenant=t1", "X-Caller": "me"}, b"{}")
    assert inputs.get_property("trace_id") == "abc"
    assert inputs.get_property("tenant") == "t1"  # properties are read case-insensitively
    assert inputs.get_property("x-caller") == "me"
    assert inputs.get_property(HEADER) == "trace_id=abc;Tenant=t1"


def test_an_attribute_never_overrides_a_real_header():
    headers = {"content-type": "application/json", HEADER: "Content-Type=text/plain"}
    inputs = Input.from_request(headers, b'{"a": 1}')
    assert inputs.get_property("content-type") == "application/json"
    assert inputs.get_data() == {"a": 1}


def test_attributes_survive_batching():
    first = Input.from_request({HEADER: "trace_id=one"}, b"1")
    second = Input.from_request({HEADER: "trace_id=two"}, b"2")
    batch = Input.batch_of([first, second]).get_batches()
    assert [item.get_property("trace_id") for item in batch] == ["one", "two"]
