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
from nmt.tokens import BOS, EOS

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


WEB_CORPUS_DE = [
    ("A man rides a red bicycle down the street.", "Ein Mann fährt ein rotes Fahrrad die Straße hinunter."),
    ("Two dogs play in the snow.", "Zwei Hunde spielen im Schnee."),
    ("A woman is reading a book in the park.", "Eine Frau liest ein Buch im Park."),
    ("Children are swimming in a lake.", "Kinder schwimmen in einem See."),
]


def test_web_like_corpus_keeps_exactly_the_right_lines_and_counts_each_reason(tmp_path, monkeypatch):
    """Duplicates (exact, and up to case, punctuation and spaces), untranslated copies and a line in
    another language go; what is left, in order, is the first of each good pair."""
    pytest.importorskip("py3langid", reason="the language check needs py3langid: pip install -e '.[serve]'")
    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    good = WEB_CORPUS_DE
    corpus = [
        good[0],
        good[1],
        good[0],  # duplicate
        ("a man rides a red bicycle down the street", "ein Mann fährt ein rotes Fahrrad die Straße hinunter"),
        ("Click here to subscribe", "Click here to subscribe"),  # copy
        good[2],
        # a duplicate once its spaces are collapsed, as every kept line's are
        ("A  woman is reading a book in the park.", "Eine Frau liest ein Buch im  Park."),
        ("The weather is nice today.", "Il fait très beau aujourd'hui, nous allons à la plage."),  # French
        ("Das ist ein deutscher Satz über das Wetter.", "Das ist ein deutscher Satz über das Wetter!"),
        good[3],
        ("OK", "OK"),  # copy
        ("Hi", "Hallo"),  # too short to judge its language: kept
    ]
    small_corpus(tmp_path / "m", corpus)
    raw = small_recipe(tmp_path / "m", vocab_size=80, max_ratio=3.0)
    raw["data"]["train"][0]["langid"] = True
    cfg = config_from_dict(raw)
    stats, log = run(cfg, tmp_path / "work", mirror=str(tmp_path / "m"))
    clean = tmp_path / "work" / "data" / "clean"
    kept = list(zip(lines(clean / "train.en"), lines(clean / "train.de"), strict=True))
    assert kept == [good[0], good[1], good[2], good[3], ("Hi", "Hallo")]
    dropped = stats["train"]["dropped"]
    assert {k: v for k, v in dropped.items() if v} == {
        "copy": 2,
        "wrong_language": 2,  # the French target, and the German source of the last but three
        "duplicate": 2,
        "near_duplicate": 1,
    }
    assert stats["train"]["kept"] == 5 and stats["train"]["lines"] == len(corpus)
    on_disk = json.loads((tmp_path / "work/data/stats.json").read_text())
    assert on_disk["train"]["dropped"] == dropped
    for row in ("dropped: copy", "dropped: wrong language", "dropped: duplicate", "dropped: near duplicate"):
        assert row in log


