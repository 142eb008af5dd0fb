"""Publishing a GGUF conversion: one rename into place; a second converter that finishes later
keeps the first one's result instead of failing."""

from __future__ import annotations

import pytest

from lmserve.rolling_batch.model.weights.gguf_convert import publish


def finished_conversion(folder, marker: str):
    folder.mkdir()
    (folder / "config.json").write_text(marker)
    return folder


def test_a_conversion_moves_into_place(tmp_path):
    partial = finished_conversion(tmp_path / "abc.partial-1", "first")
    publish(partial, tmp_path / "abc")
    assert (tmp_path / "abc" / "config.json").read_text() == "first"
    assert not partial.exists()


def test_a_later_conversion_of_the_same_file_keeps_the_first(tmp_path):
    publish(finished_conversion(tmp_path / "abc.partial-1", "first"), tmp_path / "abc")
    late = finished_conversion(tmp_path / "abc.partial-2", "second")
    publish(late, tmp_path / "abc")
    assert (tmp_path / "abc" / "config.json").read_text() == "first"
    assert not late.exists()


def test_a_destination_that_is_not_a_conversion_is_an_error(tmp_path):
    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "stray.txt").write_text("not ours")
    with pytest.raises(OSError):
        publish(finished_conversion(tmp_path / "abc.partial-1", "first"), tmp_path / "abc")
