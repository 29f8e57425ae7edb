"""`nmt preprocess` on the real Multi30k text (from $NMT_DATA_MIRROR) and on small generated corpora."""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from nmt.cli import app
from nmt.config import RECIPES_DIR, config_from_dict, load_config
from nmt.data.binarized import ParallelData, write_split
from nmt.data.clean import clean_pairs, drop_reason
from nmt.data.preprocess import preprocess
from nmt.errors import DataError
from nmt.subword import Subword
from nmt.tokens import EOS

NEEDS_MIRROR = "set NMT_DATA_MIRROR=/path/to/multi30k to run"
RECIPE = RECIPES_DIR / "multi30k-en-de.yaml"
SMALL = ["data.vocab_size=1000"]  # a small vocabulary keeps SentencePiece fast


def run(cfg, workdir: Path, mirror: str | None = None, force: bool = False) -> tuple[dict, str]:
    console = Console(record=True, width=200, file=open(os.devnull, "w"))  # noqa: SIM115
    stats = preprocess(cfg, workdir, mirror=mirror, force=force, console=console)
    return stats, console.export_text()


def snapshot(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def multi30k() -> Path:
    mirror = os.environ.get("NMT_DATA_MIRROR")
    if not mirror:
        pytest.skip(NEEDS_MIRROR)
    return Path(mirror)


@pytest.fixture(scope="module")
def done(multi30k, tmp_path_factory):
    """One preprocessing run on Multi30k EN-DE, shared by the tests that only read its outputs."""
    root = tmp_path_factory.mktemp("multi30k")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NMT_CACHE", str(root / "cache"))
        cfg = load_config(RECIPE, SMALL)
        stats, log = run(cfg, root / "work", mirror=str(multi30k))
        yield cfg, root / "work", stats, log


def lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", newline="\n") as f:
        return [line.rstrip("\n") for line in f]


def test_multi30k_outputs(done, multi30k):
    cfg, work, stats, log = done
    data = work / "data"
    for name in ("spm.model", "spm.vocab", "stats.json", "valid.en", "valid.de"):
        assert (data / name).is_file(), name
    assert lines(data / "test" / "test_2016_flickr.en") == lines(multi30k / "test_2016_flickr.en.gz")
    assert lines(data / "test" / "test_2016_flickr.de") == lines(multi30k / "test_2016_flickr.de.gz")
    assert lines(data / "valid.de") == lines(multi30k / "val.de.gz")
    assert json.loads((data / "stats.json").read_text()) == stats

    train = stats["train"]
    assert train["lines"] == 29000
    assert train["kept"] + sum(train["dropped"].values()) == train["lines"]
    assert stats["valid"]["lines"] == 1014 and stats["test"] == {"test_2016_flickr": 1000}
    assert "kept" in log and "ratio" in log

    sub = Subword.load(data / "spm.model")
    assert sub.vocab_size == 1000
    pairs = ParallelData(data / "train")
    assert len(pairs) == train["kept"]
    assert int(pairs.src_lens.sum()) == train["tokens"]["src"]
    assert int(pairs.tgt_lens.max()) == train["length_percentiles"]["tgt"]["100"] <= cfg.data.max_subwords
    first_src, first_tgt = lines(data / "clean" / "train.en")[0], lines(data / "clean" / "train.de")[0]
    assert sub.decode([pairs.src(0).tolist(), pairs.tgt(0).tolist()]) == [first_src, first_tgt]
    assert EOS not in pairs.src(0).tolist()
    valid = ParallelData(data / "valid")
    assert len(valid) == 1014
    assert sub.decode([valid.tgt(5).tolist()]) == [lines(data / "valid.de")[5]]


def test_second_run_is_already_done_and_touches_nothing(done, multi30k):
    cfg, work, stats, _ = done
    before = snapshot(work)
    again, log = run(cfg, work, mirror=str(multi30k))
    assert "already done" in log
    assert again == stats and snapshot(work) == before


def test_force_redoes_every_step(done, multi30k):
    cfg, work, stats, _ = done
    before = snapshot(work)
    again, log = run(cfg, work, mirror=str(multi30k), force=True)
    assert "already done" not in log and "forced" in log
    assert again == stats
    after = snapshot(work)
    assert all(after[k] > before[k] for k in ("data/.done/text.json", "data/stats.json", "data/spm.model"))


def test_a_step_killed_midway_is_redone(done, multi30k):
    cfg, work, stats, _ = done
    (work / "data" / ".done" / "binarize.json").unlink()  # as if killed before the marker was written
    (work / "data" / "train.src.bin.part").write_bytes(b"half")
    again, log = run(cfg, work, mirror=str(multi30k))
    assert "binarize: not done yet" in log and "text: not done" not in log
    assert again == stats and not (work / "data" / "train.src.bin.part").exists()


def test_a_changed_data_section_or_a_deleted_output_is_redone(done, multi30k):
    cfg, work, stats, _ = done
    (work / "data" / "spm.model").unlink()
    again, log = run(cfg, work, mirror=str(multi30k))
    assert "subword: spm.model is missing" in log and "text:" not in log and again == stats
    smaller = load_config(RECIPE, ["data.vocab_size=900"])
    again, log = run(smaller, work, mirror=str(multi30k))
    assert "subword: the recipe's data section changed" in log and "text:" not in log
    assert again["vocab_size"] == 900
    run(cfg, work, mirror=str(multi30k))  # leave the shared run as the other tests expect it


# ---------------------------------------------------------------------------------------------------------
# Generated corpora: exact cleaning counts and errors


def small_corpus(folder: Path, pairs: list[tuple[str, str]], name: str = "corpus") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.en").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    (folder / f"{name}.de").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")


