"""`nmt backtranslate`: a reverse model's translations of monolingual text as a parallel corpus; killed
and resumed to the same corpus, its settings kept, its hostile inputs refused in one line."""

from __future__ import annotations

import json
import random
from io import StringIO
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from nmt import atomic
from nmt.backtranslate import MAX_LINE_BYTES, BacktranslateOptions, backtranslate, read_mono
from nmt.errors import ConfigError, DataError, NmtError

from .conftest import Killed, cli, kill_after, one_error_line, sentences
from .synthetic import sentence

QUIET = Console(file=StringIO())


@pytest.fixture
def reverse_model(synthetic_run, tmp_path) -> Path:
    """A model that learned its task (the reversal task, xx->yy), so its samples are not all noise."""
    path = tmp_path / "reverse.pt"
    path.write_bytes((synthetic_run / "checkpoints" / "best.pt").read_bytes())
    return path


@pytest.fixture
def mono(tmp_path) -> Path:
    """Monolingual text of the reverse model's source language (xx), with repeats and blank lines."""
    rng = random.Random(5)
    lines = [sentence(rng) for _ in range(40)]
    path = tmp_path / "mono.xx"
    path.write_text("\n".join(lines[:30] + ["", lines[3], "   "] + lines[30:]) + "\n")
    return path


def options(checkpoint, mono, out, **kw) -> BacktranslateOptions:
    return BacktranslateOptions(reverse=checkpoint, mono=(mono,), output=out, chunk_lines=8, **kw)


def corpus(prefix: Path) -> tuple[str, str]:
    return Path(f"{prefix}.yy").read_text(), Path(f"{prefix}.xx").read_text()


def test_the_corpus_pairs_synthetic_sources_with_each_real_line_once(
    reverse_model, mono, tmp_path, one_torch_thread
):
    info = backtranslate(options(reverse_model, mono, tmp_path / "bt" / "c"), QUIET)
    src, tgt = (text.splitlines() for text in corpus(tmp_path / "bt" / "c"))
    real = [line for line in mono.read_text().splitlines() if line.strip()]
    assert len(src) == len(tgt) == info["pairs"] <= 40
    assert len(set(tgt)) == len(tgt) and set(tgt) <= set(real)
    assert tgt == [line for line in dict.fromkeys(real) if line in set(tgt)]  # in the text's order
    assert info["mono"] == {"read": 43, "blank": 2, "repeated": 1, "capped": 0}
    assert info["translated"] == 40 and info["pairs"] == 40 - sum(info["removed"].values())
    assert all(line.strip() for line in src)
    again = backtranslate(options(reverse_model, mono, tmp_path / "bt" / "c"), QUIET)  # done: nothing redone
    assert again == info
    done = tmp_path / "bt" / "c.work" / "done.json"
    done.write_text("{")  # damaged from outside: written again, to the same corpus
    written = corpus(tmp_path / "bt" / "c")
    assert backtranslate(options(reverse_model, mono, tmp_path / "bt" / "c"), QUIET)["pairs"] == info["pairs"]
    assert corpus(tmp_path / "bt" / "c") == written and json.loads(done.read_text())["pairs"] == info["pairs"]


def test_max_lines_caps_what_is_translated(reverse_model, mono, tmp_path, one_torch_thread):
    info = backtranslate(options(reverse_model, mono, tmp_path / "c", max_lines=9), QUIET)
    assert info["translated"] == 9 and info["mono"]["capped"] == 31
    assert len(corpus(tmp_path / "c")[1].splitlines()) <= 9


@pytest.mark.parametrize("method", ["sampling", "topk", "beam"])
def test_each_method_gives_the_same_corpus_for_the_same_seed(
    reverse_model, mono, tmp_path, one_torch_thread, method
):
    a = backtranslate(options(reverse_model, mono, tmp_path / "a", method=method, max_lines=12), QUIET)
    backtranslate(options(reverse_model, mono, tmp_path / "b", method=method, max_lines=12), QUIET)
    assert corpus(tmp_path / "a") == corpus(tmp_path / "b")
    assert a["search"]["sampling"] == (method != "beam")
    if method != "beam":  # another seed draws other sources
        backtranslate(
            options(reverse_model, mono, tmp_path / "c", method=method, max_lines=12, seed=2), QUIET
        )
        assert corpus(tmp_path / "c")[0] != corpus(tmp_path / "a")[0]


