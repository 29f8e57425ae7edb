"""`nmt score` against the real `sacrebleu` command on generated files: same numbers, same signatures."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nmt.cli import app
from nmt.score import bleu, corpus_scores, paired_bootstrap, read_lines

N_LINES = 150
WORDS = (
    "der die das Hund Katze läuft schnell über den Platz ein Mann fährt Rad Kinder spielen im Park .".split()
)


def _sentence(rng: random.Random) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]


def _perturb(rng: random.Random, words: list[str], rate: float) -> str:
    out = [w for w in words if rng.random() > rate]  # drop some words
    out = [rng.choice(WORDS) if rng.random() < rate else w for w in out]  # replace some
    return " ".join(out)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Two references, a good hypothesis and a degraded one, with the awkward bits sacrebleu tolerates."""
    rng = random.Random(1234)
    d = tmp_path_factory.mktemp("score")
    sents = [_sentence(rng) for _ in range(N_LINES)]
    ref = [" ".join(s) for s in sents]
    ref2 = [_perturb(rng, s, 0.1) for s in sents]
    good = [_perturb(rng, s, 0.15) for s in sents]
    bad = [_perturb(rng, s, 0.5) for s in sents]
    good[3] += "   "  # trailing spaces are stripped
    good[5] = "Straße\rmitten"  # "\r" inside a line: not a line break for sacrebleu, nor for us
    good[7] = ""  # an empty hypothesis line still counts
    out = {}
    for name, lines in {"ref": ref, "ref2": ref2, "good": good, "bad": bad}.items():
        out[name] = d / f"{name}.de"
        out[name].write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
    return out


