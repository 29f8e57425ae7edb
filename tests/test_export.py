"""`nmt export --format ctranslate2` and the CTranslate2 engine: same translations as the torch engine."""

from __future__ import annotations

import dataclasses
import json
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nmt.checkpoint import load_model
from nmt.cli import app
from nmt.translate import Translator, ctranslate2_translator

# numerics: trains or compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = pytest.mark.numerics

needs_ct2 = pytest.mark.skipif(
    find_spec("ctranslate2") is None, reason="ctranslate2 is not installed: pip install 'nmt[ctranslate2]'"
)
runner = CliRunner()


@pytest.fixture(scope="module")
def exported(synthetic_run: Path, tmp_path_factory) -> Path:
    """The reversal model of the shared fixture, exported through the command line."""
    if find_spec("ctranslate2") is None:
        pytest.skip("ctranslate2 is not installed: pip install 'nmt[ctranslate2]'")
    out = tmp_path_factory.mktemp("export") / "ct2"
    model = synthetic_run / "checkpoints" / "best.pt"
    result = runner.invoke(app, ["export", "-m", str(model), "--format", "ctranslate2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def torch_model(synthetic_run: Path):
    return load_model(synthetic_run / "checkpoints" / "best.pt")


@pytest.fixture(scope="module")
def valid_lines(synthetic_run: Path) -> list[str]:
    return (synthetic_run / "data" / "valid.xx").read_text().splitlines()


def both_engines(torch_model, exported: Path, lines: list[str], **decode) -> tuple[list, list]:
    """n-best lists of `lines` from the torch engine and from CTranslate2, with the same settings."""
    from nmt.translate import ctranslate2_translator

    model, subword, cfg = torch_model
    d = dataclasses.replace(cfg.decode, **decode)
    ours = Translator(model, subword, d, torch.device("cpu")).translate_nbest(lines)
    theirs = ctranslate2_translator(exported, d, threads=1).translate_nbest(lines)
    return ours, theirs


@needs_ct2
def test_export_writes_a_self_describing_folder(exported: Path, synthetic_run: Path):
    names = {p.name for p in exported.iterdir()}
    assert {"model.bin", "config.json", "shared_vocabulary.json", "spm.model", "nmt.json"} <= names
    assert (exported / "spm.model").read_bytes() == (synthetic_run / "data" / "spm.model").read_bytes()
    vocab = json.loads((exported / "shared_vocabulary.json").read_text())
    assert vocab[:4] == ["<pad>", "<unk>", "<s>", "</s>"]
    config = json.loads((exported / "config.json").read_text())
    assert config["decoder_start_token"] == "<s>" and config["add_source_eos"] is True
    meta = json.loads((exported / "nmt.json").read_text())
    assert meta["decode"]["beam"] == 4 and meta["decode"]["lenpen"] == 0.6


@needs_ct2
def test_greedy_is_identical_on_every_line(torch_model, exported: Path, valid_lines: list[str]):
    ours, theirs = both_engines(torch_model, exported, valid_lines, beam=1, nbest=1)
    assert [h[0][0] for h in theirs] == [h[0][0] for h in ours]
    learned = sum(h[0][0] == " ".join(reversed(s.split())) for h, s in zip(ours, valid_lines, strict=True))
    assert learned > 0.9 * len(valid_lines)  # a model that translates, so agreement means something


@needs_ct2
def test_beam_search_agrees_on_99_percent_of_lines(torch_model, exported: Path, valid_lines: list[str]):
    ours, theirs = both_engines(torch_model, exported, valid_lines, beam=4, lenpen=0.6, nbest=1)
    same = sum(a[0][0] == b[0][0] for a, b in zip(ours, theirs, strict=True))
    assert same >= 0.99 * len(valid_lines), f"{same}/{len(valid_lines)} identical"


@needs_ct2
@pytest.mark.parametrize("beam", [1, 4])
def test_min_len_ngram_blocking_and_prefixes_agree(torch_model, exported: Path, valid_lines, beam):
    """The decoding options map to CTranslate2's own (min_decoding_length, no_repeat_ngram_size,
    target_prefix) and both engines honour them. Greedy, the translations are the same on every line:
    CTranslate2's renormalization over all tokens but PAD and BOS shifts a step's log-probs by one constant,
    which leaves the best token the best. With beam 4 that shift differs between hypotheses, so near-ties
    may rank otherwise (nmt.translate.ctranslate2_engine), and with a prefix its scores leave out the
    prefix's log-probs: there, nine lines in ten agree (measured: 28-30 of 30) and all start alike."""
    model, subword, cfg = torch_model
    # Three words or more: on a shorter line min_len 3 forces tokens past the model's EOS, all near-ties.
    lines = [line for line in valid_lines if len(line.split()) >= 3][:60]
    prefixes = [" ".join(line.split()[:2]) if i % 2 else "" for i, line in enumerate(lines)]
    d = dataclasses.replace(cfg.decode, beam=beam, nbest=1, min_len=3, no_repeat_ngram_size=2)
    ours = Translator(model, subword, d, torch.device("cpu")).translate(lines, prefixes=prefixes)
    theirs = ctranslate2_translator(exported, d, threads=1).translate(lines, prefixes=prefixes)
    compared = [(a, b) for a, b, p in zip(ours, theirs, prefixes, strict=True) if beam == 1 or not p]
    differ = [(a, b) for a, b in compared if a != b]
    assert not differ if beam == 1 else len(differ) <= 0.1 * len(compared), differ
    for out, prefix in zip(ours + theirs, prefixes + prefixes, strict=True):
        assert out.startswith(prefix) and len(out.split()) >= 3
        words = out.split()
        assert len(set(zip(words, words[1:], strict=False))) == len(words) - 1


@needs_ct2
def test_blank_lines_and_order(exported: Path):
    from nmt.config import DecodeConfig
    from nmt.translate import ctranslate2_translator

    t = ctranslate2_translator(exported, DecodeConfig(beam=2, max_len_b=5), threads=1)
    assert t.translate(["", "a b c", "   ", "d e"]) == ["", "c b a", "", "e d"]
    assert t.translate([]) == []
    assert t.subword.encode(["a"]) == [[t.engine.ids["▁a"]]]


@needs_ct2
def test_nbest_through_the_command_line(exported: Path, tmp_path: Path):
    src = tmp_path / "in.txt"
    src.write_text("a b c\n\nd e f g\n")
    args = ["translate", "--engine", "ctranslate2", "-m", str(exported), "-i", str(src), "--device", "cpu"]
    result = runner.invoke(app, [*args, "--beam", "4", "--nbest", "3"])
    assert result.exit_code == 0, result.output
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert [int(r[0]) for r in rows] == [0, 0, 0, 1, 2, 2, 2]
    assert rows[0][2] == "c b a" and rows[3][2] == "" and rows[4][2] == "g f e d"
    scores = [float(r[1]) for r in rows[4:]]
    assert scores == sorted(scores, reverse=True)


@needs_ct2
def test_export_refuses_to_overwrite_without_force(exported: Path, synthetic_run: Path):
    model = str(synthetic_run / "checkpoints" / "best.pt")
    result = runner.invoke(app, ["export", "-m", model, "-o", str(exported)])
    assert result.exit_code == 2 and "--force" in result.output
    result = runner.invoke(app, ["export", "-m", model, "-o", str(exported), "--force"])
    assert result.exit_code == 0, result.output
    other = exported.parent / "unrelated"
    (other / "keep.txt").parent.mkdir()
    (other / "keep.txt").write_text("mine")
    result = runner.invoke(app, ["export", "-m", model, "-o", str(other), "--force"])
    assert result.exit_code == 2 and (other / "keep.txt").exists()


@needs_ct2
def test_export_of_a_file_that_is_not_a_checkpoint(tmp_path: Path):
    bogus = tmp_path / "model.pt"
    bogus.write_bytes(b"not a checkpoint")
    result = runner.invoke(app, ["export", "-m", str(bogus), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "not a readable nmt checkpoint" in result.output
    assert not (tmp_path / "out").exists()


def test_export_to_an_unknown_format(tmp_path: Path):
    result = runner.invoke(app, ["export", "-m", str(tmp_path / "m.pt"), "--format", "onnx", "-o", "x"])
    assert result.exit_code == 2 and "--format onnx" in result.output


def test_export_without_ctranslate2_says_how_to_install_it(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 -> ImportError
    result = runner.invoke(app, ["export", "-m", str(tmp_path / "m.pt"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "pip install 'nmt[ctranslate2]'" in result.output