@pytest.mark.parametrize(
    "where",
    [
        lambda p: p.name == "00002.jsonl",  # in the reverse step, a chunk written and the next not
        lambda p: p.suffix == ".yy",  # the synthetic side written, the real one not
        lambda p: p.name == "00000.jsonl",
    ],
)
def test_a_killed_run_resumes_to_the_same_synthetic_corpus(
    reverse_model, mono, tmp_path, monkeypatch, one_torch_thread, where
):
    """Sampled chunks each draw from their own stream: the chunks a resumed run translates are those an
    uninterrupted run drew, whichever were done before the kill."""
    backtranslate(options(reverse_model, mono, tmp_path / "whole"), QUIET)
    assert corpus(tmp_path / "whole")[0].count("\n") >= 30  # pairs to compare, not an empty corpus
    with monkeypatch.context() as m:
        kill_after(m, atomic, "write_text", lambda path, text: where(Path(path)))
        with pytest.raises(Killed):
            backtranslate(options(reverse_model, mono, tmp_path / "resumed"), QUIET)
    assert not (tmp_path / "resumed.work" / "done.json").exists()
    log = StringIO()
    backtranslate(options(reverse_model, mono, tmp_path / "resumed"), Console(file=log, width=300))
    assert corpus(tmp_path / "resumed") == corpus(tmp_path / "whole")
    if where(Path("00002.jsonl")):
        assert "3 already done" in log.getvalue()


def test_a_changed_setting_on_resume_is_refused_in_one_line(
    reverse_model, mono, tmp_path, monkeypatch, one_torch_thread
):
    with monkeypatch.context() as m:
        kill_after(m, atomic, "write_text", lambda path, text: Path(path).name == "00001.jsonl")
        with pytest.raises(Killed):
            backtranslate(options(reverse_model, mono, tmp_path / "c"), QUIET)
    chunks = sorted((tmp_path / "c.work" / "chunks").iterdir())
    before = [p.read_bytes() for p in chunks]
    result = cli(
        "backtranslate",
        "-r",
        reverse_model,
        "--mono",
        mono,
        "-o",
        tmp_path / "c",
        "--chunk-lines",
        "8",
        "--seed",
        "2",
    )
    assert result.returncode == 2
    one_error_line(result.stderr, "--seed differs", "c.work")
    result = cli(
        "backtranslate",
        "-r",
        reverse_model,
        "--mono",
        mono,
        "-o",
        tmp_path / "c",
        "--chunk-lines",
        "8",
        "--method",
        "beam",
    )
    one_error_line(result.stderr, "--method differs")
    assert [p.read_bytes() for p in sorted((tmp_path / "c.work" / "chunks").iterdir())] == before


def bad(tmp_path, data: bytes) -> Path:
    path = tmp_path / "bad.xx"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "no text to back-translate"),
        (b"\n \n\t\n", "no text to back-translate"),
        (b"ein Hund\nein \xff Hund\n", "line 2: not UTF-8"),
        (b"a b\n" + b"x" * (5 << 20) + b"\n", "line 2: 5,242,880 bytes"),
    ],
)
def test_a_bad_mono_file_is_one_line_naming_it_and_nothing_is_written(checkpoint, tmp_path, data, says):
    mono = bad(tmp_path, data)
    result = cli("backtranslate", "-r", checkpoint, "--mono", mono, "-o", tmp_path / "out" / "c")
    assert result.returncode == 2
    one_error_line(result.stderr, str(mono), says)
    assert not (tmp_path / "out").exists()


@given(st.binary(max_size=300))
def test_any_bytes_are_lines_or_one_data_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("m") / "m.xx"
    path.write_bytes(data)
    try:
        lines = read_mono(path)
    except DataError as e:
        assert str(path) in str(e) and "\n" not in str(e)
        return
    assert any(lines) and all("\n" not in line and line == line.rstrip() for line in lines)
    assert lines == [line.rstrip() for line in data.decode().split("\n")][: len(lines)]