def sacrebleu_cli(*args: str | Path) -> str:
    """stdout of the installed sacrebleu console script."""
    env = {k: v for k, v in os.environ.items() if k not in ("SACREBLEU_FORMAT", "SACREBLEU_SEED")}
    proc = subprocess.run(
        [sys.executable, "-m", "sacrebleu", *map(str, args), "-q", "--no-color"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return proc.stdout


def sacrebleu_json(*args: str | Path) -> list[dict]:
    out = json.loads(sacrebleu_cli(*args, "-f", "json"))
    return out if isinstance(out, list) else [out]


runner = CliRunner()


def nmt_score(*args: str | Path, input: str | None = None):
    return runner.invoke(app, ["score", *map(str, args)], input=input)


def user_error(result) -> str:
    """The one-line message of a user error: exit status 2, nothing on stdout, no traceback."""
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert isinstance(result.exception, SystemExit)  # not a traceback-worthy exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("metrics", [["bleu"], ["bleu", "chrf", "ter"]])
@pytest.mark.parametrize("refs", [["ref"], ["ref", "ref2"]])
def test_json_equals_sacrebleu(files, metrics, refs):
    ref_paths = [files[r] for r in refs]
    result = nmt_score(
        *[a for p in ref_paths for a in ("-r", p)],
        "-i",
        files["good"],
        "--metrics",
        ",".join(metrics),
        "--json",
    )
    assert result.exit_code == 0, result.output
    ours = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert list(ours) == metrics

    theirs = sacrebleu_json(*ref_paths, "-i", files["good"], "-m", *metrics, "-w", "4")
    for name, their in zip(metrics, theirs, strict=True):
        assert ours[name]["name"] == their["name"]
        assert f"{ours[name]['score']:.4f}" == f"{their['score']:.4f}"
        assert ours[name]["signature"] == their["signature"]


def test_text_report_equals_sacrebleu(files):
    """The default human line is sacrebleu's, digit for digit (width 1 like the sacrebleu command)."""
    result = nmt_score("-r", files["ref"], "-i", files["good"])
    assert result.exit_code == 0, result.output
    ours = result.stdout.strip()
    theirs = sacrebleu_cli(files["ref"], "-i", files["good"], "-f", "text").strip()
    # sacrebleu puts the signature into the name ("BLEU|nrefs:1|... = 27.3 ..."); we print it apart.
    assert ours.startswith("BLEU = ")
    assert ours.split(" = ", 1)[1] == theirs.split(" = ", 1)[1]


def test_stdin_and_library_agree(files):
    hyp_text = files["good"].read_bytes().decode("utf-8")  # keep the "\r"
    result = nmt_score("-r", files["ref"], "--json", "--width", "4", input=hyp_text)
    assert result.exit_code == 0, result.output
    from_stdin = json.loads(result.stdout)["bleu"]["score"]

    hyps, refs = read_lines(files["good"]), read_lines(files["ref"])
    assert len(hyps) == N_LINES
    assert corpus_scores(hyps, [refs])["bleu"].score == from_stdin
    assert bleu(hyps, refs) == from_stdin  # one reference stream given bare
    assert bleu(hyps, [refs]) == from_stdin


def test_paired_bootstrap_equals_sacrebleu(files):
    comparisons = paired_bootstrap(
        [("bad", read_lines(files["bad"])), ("good", read_lines(files["good"]))],
        [read_lines(files["ref"])],
        metrics=("bleu", "chrf"),
    )
    # sacrebleu's own JSON writer fails on paired results (numpy float32), so read its text table.
    theirs = sacrebleu_cli(
        files["ref"],
        "-i",
        files["bad"],
        files["good"],
        "-m",
        "bleu",
        "chrf",
        "--paired-bs",
        "-w",
        "4",
        "-f",
        "text",
    )
    for name in ("bleu", "chrf"):
        base, new = comparisons[name].systems
        assert base.p_value is None
        # The better system beats its degraded copy, significantly.
        assert new.score > base.score and new.p_value < 0.05
        for s in (base, new):
            assert f"{s.score:.4f} ({s.mean:.4f} ± {s.ci:.4f})" in theirs
        assert f"(p = {new.p_value:.4f})*" in theirs
        assert f"- {comparisons[name].name}" in theirs and comparisons[name].signature in theirs


@pytest.mark.parametrize("metric", ["bleu", "chrf", "ter"])
def test_a_system_compared_with_its_own_copy_is_never_significant(files, tmp_path, metric):
    copy = tmp_path / "copy.de"
    copy.write_bytes(files["bad"].read_bytes())
    result = nmt_score(
        "-r", files["ref"], "-i", files["bad"], "-i", copy, "-i", files["good"], "--metrics", metric, "--json"
    )
    assert result.exit_code == 0, result.output
    base, same, better = json.loads(result.stdout)[metric]["systems"]
    # sacreBLEU's own test says p = 1 / 1001 for the copy: no resample differs by more than nothing.
    assert same["score"] == base["score"] and same["p_value"] == 1.0
    assert better["p_value"] < 0.05  # a clearly better system still is significant, in the same run
    table = nmt_score("-r", files["ref"], "-i", files["bad"], "-i", copy, "--metrics", metric)
    assert "1.0000" in table.stdout and "*" not in table.stdout


def test_two_systems_cli_table_and_json(files):
    result = nmt_score("-r", files["ref"], "-i", files["bad"], "-i", files["good"])
    assert result.exit_code == 0, result.output
    table = result.stdout
    assert "baseline: " + str(files["bad"]) in table
    good_row = next(line for line in table.splitlines() if line.strip().startswith(str(files["good"])))
    assert "*" in good_row  # p-value below 0.05, marked as sacrebleu marks it

    result = nmt_score("-r", files["ref"], "-i", files["bad"], "-i", files["good"], "--json")
    assert result.exit_code == 0, result.output
    systems = json.loads(result.stdout)["bleu"]["systems"]
    assert [s["system"] for s in systems] == [str(files["bad"]), str(files["good"])]
    assert systems[0]["p_value"] is None and 0 < systems[1]["p_value"] < 0.05

    # chrF's bootstrap statistics come back from sacrebleu as numpy float32: still valid JSON.
    result = nmt_score(
        "-r", files["ref"], "-i", files["bad"], "-i", files["good"], "--json", "--metrics", "chrf,ter"
    )
    assert result.exit_code == 0, result.output
    assert list(json.loads(result.stdout)) == ["chrf", "ter"]


def test_line_count_mismatch_names_both_files(files, tmp_path):
    short = tmp_path / "short.de"
    short.write_text("\n".join(read_lines(files["good"])[:-2]) + "\n", encoding="utf-8")
    message = user_error(nmt_score("-r", files["ref"], "-i", short))
    assert str(short) in message and str(files["ref"]) in message
    assert str(N_LINES - 2) in message and str(N_LINES) in message


def test_missing_file_and_unknown_metric(files, tmp_path):
    missing = tmp_path / "nope.de"
    assert str(missing) in user_error(nmt_score("-r", files["ref"], "-i", missing))
    assert str(missing) in user_error(nmt_score("-r", missing, "-i", files["good"]))
    message = user_error(nmt_score("-r", files["ref"], "-i", files["good"], "--metrics", "bleu,blue"))
    assert "'blue'" in message and "bleu" in message


def test_error_is_one_line_with_exit_status_2(files, tmp_path):
    """Through the real console entry point: one red line on stderr, no traceback, exit status 2."""
    missing = tmp_path / "nope.de"
    proc = subprocess.run(
        [sys.executable, "-m", "nmt", "score", "-r", str(files["ref"]), "-i", str(missing)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: no such file: {missing}"]


def test_the_off_target_share_chooses_among_the_models_languages():
    """Czech captions that py3langid, choosing among all 97 languages, calls Slovak (three references of
    test_2016_flickr.cs) count as Czech among a model's languages; a line left in English or written in
    German still counts against it."""
    pytest.importorskip("py3langid")
    from nmt.score import language_share

    czech = ["Auto zaparkované na pláži.", "Muž a chlapec na skalnaté pláži.", "Černý chlapec sedí v písku."]
    wrong = ["A man and a boy on a rocky beach.", "Ein Mann und ein Junge an einem felsigen Strand."]
    assert language_share(czech, "cs") < 1  # the neighbours: why a model's own languages are the choice
    assert language_share(czech + wrong + ["  "], "ces", among=("en", "de", "fr", "cs")) == 3 / 5
    assert language_share(czech, "cs", among=("en", "de")) == 1  # the target is always a choice