def small_recipe(folder: Path, **data) -> dict:
    """A recipe whose files all come from `folder` (used as the mirror), with their real checksums."""
    import hashlib

    def spec(name: str) -> dict:
        sha = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        return {"url": f"https://upstream.invalid/{name}", "sha256": sha}

    corpus = {"name": "corpus", "src": spec("corpus.en"), "tgt": spec("corpus.de")}
    return {
        "data": {"src_lang": "en", "tgt_lang": "de", "train": [corpus], "valid": [corpus], **data},
        "model": {"encoder_layers": 1, "decoder_layers": 1, "d_model": 16, "d_ff": 32, "heads": 2},
    }


def generated_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    words = "the a cat dog runs sleeps on mat big small red house tree water".split()
    out = []
    for _ in range(n):
        k = rng.randint(3, 8)
        s = " ".join(rng.choice(words) for _ in range(k))
        out.append((s, s.upper()))
    return out


def test_cleaning_counts_each_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    good = generated_pairs(200)
    bad = [
        ("", "LEER"),  # empty
        ("   ", "  "),  # empty (whitespace only)
        (" ".join(["w"] * 13), " ".join(["W"] * 13)),  # over max_words 12
        ("one two", "EINS ZWEI DREI VIER FUNF"),  # ratio 2.5 > 1.5
        ("x " * 12, "y " * 12),  # not too long, but 12 subwords + ... (kept by words)
    ]
    small_corpus(tmp_path / "m", good + bad)
    cfg = config_from_dict(small_recipe(tmp_path / "m", vocab_size=64, max_words=12, max_subwords=10))
    stats, log = run(cfg, tmp_path / "work", mirror=str(tmp_path / "m"))
    dropped = stats["train"]["dropped"]
    assert (dropped["empty"], dropped["too_short"], dropped["too_long"], dropped["ratio"]) == (2, 0, 1, 1)
    assert dropped["too_many_subwords"] >= 1  # the 12-word pair has more than 10 subwords
    assert stats["train"]["kept"] == 205 - sum(dropped.values())
    assert stats["valid"]["lines"] == 205  # validation pairs are never filtered
    assert "too many subwords" in log


def test_drop_reason_follows_clean_corpus_n():
    cfg = config_from_dict(small_recipe_stub())
    assert drop_reason(0, 3, cfg.data) == "empty"
    assert drop_reason(251, 250, cfg.data) == "too_long"
    assert drop_reason(2, 4, cfg.data) == "ratio" and drop_reason(2, 3, cfg.data) is None  # 1.5 is kept
    dropped: dict[str, int] = {}
    kept = list(clean_pairs(iter([(" a  b ", "c\td"), ("", "x")]), cfg.data, dropped))
    assert kept == [("a b", "c d")] and dropped == {"empty": 1}


def small_recipe_stub() -> dict:
    spec = {"url": "https://upstream.invalid/x.en", "sha256": "0" * 64}
    corpus = {"name": "c", "src": spec, "tgt": spec}
    return {"data": {"src_lang": "en", "tgt_lang": "de", "train": [corpus], "valid": [corpus]}}