def test_without_a_language_check_the_recipe_keeps_other_languages_and_the_switches_work(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    corpus = [*WEB_CORPUS_DE, ("The weather is nice.", "Il fait très beau aujourd'hui."), WEB_CORPUS_DE[0]]
    corpus += [("Same text.", "Same text.")]
    small_corpus(tmp_path / "m", corpus)
    cfg = config_from_dict(small_recipe(tmp_path / "m", vocab_size=80, max_ratio=3.0))
    stats, _ = run(cfg, tmp_path / "work", mirror=str(tmp_path / "m"))
    dropped = stats["train"]["dropped"]
    assert (dropped["wrong_language"], dropped["duplicate"], dropped["copy"]) == (0, 1, 1)
    off = config_from_dict(
        small_recipe(tmp_path / "m", vocab_size=80, max_ratio=3.0, dedup=False, drop_copies=False)
    )
    stats, log = run(off, tmp_path / "work", mirror=str(tmp_path / "m"))
    assert "the recipe's data section changed" in log
    assert stats["train"]["kept"] == len(corpus) and sum(stats["train"]["dropped"].values()) == 0


def test_a_pair_in_two_corpora_is_kept_once(tmp_path):
    cfg = config_from_dict(small_recipe_stub())
    from nmt.data.clean import Seen

    seen, dropped = Seen(), {}
    first = list(clean_pairs(iter(WEB_CORPUS_DE), cfg.data, dropped, seen))
    second = list(clean_pairs(iter([WEB_CORPUS_DE[1], ("New.", "Neu.")]), cfg.data, dropped, seen))
    assert first == WEB_CORPUS_DE and second == [("New.", "Neu.")] and dropped == {"duplicate": 1}


def test_augmentation_is_in_the_cleaned_text_and_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    pairs = [(f"{s} number {i}.", f"{t} Nummer {i}.") for i, (s, t) in enumerate(generated_pairs(300))]
    small_corpus(tmp_path / "m", pairs)
    augment = {"uppercase": 0.2, "titlecase": 0.1, "typos": 0.1, "remove_end_punct": 0.3}
    cfg = config_from_dict(small_recipe(tmp_path / "m", vocab_size=200, max_ratio=3.0, augment=augment))
    stats, log = run(cfg, tmp_path / "work", mirror=str(tmp_path / "m"))
    src = lines(tmp_path / "work/data/clean/train.en")
    tgt = lines(tmp_path / "work/data/clean/train.de")
    counts = stats["train"]["augmented"]
    assert len(src) == len(pairs) == stats["train"]["kept"]  # replaced, not added
    upper = sum(s == s.upper() and t == t.upper() for s, t in zip(src, tgt, strict=True))
    assert upper == counts["uppercase"] > 30
    assert (
        sum(not s.endswith(".") and not t.endswith(".") for s, t in zip(src, tgt, strict=True))
        == counts["remove_end_punct"]
    )
    assert counts["titlecase"] > 0 and counts["typos"] > 0 and "of which augmented: uppercase" in log
    again, _ = run(cfg, tmp_path / "again", mirror=str(tmp_path / "m"))
    assert lines(tmp_path / "again/data/clean/train.en") == src and again["train"]["augmented"] == counts


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

    from nmt.config import CorpusSpec, DataConfig
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
    corpus = CorpusSpec(name="x", sacrebleu="wmt14")
    data = DataConfig(
        src_lang="xx", tgt_lang="yy", train=(), valid=(), vocab_size=400, spm_sample_sentences=1500
    )
    data = dataclasses.replace(data, train=(corpus,), valid=(corpus,))
    first = train_subword(files, tmp_path / "a" / "spm", data).read_bytes()  # preprocessing, then again:
    assert train_subword(files, tmp_path / "a" / "spm", data).read_bytes() == first
    assert sample_lines(files, 1500) != sample_lines(files, 1500, seed=2)  # a sample, not the first lines
    assert len(sample_lines(files, 1500)) == 1500
    assert not list((tmp_path / "a").glob("*.txt")) and not list((tmp_path / "a").glob("*.part.*"))


def test_a_few_lines_encode_and_decode_one_at_a_time_as_sentencepieces_list_call_does(tmp_path):
    """Below POOL_FROM lines Subword calls SentencePiece a line at a time (its list call starts threads);
    the ids and texts must be the list call's, on each side of the switch, typed text included."""
    from nmt.subword import POOL_FROM, train_sentencepiece

    rng = random.Random(3)
    words = ["a", "dog", "runs", "über", "the", "grass", "naïve", "café", "x2", "—", "🙂"]
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 9))) for _ in range(400)]
    sub = train_sentencepiece(corpus, tmp_path / "spm", 30, character_coverage=1.0)
    typed = ["", "  two  spaces ", "tab\there", "UPPER café 🙂", "\u00a0no-break", "zz qq unknown"]
    for n in (1, 2, POOL_FROM - 1, POOL_FROM, POOL_FROM + 1):
        lines = (typed + corpus)[:n]
        ids = sub.encode(lines)
        assert ids == sub._sp.encode(lines, out_type=int)
        assert sub.encode_target(lines) == ids
        with_ends = [[BOS, *seq, EOS] for seq in ids]  # Subword.decode leaves BOS and EOS out
        assert sub.decode(with_ends) == sub._sp.decode(ids)


def test_inline_terms_go_into_the_binarized_sources_by_id_and_the_text_stays_as_it_was(tmp_path, monkeypatch):
    from nmt.data.terms import MIN_COUNT
    from nmt.languages import TERM_CLOSE, TERM_OPEN

    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    nouns = {"house": "Haus", "tree": "Baum", "water": "Wasser", "horse": "Pferd"}
    rng = random.Random(0)
    pairs = []
    for i in range(40 * MIN_COUNT):
        a, b = rng.sample(sorted(nouns), 2)
        pairs.append((f"the {a} and the {b} number {i}.", f"das {nouns[a]} und das {nouns[b]} Nummer {i}."))
    small_corpus(tmp_path / "m", pairs)
    augment = {"inline_terms": 0.5, "inline_terms_other": 0.0}
    recipe = small_recipe(tmp_path / "m", vocab_size=200, max_ratio=3.0, augment=augment)
    stats, log = run(config_from_dict(recipe), tmp_path / "work", mirror=str(tmp_path / "m"))
    data = tmp_path / "work/data"
    sub = Subword.load(data / "spm.model")
    opening, closing = sub.tags[TERM_OPEN], sub.tags[TERM_CLOSE]
    inline = stats["train"]["inline_terms"]
    assert inline["lexicon"] >= len(nouns) and "of which with inline terms" in log
    assert lines(data / "clean/train.en") == [s for s, _ in pairs]  # in the ids only
    train = ParallelData(data / "train")
    sources = [train.src(i).tolist() for i in range(len(train))]
    annotated = [ids for ids in sources if opening in ids]
    assert len(annotated) == inline["pairs"] and 0.4 < inline["pairs"] / len(pairs) < 0.6
    for ids in annotated:  # each term, between its symbols, is the target word of the source word before it
        start = ids.index(opening)
        term = sub.decode([ids[start + 1 : ids.index(closing)]])[0]
        word = sub.decode([ids[:start]])[0].split()[-1]
        assert nouns[word] == term
    again, _ = run(config_from_dict(recipe), tmp_path / "again", mirror=str(tmp_path / "m"))
    assert (tmp_path / "again/data/train.src.bin").read_bytes() == (data / "train.src.bin").read_bytes()
    off = small_recipe(tmp_path / "m", vocab_size=200, max_ratio=3.0)
    run(config_from_dict(off), tmp_path / "off", mirror=str(tmp_path / "m"))
    assert TERM_OPEN not in Subword.load(tmp_path / "off/data/spm.model").tags
