"""A test set translated once per model (`nmt run`, `nmt distill`): kept while the model is the same, done
again for a model changed since or a record that cannot be read, the translator built only then."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest

from nmt.translate import build_translator
from nmt.translate.testset import translate_test_file

from .conftest import sentences


class Counting:
    """A line translator that records each call's line count and target tag."""

    def __init__(self, translator):
        self.translator = translator
        self.calls = []

    @property
    def subword(self):
        return self.translator.subword

    def translate(self, lines, target=None):
        self.calls.append((len(lines), target))
        return self.translator.translate(lines)  # a model of one target: the tag is only recorded


@pytest.fixture
def files(tmp_path, checkpoint, one_torch_thread):
    model = tmp_path / "model.pt"
    shutil.copy(checkpoint, model)
    src = tmp_path / "test.xx"
    lines = sentences(12, seed=3)
    lines[1] = ""  # an empty line: translated in the batch, not timed alone
    src.write_text("".join(line + "\n" for line in lines))
    return model, src, tmp_path / "out" / "test.yy", lines


def builder(model, built: list):
    def build():
        b = build_translator(model, dtype="fp32")
        b = dataclasses.replace(b, translator=Counting(b.translator))
        built.append(b)
        return b

    return build


def test_a_test_set_is_translated_once_per_model_and_the_translator_built_only_then(files):
    model, src, out, lines = files
    built = []
    info = translate_test_file(src, out, model, builder(model, built), target=">>yy<<", latency_lines=4)
    assert len(built) == 1
    want = build_translator(model, dtype="fp32").translator.translate(lines)
    assert out.read_text() == "".join(h + "\n" for h in want)
    record = json.loads(out.with_name("test.yy.json").read_text())
    assert (
        record == info
        and info["model_mtime"] == model.stat().st_mtime
        and info["precision"] == built[0].precision
    )
    speed = info["speed"]
    assert speed["sentences"] == len(lines) and speed["sentences_per_s"] > 0 and speed["latency_ms"] > 0
    assert speed["target_tokens_per_s"] > 0
    # the batch, then the first 4 non-empty lines one at a time, each with the target tag
    assert built[0].translator.calls == [(len(lines), ">>yy<<")] + [(1, ">>yy<<")] * 4

    def refused():
        raise AssertionError("built a translator for a test set translated by this model")

    written = out.stat().st_mtime_ns
    assert translate_test_file(src, out, model, refused, latency_lines=4) == info
    assert out.stat().st_mtime_ns == written

    # A model changed since (trained further) is another model: translated again, its mtime recorded
    os.utime(model, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns + 10**9))
    again = translate_test_file(src, out, model, builder(model, built))
    assert len(built) == 2 and again["model_mtime"] == model.stat().st_mtime != info["model_mtime"]
    assert "latency_ms" not in again["speed"]  # asked for only where it is measured


@pytest.mark.parametrize("record", [None, "{not json", "[1, 2]"])
def test_a_translation_without_a_readable_record_is_done_again(files, record):
    model, src, out, lines = files
    out.parent.mkdir()
    out.write_text("left by a kill\n")
    if record is not None:
        out.with_name("test.yy.json").write_text(record)
    built = []
    info = translate_test_file(src, out, model, builder(model, built))
    assert len(built) == 1 and info["model_mtime"] == model.stat().st_mtime
    assert len(out.read_text().splitlines()) == len(lines)
