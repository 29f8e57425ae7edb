"""A back-translation recipe under `nmt run`: the bitext's vocabulary shared by every model, a reverse model
trained on the pairs swapped, the monolingual text back-translated and mixed in tagged; killed in each
step, it resumes to the same synthetic corpus and the same final weights."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from io import StringIO

import pytest
import torch
from rich.console import Console

import nmt.data.preprocess
import nmt.pipeline
import nmt.train.loop
from nmt import atomic
from nmt.checkpoint import load_checkpoint
from nmt.config import config_from_dict, config_to_dict
from nmt.data.binarized import ParallelData
from nmt.errors import ConfigError
from nmt.languages import BT_TAG
from nmt.pipeline import reverse_config, run_pipeline
from nmt.subword import Subword

from .conftest import Killed, cli, kill_after, one_error_line
from .synthetic import reverse, sentence
from .test_distill import student_config, write_mirror

QUIET = Console(file=StringIO())


def mono_file(folder, name: str, text: str) -> dict:
    """`text` written as folder/name, and the spec a recipe names it by through the mirror."""
    path = folder / name
    path.write_text(text)
    return {"url": f"http://127.0.0.1/data/{name}", "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def write_mono(folder, n=300, seed=11) -> dict:
    """Target-language (yy) text: reversed sentences, none of them a training target."""
    rng = random.Random(seed)
    return mono_file(folder, "mono.yy", "".join(reverse(sentence(rng)) + "\n" for _ in range(n)))


def bt_recipe(specs, mono, **backtranslate) -> dict:
    raw = config_to_dict(student_config(specs))
    raw["model"]["decoder_layers"] = 2
    raw["data"]["vocab_size"] = 32  # what the letters of the reversal task allow
    raw["data"]["backtranslate"] = {"mono": [mono], "max_lines": 250, "baseline": True, **backtranslate}
    return raw


def swapped_recipe(mirror, lines: int, **backtranslate) -> tuple[dict, str]:
    """A yy -> xx recipe (the reversal task's pairs swapped) under `mirror`, back-translating `lines`
    lines of mono.xx: what a reverse model of the xx -> yy task (synthetic_run's) reads. Returns the
    recipe and the monolingual text."""
    specs = write_mirror(mirror)
    rng = random.Random(4)
    text = "".join(sentence(rng) + "\n" for _ in range(lines))
    raw = bt_recipe(specs, mono_file(mirror, "mono.xx", text), **backtranslate)
    raw["data"]["src_lang"], raw["data"]["tgt_lang"] = "yy", "xx"
    for section in ("train", "valid", "test"):
        for corpus in raw["data"][section]:
            corpus["src"], corpus["tgt"] = corpus["tgt"], corpus["src"]
    return raw, text


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    mirror = tmp_path / "mirror"
    specs = write_mirror(mirror)
    raw = bt_recipe(specs, write_mono(mirror))
    return config_from_dict(raw), raw, str(mirror)


def outcome(workdir) -> dict:
    """What the run produced: the synthetic corpus, the forward model's data and weights, the scores."""
    results = json.loads((workdir / "results.json").read_text())
    return {
        "synthetic": [
            (workdir / "backtranslate" / f"backtranslated.{lang}").read_text() for lang in ("xx", "yy")
        ],
        "data": (workdir / "data" / "train.src.bin").read_bytes(),
        "weights": torch.load(workdir / "checkpoints" / "average.pt", weights_only=True)["model"],
        "reverse": torch.load(workdir / "reverse" / "checkpoints" / "average.pt", weights_only=True)["model"],
        "scores": {k: v["bleu"]["score"] for k, v in results["tests"].items()},
        "bitext_only": results["bitext_only"]["tests"],
    }


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.numerics
@pytest.mark.slow  # three small trainings, then again killed once in each step
def test_a_backtranslation_recipe_killed_in_each_step_ends_as_an_uninterrupted_run(
    setup, tmp_path, monkeypatch, one_torch_thread
):
    cfg, _, mirror = setup
    whole = tmp_path / "whole"
    results = run_pipeline(cfg, whole, mirror=mirror, console=QUIET)
    expected = outcome(whole)

    # One vocabulary for all: the bitext's, with <BT> reserved, in the reverse, forward and bitext models
    spm = (whole / "bitext" / "data" / "spm.model").read_bytes()
    assert BT_TAG in Subword(spm).tags
    for model in (
        "reverse/checkpoints/average.pt",
        "checkpoints/average.pt",
        "bitext/checkpoints/average.pt",
    ):
        assert load_checkpoint(whole / model).subword_proto == spm, model
    # The reverse model translates yy -> xx; the synthetic pairs have its xx beside the real yy lines
    rev = load_checkpoint(whole / "reverse" / "checkpoints" / "average.pt").config
    assert (rev.data.src_lang, rev.data.tgt_lang) == ("yy", "xx")
    synthetic_yy = expected["synthetic"][1].splitlines()
    mono = (tmp_path / "mirror" / "mono.yy").read_text().splitlines()
    assert 0 < len(synthetic_yy) <= 250 and set(synthetic_yy) <= set(mono)
    # Every synthetic source begins with <BT> by id in the forward model's data; no real one does
    stats = json.loads((whole / "data" / "stats.json").read_text())
    assert [g["corpus"] for g in stats["groups"]] == ["train", "backtranslated"]
    assert 0 < stats["groups"][1]["pairs"] <= results["backtranslation"]["pairs"]
    data = ParallelData(whole / "data" / "train")
    bt_id = Subword(spm).tags[BT_TAG]
    real = stats["groups"][0]["pairs"]
    assert len(data) == real + stats["groups"][1]["pairs"]
    assert all(int(data.src(i)[0]) != bt_id for i in range(real))
    assert all(int(data.src(i)[0]) == bt_id for i in range(real, len(data)))
    # results.md: the forward model against the same recipe without the synthetic corpus
    md = (whole / "results.md").read_text()
    assert "## Back-translation" in md and "bitext only" in md
    assert results["bitext_only"]["tests"].keys() == results["tests"].keys()

    def under(folder):
        return lambda ckpt_dir, *a, **k: str(ckpt_dir).startswith(str(resumed / folder))

    def binarizing(folder):
        return lambda data, out, *a, **k: str(out) == str(resumed / folder / "data")

    kills = [
        ("bitext", lambda m: kill_after(m, nmt.data.preprocess, "binarize", binarizing("bitext"))),
        ("reverse data", lambda m: kill_after(m, nmt.data.preprocess, "binarize", binarizing("reverse"))),
        (
            "reverse train",
            lambda m: kill_after(m, nmt.train.loop, "save_training_checkpoint", under("reverse")),
        ),
        (
            "backtranslate",
            lambda m: kill_after(
                m, atomic, "write_text", lambda path, *a, **k: str(path).endswith("00000.jsonl")
            ),
        ),
        ("forward data", lambda m: kill_after(m, nmt.data.preprocess, "binarize", binarizing(""))),
        (
            "forward train",
            lambda m: kill_after(m, nmt.train.loop, "save_training_checkpoint", under("checkpoints")),
        ),
        ("translate", lambda m: kill_after(m, nmt.pipeline, "translate_test_file")),
        (
            "baseline train",
            lambda m: kill_after(m, nmt.train.loop, "save_training_checkpoint", under("bitext")),
        ),
    ]
    resumed = tmp_path / "resumed"
    for step, arm in kills:
        with monkeypatch.context() as m:
            arm(m)
            with pytest.raises(Killed):
                run_pipeline(cfg, resumed, mirror=mirror, console=QUIET)
        assert not (resumed / "results.json").exists() or step == "baseline train", step
    run_pipeline(cfg, resumed, mirror=mirror, console=QUIET)
    got = outcome(resumed)
    for key in ("weights", "reverse"):
        assert same_weights(got.pop(key), expected.pop(key)), key
    assert got == expected

    # Another method on resume would mix two corpora: one line naming the recipe's key, nothing changed
    other = dataclasses.replace(
        cfg.data, backtranslate=dataclasses.replace(cfg.data.backtranslate, method="beam")
    )
    with pytest.raises(ConfigError, match=r"data\.backtranslate\.method differs\); restore them"):
        run_pipeline(dataclasses.replace(cfg, data=other), resumed, mirror=mirror, console=QUIET)
    assert outcome(resumed)["synthetic"] == expected["synthetic"]


def test_a_backtranslation_recipe_is_checked_once_in_one_line(setup, tmp_path):
    _, raw, _ = setup
    bt = raw["data"]["backtranslate"]
    for key, value, why in [
        ("mono", [], "names no monolingual file"),
        ("max_lines", 0, "must be positive"),
        ("max_lines", 2**41, "must be at most 1,099,511,627,776"),  # nmt backtranslate --max-lines's bound
        ("seed", -1, "must be at least 0"),  # and --seed's: refused before the reverse model trains
        ("weight", 0, "must be positive"),
        ("reverse_minutes", -1, "must be positive"),
        ("name", "train", "already names a training corpus"),
        ("method", "nucleus", "is not one of"),
    ]:
        bad = json.loads(json.dumps(raw))
        bad["data"]["backtranslate"] = {**bt, key: value}
        with pytest.raises(ConfigError, match=f"data.backtranslate.{key}: .*{why}"):
            config_from_dict(bad, "r.yaml")


def test_the_reverse_recipe_swaps_every_pair_and_keeps_the_model(setup):
    cfg, _, _ = setup
    rev = reverse_config(cfg)
    assert (rev.data.src_lang, rev.data.tgt_lang) == ("yy", "xx")
    assert rev.data.train[0].src == cfg.data.train[0].tgt and rev.data.valid[0].tgt == cfg.data.valid[0].src
    assert rev.data.test == () and rev.data.backtranslate is None
    assert rev.model == cfg.model and rev.data.vocab_size == cfg.data.vocab_size


def test_preprocess_and_train_alone_refuse_a_backtranslation_recipe(setup, tmp_path):
    import yaml

    _, raw, mirror = setup
    recipe = tmp_path / "bt.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    for command in ("preprocess", "train"):
        result = cli(command, recipe, "-w", tmp_path / "w")
        assert result.returncode == 2, result.stderr
        assert "nmt run" in one_error_line(result.stderr, "data.backtranslate")
    assert not (tmp_path / "w").exists()


def test_nmt_backtranslate_reads_the_recipes_monolingual_text_through_the_mirror(
    tmp_path, monkeypatch, synthetic_run, one_torch_thread
):
    """`nmt backtranslate RECIPE` without --mono: the recipe's data.backtranslate.mono, fetched and checked
    as every corpus is, gives the corpus --mono of the same file gives."""
    import yaml

    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    mirror = tmp_path / "mirror"
    raw, text = swapped_recipe(mirror, 30)
    recipe = tmp_path / "yy-xx-bt.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    reverse_model = synthetic_run / "checkpoints" / "best.pt"
    args = ("-r", reverse_model, "--method", "greedy", "-w", tmp_path / "w")
    got = cli("backtranslate", recipe, *args, "-o", tmp_path / "a", "--mirror", mirror)
    assert got.returncode == 0, got.stderr
    want = cli("backtranslate", *args, "--mono", mirror / "mono.xx", "-o", tmp_path / "b")
    assert want.returncode == 0, want.stderr
    for lang in ("xx", "yy"):
        assert (tmp_path / f"a.{lang}").read_text() == (tmp_path / f"b.{lang}").read_text() != ""
    (mirror / "mono.xx").write_text(text + "one more line\n")  # the mirror's copy is not the recipe's
    bad = cli("backtranslate", recipe, *args, "-o", tmp_path / "c", "--mirror", mirror)
    assert bad.returncode == 2
    one_error_line(bad.stderr, "mono.xx")
    assert not (tmp_path / "c.work").exists()


def test_a_reverse_model_in_the_work_directory_is_refused_before_anything_is_written(setup, tmp_path):
    import yaml

    _, raw, mirror = setup
    work = tmp_path / "w"
    for inside in ("reverse/checkpoints/average.pt", "checkpoints/average.pt", "backtranslate/r.pt"):
        reverse_model = work / inside
        reverse_model.parent.mkdir(parents=True, exist_ok=True)
        reverse_model.write_bytes(b"a checkpoint")
        raw["data"]["backtranslate"]["reverse"] = str(reverse_model)
        recipe = tmp_path / "bt.yaml"
        recipe.write_text(yaml.safe_dump(raw))
        result = cli("run", recipe, "-w", work, "--mirror", mirror)
        assert result.returncode == 2, result.stderr
        one_error_line(result.stderr, str(work), "--workdir")
        assert reverse_model.read_bytes() == b"a checkpoint"
        assert not (work / "bitext").exists() and not (work / "data").exists()


@pytest.mark.slow  # two small trainings
def test_a_given_reverse_model_is_used_and_its_vocabulary_becomes_the_recipes(
    tmp_path, monkeypatch, synthetic_run, one_torch_thread
):
    """data.backtranslate.reverse: no reverse model is trained; the given one's SentencePiece model is the
    one every model of the run has. Without <BT> in it, tagged back-translation is refused in one line."""
    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    mirror = tmp_path / "mirror"
    reverse_model = synthetic_run / "checkpoints" / "best.pt"
    raw, _ = swapped_recipe(mirror, 40, reverse=str(reverse_model), baseline=False)
    with pytest.raises(ConfigError, match=r"^data.backtranslate.reverse: .* has no <BT> in its vocabulary"):
        run_pipeline(config_from_dict(raw), tmp_path / "tagged", mirror=str(mirror), console=QUIET)
    raw["data"]["backtranslate"]["tag"] = False
    raw["data"]["backtranslate"]["warm_start"] = True  # the given model is of another shape
    shape = r"^data.backtranslate.warm_start: .* has model\.\w+ .*, the recipe"
    with pytest.raises(ConfigError, match=shape):
        run_pipeline(config_from_dict(raw), tmp_path / "warm", mirror=str(mirror), console=QUIET)
    assert not (tmp_path / "warm" / "checkpoints").exists()
    assert not (tmp_path / "warm" / "backtranslate").exists()  # refused before back-translating
    raw["data"]["backtranslate"]["warm_start"] = False
    work = tmp_path / "w"
    results = run_pipeline(config_from_dict(raw), work, mirror=str(mirror), console=QUIET)
    assert not (work / "reverse").exists()
    given = load_checkpoint(reverse_model).subword_proto
    assert load_checkpoint(work / "checkpoints" / "average.pt").subword_proto == given
    assert results["backtranslation"]["pairs"] > 0 and not results["backtranslation"]["tagged"]
    assert "## Back-translation" in (work / "results.md").read_text()


def first_loss(workdir) -> float:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in rows if r["kind"] == "train")


@pytest.mark.slow  # six small trainings
def test_warm_start_begins_the_forward_and_bitext_models_at_the_reverse_models_weights(
    setup, tmp_path, one_torch_thread
):
    """The reversal task is its own reverse: forward and bitext-only models that start from the reverse
    model's weights begin below where the same models begin from random weights; both start alike, so
    their comparison is of the synthetic pairs alone."""
    cfg, _, mirror = setup
    bt = dataclasses.replace(cfg.data.backtranslate, warm_start=True)
    warm = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, backtranslate=bt))
    work, cold = tmp_path / "warm", tmp_path / "cold"
    results = run_pipeline(warm, work, mirror=mirror, console=QUIET)
    run_pipeline(cfg, cold, mirror=mirror, console=QUIET)
    reverse_model = work / "reverse" / "checkpoints" / "average.pt"
    assert results["backtranslation"]["warm_start"] == str(reverse_model)
    for model in (".", "bitext"):
        started = load_checkpoint(work / model / "checkpoints" / "average.pt").config.data.init_from
        assert started == str(reverse_model), model
        assert first_loss(work / model) < first_loss(cold / model) - 0.2, model
    assert "started from the reverse model's weights" in (work / "results.md").read_text()