def test_a_line_at_the_limit_is_read(tmp_path):
    assert read_mono(bad(tmp_path, b"x" * MAX_LINE_BYTES + b"\n")) == ["x" * MAX_LINE_BYTES]


def test_a_reverse_model_of_another_vocabulary_or_direction_is_refused(checkpoint, mono, tmp_path):
    from nmt.subword import train_sentencepiece

    other = train_sentencepiece(sentences(500, 9), tmp_path / "other", 90, character_coverage=1.0)
    spm = tmp_path / "spm.model"
    spm.write_bytes(other.proto)
    with pytest.raises(ConfigError, match=rf"^--reverse {checkpoint}: its subword vocabulary is not {spm}"):
        backtranslate(options(checkpoint, mono, tmp_path / "c", vocab=spm), QUIET)
    with pytest.raises(ConfigError, match=r"translates xx->yy; the recipe needs zz->yy"):
        backtranslate(options(checkpoint, mono, tmp_path / "c", direction=("yy", "zz")), QUIET)
    assert not (tmp_path / "c.work").exists()


def test_an_output_over_an_input_is_refused(checkpoint, mono, tmp_path):
    with pytest.raises(NmtError, match="is the input"):
        backtranslate(options(checkpoint, mono, tmp_path / "mono"), QUIET)
    assert mono.read_text().count("\n") == 43


def test_a_recipe_whose_vocabulary_the_reverse_model_lacks_is_one_line_naming_it(checkpoint, mono, tmp_path):
    import yaml

    from nmt.subword import train_sentencepiece

    spec = {"url": "http://127.0.0.1/x", "sha256": "0" * 64}
    corpus = {"name": "x", "src": spec, "tgt": spec}
    recipe = tmp_path / "fwd.yaml"
    recipe.write_text(
        yaml.safe_dump({"data": {"src_lang": "yy", "tgt_lang": "xx", "train": [corpus], "valid": [corpus]}})
    )
    spm = tmp_path / "w" / "data" / "spm.model"
    spm.parent.mkdir(parents=True)
    spm.write_bytes(
        train_sentencepiece(sentences(500, 9), tmp_path / "other", 90, character_coverage=1.0).proto
    )
    args = [
        "backtranslate",
        recipe,
        "-w",
        tmp_path / "w",
        "-r",
        checkpoint,
        "--mono",
        mono,
        "-o",
        tmp_path / "c",
    ]
    result = cli(*args)
    assert result.returncode == 2
    one_error_line(result.stderr, str(checkpoint), str(spm), "subword vocabulary")
    spm.write_bytes(Path(f"{checkpoint.parent}/spm.model").read_bytes())  # the reverse model's own
    result = cli(*args, "--max-lines", "3")
    assert result.returncode == 0, result.stderr.decode()
    assert Path(f"{tmp_path}/c.xx").read_text().count("\n") <= 3


@pytest.mark.parametrize("method", ["topk", "beam"])
def test_ctranslate2_back_translates_alike_when_resumed(reverse_model, mono, tmp_path, monkeypatch, method):
    pytest.importorskip("ctranslate2")
    from nmt.config import Engine

    opts = lambda out: options(reverse_model, mono, out, method=method, engine=Engine.CTRANSLATE2)  # noqa: E731
    info = backtranslate(opts(tmp_path / "whole"), QUIET)
    assert info["search"]["engine"] == "ctranslate2" and info["search"]["sampling"] == (method != "beam")
    with monkeypatch.context() as m:
        kill_after(m, atomic, "write_text", lambda path, text: Path(path).name == "00002.jsonl")
        with pytest.raises(Killed):
            backtranslate(opts(tmp_path / "resumed"), QUIET)
    backtranslate(opts(tmp_path / "resumed"), QUIET)
    assert corpus(tmp_path / "resumed") == corpus(tmp_path / "whole")
    assert corpus(tmp_path / "whole")[0].count("\n") >= 30


# ---- tagged back-translation: <BT> on a corpus's sources, by id, never from text ------------------------


