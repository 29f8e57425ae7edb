"""Shared fixtures: the Multi30k mirror (or a skip that says how to enable it), one trained model, one tiny
random checkpoint; and the helpers several test files use (sentences, the CLI in-process, one error line,
a kill after a function's work)."""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from .synthetic import make_config, make_workdir

# ---- helpers imported by several test files ------------------------------------------------------------


def word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 7)))


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = [word(random.Random(i)) for i in range(300)]
    return [
        " ".join(rng.choice(words) for _ in range(rng.randint(1, 14))) + rng.choice(".!?,") for _ in range(n)
    ]


def cli(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """The command run in this process by typer's CliRunner: as `run`, without starting an interpreter."""
    from typer.testing import CliRunner

    from nmt.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], input=stdin)
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout_bytes, result.stderr_bytes)


def one_error_line(stderr: str | bytes, *names: str) -> str:
    text = stderr.decode() if isinstance(stderr, bytes) else stderr
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


class Killed(BaseException):
    """Stands for a kill: not an Exception, so nothing on the way catches it."""


def kill_after(monkeypatch, module, name, when=lambda *a, **k: True):
    """Make `module.name` do its work, then die (when `when` holds for its arguments)."""
    original = getattr(module, name)

    def dying(*args, **kwargs):
        result = original(*args, **kwargs)
        if when(*args, **kwargs):
            raise Killed(name)
        return result

    monkeypatch.setattr(module, name, dying)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Transformer with a SentencePiece model trained here, saved as `nmt train` would."""
    from nmt.config import config_from_dict
    from nmt.subword import train_sentencepiece
    from nmt.untrained import save_random_model

    d = tmp_path_factory.mktemp("model")
    sub = train_sentencepiece(sentences(3000, 0), d / "spm", 120, character_coverage=1.0)
    corpus = {"name": "x", "src": {"url": "http://127.0.0.1/x", "sha256": "0" * 64}}
    corpus["tgt"] = corpus["src"]
    cfg = config_from_dict(
        {
            "data": {"src_lang": "xx", "tgt_lang": "yy", "train": [corpus], "valid": [corpus]},
            "model": {
                "encoder_layers": 1,
                "decoder_layers": 1,
                "d_model": 32,
                "d_ff": 64,
                "heads": 4,
                "max_positions": 64,
            },
            "decode": {"beam": 3, "lenpen": 0.6, "max_len_a": 1.0, "max_len_b": 5},
        }
    )
    return save_random_model(d / "model.pt", cfg, sub, seed=0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on a shared 2-core machine: one torch thread avoids oversubscription stalls."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def multi30k_mirror() -> Path:
    """The folder of verbatim Multi30k files named by NMT_DATA_MIRROR (.ci/run sets it)."""
    value = os.environ.get("NMT_DATA_MIRROR")
    if not value:
        pytest.skip("needs the Multi30k files: set NMT_DATA_MIRROR=/path/to/multi30k to run")
    path = Path(value)
    if not (path / "train.en.gz").is_file():
        pytest.skip(f"NMT_DATA_MIRROR={value} holds no train.en.gz; point it at a Multi30k mirror folder")
    return path.resolve()


@pytest.fixture(scope="session")
def synthetic_run(tmp_path_factory) -> Path:
    """A work directory with a model trained on the reversal task by the real trainer (about 30 s).

    Shared by every test that needs a model that has actually learned something: search, translation,
    export; read, never written. Returns the work directory; the model is checkpoints/best.pt.
    """
    return shared_once(tmp_path_factory, "synthetic-run", train_synthetic_run)


def train_synthetic_run(workdir: Path) -> None:
    from nmt.train import train

    make_workdir(workdir)
    # This task has loss spikes late in training, and where one falls depends on rounding: at a constant
    # end of the schedule the model learned 85 of 100 validation lines with AVX-512 kernels and 98 with
    # AVX2 ones. Clipping and a linear cool-down over the last 30% end it on a settled model (98-100
    # with either); best.pt is the best of three validations.
    cfg = make_config(
        max_steps=450,
        threads=2,
        peak_lr=0.002,
        validate_every=150,
        save_every=150,
        cooldown=0.3,
        clip_norm=1.0,
    )
    train(cfg, workdir)


def shared_once(tmp_path_factory, name: str, make) -> Path:
    """The folder `name` that `make(folder)` fills, made once per test run: with pytest-xdist
    (`make test-fast` runs two workers) the first worker to ask makes it under a lock in the run's
    common base folder and the others wait and reuse it, rather than each spending the same training."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' folders sit side by side in the run's own
    folder, done = base / name, base / f"{name}.done"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when a worker dies
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that died halfway left it
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


try:  # Hostile inputs (tests/test_hostile.py): bounded examples, so the suite stays fast on 2 cores
    from hypothesis import settings

    settings.register_profile("nmt", max_examples=25, deadline=None, derandomize=True)
    settings.load_profile("nmt")
except ImportError:  # hypothesis is in the dev extra; without it those tests skip
    pass
