"""One model for several directions: config, reserved tags, weighted sampling, preprocessing, training,
resume and `nmt translate --target`, on a synthetic EN->DE/FR/CS task whose three "languages" a glance
tells apart (DE: the words reversed; FR: upper case; CS: each word with an x)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
import torch
from rich.console import Console

from nmt.config import config_from_dict, config_to_dict
from nmt.data.binarized import ParallelData
from nmt.data.preprocess import preprocess
from nmt.data.sampling import Group, epoch_counts, epoch_pairs, shares
from nmt.errors import ConfigError, NmtError
from nmt.languages import iso3, leading_tag, target_tag
from nmt.subword import Subword

from .conftest import cli, one_error_line
from .synthetic import make_config, sentence

MAKE = {
    "de": lambda s: " ".join(reversed(s.split())),
    "fr": lambda s: s.upper(),
    "cs": lambda s: " ".join(w + "x" for w in s.split()),
}
IS = {
    "de": lambda t: t == t.lower() and "x" not in t,
    "fr": lambda t: t == t.upper(),
    "cs": lambda t: all(w.endswith("x") for w in t.split()),
}


def write_task(mirror: Path, n: int, seed: int = 5) -> dict:
    """Aligned files en + de/fr/cs under `mirror`, and the corpus specs a recipe names them by."""
    rng = random.Random(seed)
    src = [sentence(rng, 2, 7) for _ in range(n)]
    mirror.mkdir(parents=True, exist_ok=True)
    specs = {}
    for lang, text in [("en", src)] + [(lang, [MAKE[lang](s) for s in src]) for lang in MAKE]:
        path = mirror / f"c.{lang}"
        path.write_text("".join(line + "\n" for line in text), encoding="utf-8")
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        specs[lang] = {"url": f"https://upstream.invalid/c.{lang}", "sha256": sha}
    return specs


def multi_recipe(specs: dict, weights=(1.0, 1.0, 1.0), temperature: float = 1.0, **train) -> dict:
    corpora = [
        {"name": "c", "tgt_lang": lang, "src": specs["en"], "tgt": specs[lang], "weight": w}
        for lang, w in zip(("de", "fr", "cs"), weights, strict=True)
    ]
    raw = config_to_dict(make_config(**train))
    raw["data"] = {
        "src_lang": "en",
        "tgt_lang": "de",
        "train": corpora,
        "valid": [{**c, "weight": 1.0} for c in corpora],
        "test": [{k: v for k, v in c.items() if k != "weight"} for c in corpora],
        "vocab_size": 80,
        "max_ratio": 3.0,
        "sampling_temperature": temperature,
    }
    return raw


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    specs = write_task(root / "mirror", 1200)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NMT_CACHE", str(root / "cache"))
        cfg = config_from_dict(multi_recipe(specs))
        stats = preprocess(cfg, root / "work", mirror=str(root / "mirror"))
        yield root, specs, cfg, stats


# ---------------------------------------------------------------------------------------------------------
# Config and codes


def test_a_bilingual_recipe_has_no_tags_and_a_multilingual_one_a_tag_per_target(task):
    _, specs, cfg, _ = task
    assert cfg.data.directions == (("en", "de"), ("en", "fr"), ("en", "cs"))
    assert cfg.data.reserved_tags == (">>deu<<", ">>fra<<", ">>ces<<")
    bilingual = make_config()
    assert bilingual.data.reserved_tags == () and not bilingual.data.multilingual


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"weight": 0}, "data.train[1].weight"),
        ({"weight": float("inf")}, "data.train[1].weight"),
        ({"tgt_lang": "en"}, "data.train[1].tgt_lang"),
    ],
)
def test_bad_corpus_settings_name_their_key(task, change, named):
    raw = multi_recipe(task[1])
    raw["data"]["train"][1].update(change)
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        config_from_dict(raw)


def test_a_test_set_of_a_direction_not_trained_and_a_bad_temperature_are_refused(task):
    raw = multi_recipe(task[1])
    raw["data"]["test"][0]["tgt_lang"] = "it"
    with pytest.raises(ConfigError, match=r"data.test\[0\]: en-it is not a direction"):
        config_from_dict(raw)
    raw = multi_recipe(task[1], temperature=0.0)
    with pytest.raises(ConfigError, match="data.sampling_temperature"):
        config_from_dict(raw)


def test_language_codes_and_leading_tags():
    assert iso3("fr") == iso3("fre") == iso3("FRA") == "fra" and iso3("cs") == "ces"
    assert target_tag("de") == ">>deu<<" and target_tag("zh_Hant") == ">>zho_hant<<"
    assert leading_tag("  >>fra<<  Un chat") == (">>fra<<", "Un chat")
    assert leading_tag("A >>fra<< cat") == (None, "A >>fra<< cat")
    assert leading_tag(">>fra<<") == (">>fra<<", "")


# ---------------------------------------------------------------------------------------------------------
# Sampling


def test_shares_follow_the_temperature_formula():
    groups = [Group("a", 900), Group("b", 100)]
    assert shares(groups, 1.0) == pytest.approx([0.9, 0.1])
    t5 = [0.9 ** (1 / 5), 0.1 ** (1 / 5)]
    assert shares(groups, 5.0) == pytest.approx([t5[0] / sum(t5), t5[1] / sum(t5)])
    weighted = [Group("a", 900), Group("b", 100, 3.0)]
    assert shares(weighted, 1.0) == pytest.approx([0.9 / 1.2, 0.3 / 1.2])
    assert sum(epoch_counts(weighted, 1.0)) == 1000


def test_an_unweighted_epoch_is_every_pair_once_and_a_weighted_one_a_seeded_draw():
    assert epoch_pairs([Group("a", 50), Group("b", 30)], 1.0, 1, 0) is None
    groups = [Group("a", 900), Group("b", 100, 3.0)]
    pool = epoch_pairs(groups, 1.0, 1, 0)
    counts = epoch_counts(groups, 1.0)
    a, b = pool[pool < 900], pool[pool >= 900]
    assert (len(a), len(b)) == tuple(counts) == (750, 250)
    assert len(set(a.tolist())) == 750  # drawn less often than its size: a part, no pair twice
    assert torch.bincount(b - 900, minlength=100).min() >= 2  # 2.5 times its size: whole twice, then part
    assert torch.equal(pool, epoch_pairs(groups, 1.0, 1, 0))  # a pure function of (seed, epoch)
    assert not torch.equal(pool, epoch_pairs(groups, 1.0, 1, 1))


# ---------------------------------------------------------------------------------------------------------
# Preprocessing


def test_the_tags_are_control_symbols_text_never_encodes_to(task):
    root, _, _, _ = task
    sub = Subword.load(root / "work" / "data" / "spm.model")
    assert list(sub.tags) == [">>deu<<", ">>fra<<", ">>ces<<"] and sub.targets == ["deu", "fra", "ces"]
    tags = set(sub.tags.values())
    typed = sub.encode(["a b >>fra<< c", "<BT> a >>deu<<"])
    assert not tags & {i for ids in typed for i in ids}
    assert (
        sub.encode([">>fra<< a b"])
        == sub.encode(["a b"], tag=">>fra<<")
        == [[sub.tags[">>fra<<"], *sub.encode(["a b"])[0]]]
    )
    assert sub.decode([[sub.tags[">>ces<<"], *sub.encode(["a b"])[0]]]) == ["a b"]


def test_each_source_begins_with_its_targets_tag_and_groups_describe_the_split(task):
    root, _, cfg, stats = task
    data = root / "work" / "data"
    sub = Subword.load(data / "spm.model")
    train = ParallelData(data / "train")
    groups = stats["groups"]
    assert [g["corpus"] for g in groups] == ["c en-de", "c en-fr", "c en-cs"]
    assert sum(g["pairs"] for g in groups) == len(train)
    start = 0
    for g, lang in zip(groups, ("de", "fr", "cs"), strict=True):
        firsts = {int(train.src(i)[0]) for i in range(start, start + g["pairs"])}
        assert firsts == {sub.tags[target_tag(lang)]}
        start += g["pairs"]
    assert json.loads((data / "stats.json").read_text())["directions"] == ["en-de", "en-fr", "en-cs"]
    for lang in ("de", "fr", "cs"):
        assert (data / f"valid.en-{lang}.{lang}").is_file() and (
            data / "test" / f"c.en-{lang}.{lang}"
        ).is_file()


# ---------------------------------------------------------------------------------------------------------
# Training and translation


@pytest.fixture(scope="module")
def trained(task):
    from nmt.train import train

    root, specs, _, _ = task
    cfg = config_from_dict(multi_recipe(specs, max_steps=250, save_every=250, warmup=40))
    work = root / "work"
    train(cfg, work)
    return work / "checkpoints" / "last.pt", cfg


@pytest.mark.slow  # the model its fixture trains (about 19 s)
def test_one_model_writes_each_target_its_tag_selects(trained, task):
    model, cfg = trained
    root = task[0]
    src = (root / "work" / "data" / "test" / "c.en-de.en").read_text().splitlines()[:100]
    inputs = root / "in.en"
    inputs.write_text("\n".join(src) + "\n")
    for lang in ("de", "fr", "cs"):
        out = cli("translate", "-m", str(model), "-i", str(inputs), "--target", lang, "--beam", "1")
        assert out.returncode == 0, out.stderr
        hyps = out.stdout.decode().splitlines()
        assert len(hyps) == 100
        share = sum(IS[lang](h) for h in hyps if h) / len(hyps)
        assert share >= 0.9, (lang, share, hyps[:5])


@pytest.mark.slow  # the model its fixture trains (about 19 s)
def test_a_tag_typed_mid_line_switches_nothing_and_a_leading_one_does(trained, task):
    from nmt.translate import build_translator

    model, _ = trained
    translator = build_translator(model, target="de", dtype="fp32").translator
    line = "a b c d e"
    plain = translator.translate([line])[0]
    typed = translator.encode(["a b >>fra<< c d e"]).sources[0]
    assert typed[0] == translator.subword.tags[">>deu<<"]
    assert not set(typed[1:]) & set(translator.subword.tags.values())
    assert translator.translate([f">>fra<< {line}"])[0] == translator.translate([line], target=">>fra<<")[0]
    assert translator.translate([f">>fra<< {line}"])[0] != plain


@pytest.mark.slow  # the model its fixture trains (about 19 s)
def test_a_target_the_model_lacks_and_no_target_are_one_line_exit_2(trained, tmp_path):
    model, _ = trained
    out = cli("translate", "-m", str(model), "--target", "it", stdin=b"a b\n")
    assert out.returncode == 2
    line = one_error_line(out.stderr, "--target it")
    assert "de, fr, cs" in line
    out = cli("translate", "-m", str(model), stdin=b"a b\n")
    assert out.returncode == 2 and "choose one" in one_error_line(out.stderr, "line 1")


@pytest.mark.slow
def test_a_killed_weighted_multilingual_run_resumes_to_exactly_the_same_parameters(
    task, tmp_path, monkeypatch
):
    """Corpora drawn by weight and temperature: the draw is rebuilt from (seed, epoch) on resume."""
    from .test_train import killed_and_resumed_equals_straight

    root, specs, _, _ = task
    monkeypatch.setenv("NMT_CACHE", str(root / "cache"))
    cfg = config_from_dict(multi_recipe(specs, (2.0, 1.0, 0.5), 2.0, max_steps=40, save_every=10))
    stats = preprocess(cfg, tmp_path / "prepared", mirror=str(root / "mirror"))
    assert [g["weight"] for g in stats["groups"]] == [2.0, 1.0, 0.5]
    killed_and_resumed_equals_straight(tmp_path, tmp_path / "prepared" / "data", cfg)


def test_a_bilingual_model_accepts_its_own_target_only(checkpoint):
    from nmt.translate import build_translator

    built = build_translator(checkpoint, dtype="fp32", target=None)
    assert built.targets == (built.tgt_lang,) and built.translator.target is None
    with pytest.raises(NmtError, match="translates into"):
        build_translator(checkpoint, dtype="fp32", target="zz")


@pytest.mark.slow  # the model its fixture trains (about 19 s)
def test_a_leading_tag_goes_into_every_sentence_of_its_line(trained, tmp_path):
    model, _ = trained
    out = cli("translate", "-m", str(model), "--beam", "1", stdin=b">>fra<< a b c. d e f.\n")
    assert out.returncode == 0, out.stderr
    assert IS["fr"](out.stdout.decode().strip()) and ">>" not in out.stdout.decode()


@pytest.mark.slow  # the model its fixture trains (about 19 s)
def test_a_multilingual_teacher_teaches_any_of_its_directions_and_no_other(trained, task):
    from nmt.checkpoint import checkpoint_config
    from nmt.distill.options import DistillOptions
    from nmt.distill.steps import check_teacher

    model, _ = trained
    teacher = checkpoint_config(model)
    opts = DistillOptions(teacher=model)
    student = config_to_dict(make_config())
    student["data"].update(src_lang="en", tgt_lang="fr")
    check_teacher(config_from_dict(student), opts, teacher)  # en->fr: one of its three
    student["data"].update(tgt_lang="it")
    with pytest.raises(ConfigError, match="translates en->de, en->fr, en->cs"):
        check_teacher(config_from_dict(student), opts, teacher)
    with pytest.raises(ConfigError, match="one direction"):
        check_teacher(task[2], opts, teacher)


@pytest.mark.slow  # the model its fixture trains (about 19 s)
def test_the_teacher_translates_into_the_students_target(trained, tmp_path):
    from nmt.config import DecodeOverrides, Engine, Precision
    from nmt.translate.chunks import ChunkedRun, read_chunks, translate_chunks

    model, _ = trained
    run = ChunkedRun(
        model, DecodeOverrides.given(beam=1), "cpu", Precision.FP32, Engine.TORCH,
        label="teacher", name=str(model), command="nmt distill", target="cs",
    )  # fmt: skip
    lines = ["a b c", "d e f g", "h i"]
    translate_chunks(lines, tmp_path / "nbest", 2, run, Console(quiet=True))
    hyps = [n["hyps"][0] for n in read_chunks(tmp_path / "nbest", len(lines), 2)]
    assert all(IS["cs"](h) for h in hyps), hyps


def test_the_server_splits_a_tagged_text_with_the_tag_in_every_sentence():
    from nmt.serve.documents import document

    tags = {">>fra<<": 5}
    doc = document(">>fra<< A man rides. A dog runs.", "text", "en", True, tags=tags)
    assert doc.lines == [">>fra<< A man rides.", ">>fra<< A dog runs."]
    assert doc.join(["Un homme.", "Un chien."]) == "Un homme. Un chien."
    untagged = document(">>fra<< A man rides. A dog runs.", "text", "en", True)  # a model without tags
    assert untagged.lines[0].startswith(">>fra<<") and not untagged.lines[1].startswith(">>fra<<")


@pytest.mark.slow  # the model its fixture trains (about 19 s)
def test_a_glossary_and_a_shortlist_serve_each_direction(trained, task, tmp_path):
    """One shortlist made from the corpora of every direction, and a glossary of each target's own terms:
    each direction keeps its language and places its terms."""
    model, _ = trained
    root = task[0]
    src = (root / "work" / "data" / "test" / "c.en-de.en").read_text().splitlines()[:60]
    inputs = tmp_path / "in.en"
    inputs.write_text("\n".join(src) + "\n")
    short = tmp_path / "short.pt"
    made = cli("shortlist", "-m", model, "--data", root / "work", "-o", short)
    assert made.returncode == 0, made.stderr
    word = max("abcdefghijklmnop", key=lambda w: sum(w in line.split() for line in src))
    with_word = [i for i, line in enumerate(src) if word in line.split()]
    assert len(with_word) >= 10
    for lang in ("de", "fr", "cs"):
        glossary = tmp_path / f"{lang}.tsv"
        glossary.write_text(f"{word}\t{MAKE[lang](word)}\n")
        for extra in (["--shortlist"], ["--glossary", glossary], ["--shortlist", "--glossary", glossary]):
            out = cli("translate", "-m", short, "-i", inputs, "--target", lang, *extra)
            assert out.returncode == 0, out.stderr
            hyps = out.stdout.decode().splitlines()
            assert len(hyps) == len(src)
            assert sum(IS[lang](h) for h in hyps) >= 0.9 * len(hyps), (lang, extra, hyps[:5])
            if "--glossary" in extra:  # the term as often as the word, in the target's own form
                for i in with_word:
                    assert hyps[i].split().count(MAKE[lang](word)) >= src[i].split().count(word), (
                        lang,
                        src[i],
                        hyps[i],
                    )


def test_results_show_each_directions_share_among_its_languages_and_among_all(tmp_path):
    from nmt.pipeline import write_results

    def entry(direction: str, ours: float, every: float) -> dict:
        score = {"score": 30.0, "signature": "nrefs:1"}
        shares = {"in_language": {"output": ours, "reference": 1.0}}
        shares["in_any_language"] = {"output": every, "reference": 0.99}
        speed = {"sentences_per_s": 9}
        return {"bleu": score, "chrf": score, "direction": direction, "speed": speed, **shares}

    results = {
        "recipe": "en-de en-cs",
        "model": "m.pt",
        "training": {},
        "device": {"type": "cpu", "count": 1},
        "decode": {"beam": 4, "lenpen": 0.6, "max_len": "1.2 * source + 10"},
        "tests": {"t en-de": entry("en-de", 1.0, 1.0), "t en-cs": entry("en-cs", 0.995, 0.982)},
    }
    write_results(tmp_path, results)
    md = (tmp_path / "results.md").read_text()
    assert "| t | en-cs | 30.0 | 30.0 | 99.5% / 100.0% | 98.2% / 99.0% | 9 |" in md
    written = json.loads((tmp_path / "results.json").read_text())["tests"]["t en-cs"]
    assert written["in_any_language"]["output"] == 0.982
