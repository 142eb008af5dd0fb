"""The context length the front end checks prompts against and the engine sizes itself by."""

import json

from lmserve.rolling_batch.model.context_length import context_length, context_length_of


def test_option_wins_over_the_model_config():
    assert context_length({"max_position_embeddings": 8192}, 1024) == 1024


def test_each_family_key_is_read():
    assert context_length({"max_position_embeddings": 8192}, None) == 8192
    assert context_length({"n_positions": 1024}, None) == 1024  # GPT-2
    assert context_length({"seq_length": 4096}, None) == 4096  # ChatGLM, Qwen1


def test_a_model_that_does_not_say_gets_hf_default():
    assert context_length({"hidden_size": 64}, None) == 2048


def test_read_from_the_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert context_length_of(tmp_path, None) == 512
    assert context_length_of(tmp_path, 100) == 100