def test_line_count_mismatch_names_both_files_and_counts(tmp_path, monkeypatch):
    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    small_corpus(tmp_path / "m", generated_pairs(5))
    (tmp_path / "m" / "corpus.de").write_text("EINS\nZWEI\nDREI\n", encoding="utf-8")
    cfg = config_from_dict(small_recipe(tmp_path / "m", vocab_size=64))
    with pytest.raises(DataError) as e:
        run(cfg, tmp_path / "work", mirror=str(tmp_path / "m"))
    message = str(e.value)
    assert "corpus.en has 5 lines" in message and "corpus.de has 3" in message
    assert not (tmp_path / "work" / "data" / ".done" / "text.json").exists()
    assert not (tmp_path / "work" / "data" / "clean" / "train.en").exists()


def test_binarized_roundtrip_and_storage(tmp_path):
    src = [[5, 6, 7], [], [65535]]
    tgt = [[8], [9, 10], [11, 12, 13, 14]]
    assert write_split(tmp_path / "x", iter(src), iter(tgt), vocab_size=65536) == 3
    data = ParallelData(tmp_path / "x")
    assert len(data) == 3 and data.src_lens.tolist() == [3, 0, 1] and data.tgt_lens.tolist() == [1, 2, 4]
    assert [data.src(i).tolist() for i in range(3)] == src and data.tgt(2).dtype.is_floating_point is False
    assert (tmp_path / "x.src.bin").stat().st_size == 4 * 2  # uint16 ids
    write_split(tmp_path / "y", iter([[70000]]), iter([[1]]), vocab_size=80000)
    assert ParallelData(tmp_path / "y").src(0).tolist() == [70000]
    (tmp_path / "y.tgt.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"y\.tgt\.bin.*truncated"):
        ParallelData(tmp_path / "y")


# ---------------------------------------------------------------------------------------------------------
# The command line


def test_cli_preprocess_already_done(done, multi30k):
    cfg, work, stats, _ = done
    args = ["preprocess", str(RECIPE), "-w", str(work), "--mirror", str(multi30k)]
    result = CliRunner().invoke(app, args + [f"--set={o}" for o in SMALL])
    assert result.exit_code == 0, result.output
    assert "already done" in result.output


def test_cli_errors_are_one_line_and_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    small_corpus(tmp_path / "m", generated_pairs(4))
    (tmp_path / "m" / "corpus.de").write_text("EINS\n", encoding="utf-8")
    import yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(small_recipe(tmp_path / "m", vocab_size=64)))
    args = ["preprocess", str(recipe), "-w", str(tmp_path / "w"), "--mirror", str(tmp_path / "m")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    [line] = [x for x in result.output.splitlines() if "error" in x]  # after the steps' progress lines
    assert line.startswith("error:") and "corpus.en has 4 lines" in line and "corpus.de has 1" in line

    result = CliRunner().invoke(app, args[:-1] + [str(tmp_path / "empty-mirror")])
    assert result.exit_code == 2 and "not found in mirror folder" in result.output


def test_subwords_trained_twice_on_a_corpus_larger_than_their_sample_are_identical(tmp_path):
    import dataclasses
    import random

    from nmt.config import DataConfig
    from nmt.subword import sample_lines, train_subword

    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(2000)
    ]
    for side in ("src", "tgt"):
        lines = (" ".join(rng.choice(words[: rng.randint(10, 2000)]) for _ in range(12)) for _ in range(6000))
        (tmp_path / f"text.{side}").write_text("\n".join(lines) + "\n")
    files = [tmp_path / "text.src", tmp_path / "text.tgt"]
    corpus = {"name": "x", "src": None, "tgt": None, "sacrebleu": "wmt14"}
    data = DataConfig(
        src_lang="xx", tgt_lang="yy", train=(), valid=(), vocab_size=400, spm_sample_sentences=1500
    )
    data = dataclasses.replace(data, train=(corpus,), valid=(corpus,))
    first = train_subword(files, tmp_path / "a" / "spm", data).read_bytes()  # preprocessing, then again:
    assert train_subword(files, tmp_path / "a" / "spm", data).read_bytes() == first
    assert sample_lines(files, 1500) != sample_lines(files, 1500, seed=2)  # a sample, not the first lines
    assert len(sample_lines(files, 1500)) == 1500
    assert not list((tmp_path / "a").glob("*.txt")) and not list((tmp_path / "a").glob("*.part.*"))