def tagged_recipe(folder: Path, tag: bool | None = True) -> tuple[dict, str]:
    """A recipe of a real corpus and a back-translated one (tagged or not; None: no `tag` key at all),
    served from `folder` as a mirror; returns the recipe as a dict and the mirror."""
    import hashlib

    rng = random.Random(2)
    specs = {}
    for name, n in (("real", 60), ("bt", 40), ("valid", 10)):
        src = [sentence(rng) for _ in range(n)]
        if name == "real":  # text that spells the tag, and its characters elsewhere: real sources
            src = [
                f"<BT> {line}" if i % 3 == 0 else f"< T > {line}" if i % 3 == 1 else line
                for i, line in enumerate(src)
            ]
        for lang, lines in (("xx", src), ("yy", [line.upper() for line in src])):
            path = folder / f"{name}.{lang}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(line + "\n" for line in lines))
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            specs[name, lang] = {"url": f"http://127.0.0.1/data/{path.name}", "sha256": sha}
    corpus = lambda name: {"name": name, "src": specs[name, "xx"], "tgt": specs[name, "yy"]}  # noqa: E731
    bt = corpus("bt") | ({} if tag is None else {"tag": tag})
    data = {
        "src_lang": "xx",
        "tgt_lang": "yy",
        "train": [corpus("real"), bt],
        "valid": [corpus("valid")],
        "vocab_size": 70,
    }
    return {"data": data}, str(folder)


def test_a_tagged_corpus_reserves_bt_and_only_training_corpora_may_be_tagged(tmp_path):
    from nmt.config import config_from_dict

    recipe, _ = tagged_recipe(tmp_path)
    assert config_from_dict(recipe).data.reserved_tags == ("<BT>",)
    assert config_from_dict(tagged_recipe(tmp_path, tag=False)[0]).data.reserved_tags == ()
    recipe["data"]["valid"][0]["tag"] = True
    with pytest.raises(ConfigError, match=r"data.valid\[0\].tag: only training corpora are tagged"):
        config_from_dict(recipe)


def test_tagged_sources_begin_with_bt_by_id_and_typed_bt_is_text(tmp_path, monkeypatch):
    """<BT> is a control symbol: binarize puts its id first on the tagged corpus's sources alone;
    SentencePiece never encodes text to it, so typing it changes nothing, and decoding never writes it."""
    from nmt.config import config_from_dict
    from nmt.data.binarized import ParallelData
    from nmt.data.preprocess import preprocess
    from nmt.subword import Subword

    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    recipe, mirror = tagged_recipe(tmp_path / "mirror")
    stats = preprocess(config_from_dict(recipe), tmp_path / "w", mirror=mirror, console=QUIET)
    sub = Subword.load(tmp_path / "w" / "data" / "spm.model")
    bt = sub.tags["<BT>"]
    assert sub.tags == {"<BT>": bt} and sub.targets == []
    split = ParallelData(tmp_path / "w" / "data" / "train")
    groups = {g["corpus"]: g["pairs"] for g in stats["groups"]}
    assert list(groups) == ["real", "bt"] and len(split) == sum(groups.values())
    firsts = [int(split.src(i)[0]) for i in range(len(split))]
    assert firsts[groups["real"] :] == [bt] * groups["bt"]  # every back-translated source, first
    assert bt not in firsts[: groups["real"]]  # the real sources that begin with the text "<BT>" too
    assert all(
        bt not in split.src(i)[1:].tolist() and bt not in split.tgt(i).tolist() for i in range(len(split))
    )
    # typed in any position, <BT> is its characters' pieces, as any other text
    for line in ("<BT> a b c", "a <BT> b", "<BT>"):
        ids = sub.encode([line])[0]
        assert bt not in ids
        assert sub.decode([ids]) == [line]
    assert sub.decode([[bt, *sub.encode(["a b"])[0], bt]]) == ["a b"]  # never written out


def test_a_recipe_without_tagged_corpora_keeps_its_fingerprints_and_vocabulary(tmp_path, monkeypatch):
    """`tag` at its default is left out of the work directory's fingerprints, as the keys of several
    directions are: a bilingual work directory made before it is neither redone nor refused."""
    from nmt.config import config_from_dict
    from nmt.data import preprocess as prep

    recipe, _ = tagged_recipe(tmp_path, tag=None)
    data = config_from_dict(recipe).data
    assert data.reserved_tags == ()
    with_key = {step: prep._fingerprint(data, step) for step in ("text", "subword")}
    original = prep.config_to_dict

    def without_tag(cfg):  # the config as it was written before corpora had a `tag`
        d = original(cfg)
        for section in ("train", "valid", "test"):
            for corpus in d[section]:
                corpus.pop("tag")
        return d

    monkeypatch.setattr(prep, "config_to_dict", without_tag)
    assert with_key == {step: prep._fingerprint(data, step) for step in ("text", "subword")}


