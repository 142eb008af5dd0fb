"""A DJL-style handler in the shape of the djl-demo examples, unchanged from what DJL runs:
a JSON echo that reports its properties, a batch, a stream, and a failure, chosen by payload.
docs/custom-handlers.md shows this file."""

import logging

import lmserve_test_greeting  # from requirements.txt: a package in ./greeting
from djl_python import Input, Output

greeting = None


def handle(inputs: Input) -> Output | None:
    global greeting
    if inputs.is_empty():
        # DJL's load-time call: the properties are the model's options.
        greeting = inputs.get_properties().get("greeting", "hello")
        logging.info("handler loaded with greeting=%s", greeting)
        return None
    batch = inputs.get_batches()
    first = batch[0].get_as_json()
    if first.get("stream"):
        output = Output().add_property("content-type", "application/jsonlines")
        words = first["text"].split()
        output.add_stream_content({"word": word, "index": i} for i, word in enumerate(words))
        return output
    outputs = Output()
    for index, item in enumerate(batch):
        request = item.get_as_json()
        if request.get("fail"):
            raise ValueError("the handler was asked to fail")
        outputs.add_as_json(
            {
                "echo": request,
                "greeting": lmserve_test_greeting.greet(greeting),
                "header": item.get_property("X-Caller"),
                # From X-Amzn-SageMaker-Custom-Attributes: trace_id=...; each is a property.
                "trace_id": item.get_property("trace_id"),
                "batch_size": len(batch),
            },
            batch_index=index,
        )
    return outputs
