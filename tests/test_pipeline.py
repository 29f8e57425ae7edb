"""`nmt run` end to end on Multi30k, shrunk to seconds: every step runs, results.md appears, re-runs skip."""

from __future__ import annotations

import json

import pytest
import sacrebleu
from typer.testing import CliRunner

from nmt.cli import app

TINY = [
    "data.vocab_size=1000",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "model.d_model=32",
    "model.d_ff=64",
    "model.heads=2",
    "train.max_steps=6",
    "train.save_every=2",
    "train.validate_every=6",
    "train.valid_bleu=false",
    "train.average_last=2",
    "train.threads=1",
    "train.compile=false",
    "train.precision=fp32",  # the same model on every CPU (auto is bf16 where it is native)
    "decode.beam=2",
    "decode.max_len_b=3",
]


def run(workdir, mirror):
    args = ["run", "multi30k-en-de", "--workdir", str(workdir), "--mirror", str(mirror)]
    for item in TINY:
        args += ["--set", item]
    return CliRunner().invoke(app, args)


@pytest.mark.slow  # the whole pipeline twice
def test_nmt_run_writes_results_and_resumes(tmp_path, multi30k_mirror, monkeypatch):
    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    workdir = tmp_path / "run"
    result = run(workdir, multi30k_mirror)
    assert result.exit_code == 0, result.output
    results = json.loads((workdir / "results.json").read_text())
    test = results["tests"]["test_2016_flickr"]
    assert test["bleu"]["signature"].startswith("nrefs:1")
    assert "tok_bleu_compound_split" in test and test["speed"]["sentences"] == 1000
    assert results["training"]["updates"] == 6
    hyps = (workdir / "translations" / "test_2016_flickr.de").read_text().split("\n")
    assert len(hyps) == 1001 and hyps[-1] == ""
    # the scores are those of the written translations against the test set's references
    refs = (workdir / "data" / "test" / "test_2016_flickr.de").read_text().splitlines()
    assert test["bleu"]["score"] == round(sacrebleu.corpus_bleu(hyps[:-1], [refs]).score, 2)
    assert test["chrf"]["score"] == round(sacrebleu.corpus_chrf(hyps[:-1], [refs]).score, 2) > 0
    md = (workdir / "results.md").read_text()
    assert "test_2016_flickr" in md and "sacreBLEU" in md
    assert (workdir / "checkpoints" / "average.pt").exists()

    again = run(workdir, multi30k_mirror)
    assert again.exit_code == 0, again.output
    assert "already finished" in again.output and "average: already done" in again.output
    assert "translate test_2016_flickr: already done" in again.output


@pytest.mark.slow  # 10 s: a whole nmt run, killed and resumed
def test_an_interrupted_nmt_run_writes_no_results_and_continues_next_time(tmp_path, multi30k_mirror):
    import os
    import signal
    import subprocess
    import sys
    import time

    workdir = tmp_path / "run"
    env = {
        **os.environ,
        "NMT_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }

    def nmt_run(*overrides: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "nmt", "run", "multi30k-en-de", "--workdir", str(workdir)]
        cmd += ["--mirror", str(multi30k_mirror)]
        for item in [*TINY, *overrides]:
            cmd += ["--set", item]
        return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)

    proc = nmt_run("train.max_steps=100000", "train.log_every=1")
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not metrics.exists() or len(metrics.read_text().split("\n")) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert not (workdir / "results.json").exists() and not (workdir / "translations").exists()
    assert not (workdir / "checkpoints" / "average.pt").exists()

    done = nmt_run("train.max_steps=8")  # the same run, continued to its end
    err = done.communicate(timeout=300)[1]
    assert done.returncode == 0, err[-3000:]
    assert "resuming from" in err
    assert json.loads((workdir / "results.json").read_text())["training"]["updates"] == 8