def test_a_model_that_writes_bt_never_outputs_it_and_typed_bt_reaches_it_as_text(tmp_path, monkeypatch):
    """The worst case for a leak: a model whose every step prefers <BT>. Its translations hold no tag,
    and lines that spell <BT> reach it as their characters' subwords, never as the tag's id."""
    import torch

    from nmt.checkpoint import save_checkpoint
    from nmt.config import config_from_dict
    from nmt.data.preprocess import preprocess
    from nmt.model import Transformer
    from nmt.subword import Subword
    from nmt.translate import build_translator

    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    recipe, mirror = tagged_recipe(tmp_path / "mirror")
    recipe["model"] = {"encoder_layers": 1, "decoder_layers": 1, "d_model": 16, "d_ff": 32, "heads": 2}
    recipe["model"] |= {"max_positions": 64, "output_bias": True}
    recipe["decode"] = {"beam": 2, "max_len_a": 1.0, "max_len_b": 5}
    cfg = config_from_dict(recipe)
    preprocess(cfg, tmp_path / "w", mirror=mirror, console=QUIET)
    sub = Subword.load(tmp_path / "w" / "data" / "spm.model")
    bt = sub.tags["<BT>"]
    torch.manual_seed(0)
    model = Transformer(cfg.model, sub.vocab_size)
    model.output_bias[bt] = 100.0  # every step's likeliest token
    path = tmp_path / "bt-writer.pt"
    save_checkpoint(
        path, model_state=model.state_dict(), config=cfg, subword_proto=sub.proto, vocab_size=sub.vocab_size
    )
    translator = build_translator(path, device="cpu", dtype="fp32", console=QUIET).translator
    lines = ["<BT> a b c", "a <BT> b", "a b c"]
    encoded = translator.encode(lines).sources
    assert all(bt not in ids for ids in encoded.values())
    assert [encoded[i] for i in range(3)] == sub.encode(lines)
    found = translator.engine.search([encoded[0]], None, 1)[0][0].tokens
    assert bt in found  # the model did write the tag
    assert translator.translate(lines) == ["", "", ""]  # and no output holds it


@pytest.mark.slow  # real processes, killed by signals where they are, beside an uninterrupted one
def test_backtranslate_killed_by_signals_resumes_to_the_same_synthetic_corpus(reverse_model, tmp_path):
    """SIGKILL once a chunk is written, SIGTERM once a later one is: each real process dies wherever it
    is (mid-chunk, mid-write), leaves no partial file, and the run then ends with the corpus of one
    never killed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    rng = random.Random(8)
    mono = tmp_path / "mono.xx"
    mono.write_text("".join(sentence(rng) + "\n" for _ in range(600)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def command(prefix):
        return [sys.executable, "-m", "nmt", "backtranslate", "-r", str(reverse_model), "--mono", str(mono),
                "-o", str(prefix), "--chunk-lines", "25", "--device", "cpu"]  # fmt: skip

    done = subprocess.run(command(tmp_path / "whole"), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    chunks = tmp_path / "resumed.work" / "chunks"
    for sig, sign in ((signal.SIGKILL, "00001.jsonl"), (signal.SIGTERM, "00012.jsonl")):
        process = subprocess.Popen(
            command(tmp_path / "resumed"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 300
        while not (chunks / sign).exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process.poll() is None, "finished before the signal: give it more to translate"
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=120)
        assert "Traceback" not in stderr.decode(), stderr.decode()
        assert process.returncode != 0
    assert not [p for p in chunks.iterdir() if not p.name.endswith(".jsonl")]  # no temporary file left
    assert not (tmp_path / "resumed.yy").exists()
    done = subprocess.run(command(tmp_path / "resumed"), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert corpus(tmp_path / "resumed") == corpus(tmp_path / "whole")
    assert corpus(tmp_path / "whole")[0].count("\n") >= 500