@pytest.mark.slow  # three small trainings, then the third again, killed
def test_compare_untagged_trains_the_same_pairs_without_bt_and_shows_both(
    setup, tmp_path, monkeypatch, one_torch_thread
):
    """Tagged against untagged (Caswell et al.): the same synthetic pairs, vocabulary, start and minutes,
    only the <BT> before each synthetic source gone; results.md shows both; a kill resumes."""
    cfg, raw, mirror = setup
    bt = dataclasses.replace(cfg.data.backtranslate, baseline=False, compare_untagged=True, warm_start=True)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, backtranslate=bt))
    work = tmp_path / "whole"
    results = run_pipeline(cfg, work, mirror=mirror, console=QUIET)

    spm = (work / "bitext" / "data" / "spm.model").read_bytes()
    bt_id = Subword(spm).tags[BT_TAG]
    tagged, untagged = (
        ParallelData(work / "data" / "train"),
        ParallelData(work / "untagged" / "data" / "train"),
    )
    real = json.loads((work / "untagged" / "data" / "stats.json").read_text())["groups"][0]["pairs"]
    assert real < len(untagged) == len(tagged)
    for i in range(len(tagged)):
        src = tagged.src(i).tolist()
        assert untagged.src(i).tolist() == (src[1:] if i >= real else src), i
        assert (src[0] == bt_id) == (i >= real) and bt_id not in untagged.src(i).tolist()
        assert torch.equal(untagged.tgt(i), tagged.tgt(i))
    model = load_checkpoint(work / "untagged" / "checkpoints" / "average.pt")
    assert model.subword_proto == spm
    assert model.config.data.init_from == results["backtranslation"]["warm_start"] is not None
    md = (work / "results.md").read_text()
    assert f"without `{BT_TAG}`" in md and "| untagged: BLEU / chrF |" in md
    assert results["untagged"]["tests"].keys() == results["tests"].keys()
    assert "bitext_only" not in results

    resumed = tmp_path / "resumed"
    with monkeypatch.context() as m:
        kill_after(
            m,
            nmt.train.loop,
            "save_training_checkpoint",
            lambda ckpt_dir, *a, **k: str(ckpt_dir).startswith(str(resumed / "untagged")),
        )
        with pytest.raises(Killed):
            run_pipeline(cfg, resumed, mirror=mirror, console=QUIET)
    again = run_pipeline(cfg, resumed, mirror=mirror, console=QUIET)
    averaged = [
        torch.load(w / "untagged" / "checkpoints" / "average.pt", weights_only=True)["model"]
        for w in (work, resumed)
    ]
    assert same_weights(*averaged)
    assert again["untagged"]["tests"] == results["untagged"]["tests"]

    # The comparison needs tagged pairs to compare: one line naming the key
    bad = json.loads(json.dumps(raw))
    bad["data"]["backtranslate"].update(tag=False, compare_untagged=True)
    with pytest.raises(ConfigError, match=r"data\.backtranslate\.compare_untagged: .*needs tag: true"):
        config_from_dict(bad, "r.yaml")
