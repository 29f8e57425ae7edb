"""The trainer: it learns, it resumes exactly, it never loses work, and DDP equals accumulation."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from nmt.checkpoint import load_checkpoint, load_model, step_checkpoints
from nmt.cli import app
from nmt.config import config_to_dict
from nmt.data.batching import collate
from nmt.data.binarized import ParallelData
from nmt.device import cpu_bf16_native
from nmt.errors import NmtError
from nmt.train import train
from nmt.train.optim import inverse_sqrt_lr, lr_scale

from .synthetic import make_config, make_workdir

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def write_recipe(path: Path, cfg) -> Path:
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    return path


def nmt_train(recipe: Path, workdir: Path, *extra: str, env: dict | None = None, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nmt", "train", str(recipe), "--workdir", str(workdir), *extra]
    return subprocess.Popen(
        cmd, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    )


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path).model_state


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """Preprocessed data of the reversal task, shared by the tests of this module (copied per test)."""
    root = tmp_path_factory.mktemp("synthetic")
    make_workdir(root)
    return root / "data"


def fresh_workdir(tmp_path: Path, data: Path, name: str = "run") -> Path:
    workdir = tmp_path / name
    workdir.mkdir()
    (workdir / "data").symlink_to(data)
    return workdir


def test_the_reversal_task_is_learned(synthetic_run):
    """The session's shared model (450 updates, well under a minute on 2 cores) reverses sequences."""
    model, _, _ = load_model(synthetic_run / "checkpoints" / "best.pt")
    valid = ParallelData(synthetic_run / "data" / "valid")
    src, tgt_in, tgt_out = collate(valid, torch.arange(len(valid)))
    with torch.no_grad():
        predicted = model(src, tgt_in).argmax(-1)
    real = tgt_out != 0
    accuracy = ((predicted == tgt_out) & real).sum().item() / real.sum().item()
    assert accuracy > 0.95, f"token accuracy {accuracy:.3f}"
    lines = (synthetic_run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= 45 and '"kind": "train"' in lines[0]


def killed_and_resumed_equals_straight(tmp_path: Path, data: Path, cfg, env: dict | None = None) -> None:
    """Train to max_steps straight, and again killed (SIGKILL) after its first checkpoint then resumed:
    the final parameters must be bit-identical."""
    recipe = write_recipe(tmp_path / "r.yaml", cfg)
    straight = fresh_workdir(tmp_path, data, "a")
    proc = nmt_train(recipe, straight, env=env)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()

    killed = fresh_workdir(tmp_path, data, "b")
    proc = nmt_train(recipe, killed, env=env)
    deadline = time.monotonic() + 120
    while not (killed / "checkpoints" / "last.pt").exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    final = f"step-{cfg.train.max_steps}.pt"
    assert step_checkpoints(killed / "checkpoints")[-1].name != final
    resumed = nmt_train(recipe, killed, env=env)
    out = resumed.communicate(timeout=300)[1]
    assert resumed.returncode == 0, out
    assert "resuming from" in out
    a, b = weights(straight / "checkpoints" / "last.pt"), weights(killed / "checkpoints" / "last.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), max((a[k] - b[k]).abs().max().item() for k in a)
    progress = load_checkpoint(killed / "checkpoints" / "last.pt").train_state["progress"]
    assert progress["step"] == cfg.train.max_steps


@pytest.mark.slow
def test_a_killed_run_resumes_to_exactly_the_same_parameters(tmp_path, synthetic):
    killed_and_resumed_equals_straight(tmp_path, synthetic, make_config(max_steps=60, save_every=20))


@pytest.mark.slow
def test_a_killed_run_on_augmented_data_resumes_to_exactly_the_same_parameters(tmp_path, monkeypatch):
    """data.augment on: the pairs nmt preprocess modified are what a resumed run reads again."""
    import hashlib
    import random

    from nmt.config import config_from_dict
    from nmt.data.preprocess import preprocess

    from .synthetic import reverse, sentence

    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    rng, mirror = random.Random(3), tmp_path / "mirror"
    mirror.mkdir()
    src = [sentence(rng, 2) + "." for _ in range(1500)]
    (mirror / "c.xx").write_text("".join(s + "\n" for s in src))
    (mirror / "c.yy").write_text("".join(reverse(s[:-1]) + " ." + "\n" for s in src))
    spec = {
        side: {
            "url": f"https://upstream.invalid/c.{side}",
            "sha256": hashlib.sha256((mirror / f"c.{side}").read_bytes()).hexdigest(),
        }
        for side in ("xx", "yy")
    }
    corpus = {"name": "c", "src": spec["xx"], "tgt": spec["yy"]}
    augment = {"uppercase": 0.2, "titlecase": 0.1, "typos": 0.1, "remove_end_punct": 0.3}
    base = config_to_dict(make_config(max_steps=40, save_every=10))
    base["data"] = {
        "src_lang": "xx",
        "tgt_lang": "yy",
        "train": [corpus],
        "valid": [corpus],
        "vocab_size": 64,
        "max_ratio": 3.0,
        "max_subwords": 60,
        "augment": augment,
    }
    cfg = config_from_dict(base)
    stats = preprocess(cfg, tmp_path / "prepared", mirror=str(mirror))
    assert stats["train"]["augmented"]["uppercase"] > 0
    killed_and_resumed_equals_straight(tmp_path, tmp_path / "prepared" / "data", cfg)


@pytest.mark.slow
def test_a_compiled_run_with_dropout_resumes_exactly_on_two_threads(tmp_path, synthetic):
    """train.compile: compiled CPU kernels on several threads used to add in whatever order threads
    finished, and dropout draws random numbers that a resume must restore."""
    cfg = make_config(max_steps=30, save_every=10, compile=True, threads=2)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.1))
    killed_and_resumed_equals_straight(tmp_path, synthetic, cfg, env={**ENV, "OMP_NUM_THREADS": "2"})


@pytest.mark.slow  # 4 s: a training stopped by a signal
def test_sigterm_saves_a_checkpoint_then_exits(tmp_path, synthetic):
    # precision auto: the log line must say what auto chose on this CPU
    cfg = make_config(max_steps=100000, save_every=100000, log_every=1, precision="auto")
    recipe = write_recipe(tmp_path / "r.yaml", cfg)
    workdir = fresh_workdir(tmp_path, synthetic)
    proc = nmt_train(recipe, workdir)
    deadline = time.monotonic() + 120
    while (
        not (workdir / "metrics.jsonl").exists() or len((workdir / "metrics.jsonl").read_text().split()) < 5
    ):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 128 + signal.SIGTERM, err  # so schedulers and `nmt run` see the interruption
    assert "stopped by SIGTERM" in err and "run the same command to resume" in err
    chosen = "bfloat16 autocast" if cpu_bf16_native() else "fp32"
    assert f"precision {chosen} (train.precision=auto), compile off" in " ".join(err.split())
    step = load_checkpoint(workdir / "checkpoints" / "last.pt").train_state["progress"]["step"]
    assert step >= 1


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
def test_a_corrupt_last_checkpoint_falls_back_to_the_previous_one(tmp_path, synthetic):
    workdir = fresh_workdir(tmp_path, synthetic)
    train(make_config(max_steps=20, save_every=10), workdir)
    last = workdir / "checkpoints" / "last.pt"
    last.unlink()
    last.write_bytes(b"PK\x03\x04 truncated")
    from rich.console import Console

    console = Console(stderr=True, record=True, width=400)
    train(make_config(max_steps=30, save_every=10), workdir, console=console)
    text = console.export_text()
    assert "last.pt: not a readable nmt checkpoint" in text
    assert "resuming from" in text and "last.prev.pt (step 10)" in text
    assert load_checkpoint(last).train_state["progress"]["step"] == 30


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
def test_a_damaged_last_checkpoint_is_set_aside_with_the_steps_written_after_the_one_resumed(
    tmp_path, synthetic
):
    from rich.console import Console

    workdir = fresh_workdir(tmp_path, synthetic)
    cfg = make_config(max_steps=30, save_every=10)
    train(cfg, workdir)
    ckpts = workdir / "checkpoints"
    data = bytearray((ckpts / "last.pt").read_bytes())  # 64 flipped bytes: the size stays, torch loads it
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(
        b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 64]
    )
    (ckpts / "last.pt").write_bytes(bytes(data))
    console = Console(stderr=True, record=True, width=400)
    train(cfg, workdir, console=console)  # steps 21-30 again, from last.prev.pt
    text = console.export_text()
    assert "last.pt: damaged checkpoint" in text and "last.prev.pt (step 20)" in text
    # The damaged file and what the abandoned run wrote after step 20 are kept aside, not averaged.
    assert sorted(p.name for p in (ckpts / "set-aside").iterdir()) == ["best.pt", "last.pt", "step-30.pt"]
    # Nothing unverified was rotated into last.prev.pt: it is still the good step 20.
    assert load_checkpoint(ckpts / "last.prev.pt").train_state["progress"]["step"] == 20
    assert load_checkpoint(ckpts / "last.pt").train_state["progress"]["step"] == 30
    for path in [*step_checkpoints(ckpts), ckpts / "best.pt"]:
        load_checkpoint(path)


def test_step_checkpoints_hold_weights_only_and_average(tmp_path, synthetic):
    from nmt.checkpoint import average_checkpoints

    workdir = fresh_workdir(tmp_path, synthetic)
    train(make_config(max_steps=30, save_every=10), workdir)
    ckpts = workdir / "checkpoints"
    steps = step_checkpoints(ckpts)
    assert [p.name for p in steps] == ["step-10.pt", "step-20.pt", "step-30.pt"]
    assert all(load_checkpoint(p).train_state is None for p in steps)
    assert load_checkpoint(ckpts / "last.pt").train_state["optimizer"]["state"]
    assert load_checkpoint(ckpts / "last.prev.pt").train_state["progress"]["step"] == 20
    assert steps[-1].stat().st_size * 2 < (ckpts / "last.pt").stat().st_size  # Adam's moments are only there
    average_checkpoints(steps, ckpts / "average.pt")
    averaged = load_checkpoint(ckpts / "average.pt").model_state
    each = [load_checkpoint(p).model_state for p in steps]
    for k, v in averaged.items():
        if v.is_floating_point():
            assert torch.allclose(v, sum(w[k] for w in each) / 3, atol=1e-6), k


@pytest.mark.parametrize("how", ["free space", "disk full during the write"])
def test_a_save_without_disk_space_is_one_line_and_leaves_the_earlier_checkpoints(
    tmp_path, synthetic, monkeypatch, how
):
    import errno
    import shutil

    workdir = fresh_workdir(tmp_path, synthetic)
    train(make_config(max_steps=10, save_every=10), workdir)
    ckpts = workdir / "checkpoints"
    before = {p.name: p.read_bytes() for p in ckpts.iterdir()}
    if how == "free space":
        usage = shutil.disk_usage(ckpts)
        monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=10 * 2**20))
    else:
        real_save = torch.save

        def full_disk(obj, f, *a, **kw):
            real_save(obj, f, *a, **kw)  # some bytes reach the temporary file first
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(NmtError, match="intact") as e:
        train(make_config(max_steps=20, save_every=10), workdir)
    # checked before the save: a refusal (exit 2); the write itself failing: a write error (exit 1)
    assert "\n" not in str(e.value) and e.value.exit_code == (2 if how == "free space" else 1)
    monkeypatch.undo()
    after = {p.name: p.read_bytes() for p in ckpts.iterdir()}
    assert set(after) <= set(before) | {"step-20.pt"}  # no temporary file left behind
    assert all(after[name] == data for name, data in before.items())
    assert load_checkpoint(ckpts / "last.pt").train_state["progress"]["step"] == 10


def test_dry_run_says_how_much_disk_the_checkpoints_take():
    from rich.console import Console

    from nmt.config import load_config
    from nmt.train import dry_run

    console = Console(record=True, width=300)
    params = dry_run(load_config("wmt14-en-de-big"), console=console)
    text = console.export_text()
    weights = params * 4 / 2**30
    assert f"disk: about {(20 + 2) * weights + 6 * weights:.2f} GiB" in text


def test_non_finite_losses_are_skipped_then_stop_training(tmp_path, synthetic, monkeypatch):
    import nmt.train.update as trainer

    workdir = fresh_workdir(tmp_path, synthetic)
    train(make_config(max_steps=5, save_every=5), workdir)
    real = trainer.batch_loss

    def poisoned(*args, **kwargs):
        loss, nll = real(*args, **kwargs)
        return loss * float("nan"), nll

    monkeypatch.setattr(trainer, "batch_loss", poisoned)
    with pytest.raises(NmtError, match="non-finite updates in a row"):
        train(make_config(max_steps=50, save_every=5, max_nonfinite=3), workdir)
    # the last good checkpoint is untouched
    assert load_checkpoint(workdir / "checkpoints" / "last.pt").train_state["progress"]["step"] == 5


@pytest.mark.slow
def test_two_ddp_processes_equal_one_process_accumulating(tmp_path, synthetic):
    steps = 6
    cfg = make_config(max_steps=steps, save_every=steps, update_tokens=2048, batch_tokens=1024)
    recipe = write_recipe(tmp_path / "r.yaml", cfg)
    single = fresh_workdir(tmp_path, synthetic, "one")
    proc = nmt_train(recipe, single)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()

    multi = fresh_workdir(tmp_path, synthetic, "two")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "nmt",
        "train",
        str(recipe),
        "--workdir",
        str(multi),
    ]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = weights(single / "checkpoints" / "last.pt"), weights(multi / "checkpoints" / "last.pt")
    assert load_checkpoint(multi / "checkpoints" / "last.pt").train_state["progress"]["step"] == steps
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), k
    # and they did move: the runs are not equal merely because nothing trained
    assert not torch.allclose(a["embed.weight"], weights_at_init(cfg, a), atol=1e-4)


def weights_at_init(cfg, like: dict) -> torch.Tensor:
    from nmt.model import Transformer

    torch.manual_seed(cfg.train.seed)
    return Transformer(cfg.model, like["embed.weight"].shape[0]).embed.weight.detach()


# ---- several processes stop together ---------------------------------------------------------------


def torchrun(recipe: Path, workdir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "nmt", "train", str(recipe), "--workdir", str(workdir), *extra]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def worker_of_rank(agent: int, rank: int) -> int:
    """The pid of the worker process of `rank` started by the torchrun agent `agent`."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no worker of rank {rank} under {agent}")


def test_cooldown_takes_the_rate_linearly_to_zero_by_the_last_step(tmp_path, synthetic):
    cfg = make_config(max_steps=20, save_every=20, log_every=1, warmup=5, cooldown=0.5)
    workdir = fresh_workdir(tmp_path, synthetic)
    train(cfg, workdir)
    records = map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
    lrs = {r["step"]: r["lr"] for r in records if r["kind"] == "train"}
    assert sorted(lrs) == list(range(1, 21))
    scale = lr_scale(cfg.model, cfg.train)
    for step, lr in lrs.items():
        spent = (step - 1) / 20  # the rate of an update is set before it, from the budget spent so far
        want = inverse_sqrt_lr(step, cfg.model.d_model, 5, scale) * min(1.0, (1 - spent) / 0.5)
        assert lr == pytest.approx(want), step
    assert lrs[10] == pytest.approx(inverse_sqrt_lr(10, cfg.model.d_model, 5, scale))  # before: the paper's
    assert lrs[20] < 0.1 * lrs[11]


def step_of(workdir: Path) -> int:
    return load_checkpoint(workdir / "checkpoints" / "last.pt").train_state["progress"]["step"]


@pytest.mark.slow
def test_two_processes_stop_together_on_the_time_budget_then_resume(tmp_path, synthetic):
    # with a cool-down on the clock, whose rate every rank must agree on
    cfg = make_config(
        max_steps=100_000,
        max_minutes=0.2,
        cooldown=0.5,
        save_every=100_000,
        batch_tokens=512,
        update_tokens=1024,
    )
    workdir = fresh_workdir(tmp_path, synthetic)
    proc = torchrun(write_recipe(tmp_path / "r.yaml", cfg), workdir)
    out = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, out[-3000:]
    assert "reached train.max_minutes=0.2" in out
    step = step_of(workdir)
    assert step > 0
    more = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, max_minutes=None, max_steps=step + 3)
    )
    proc = torchrun(write_recipe(tmp_path / "more.yaml", more), workdir)
    out = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, out[-3000:]
    assert "resuming from" in out and f"(step {step})" in out
    assert step_of(workdir) == step + 3


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_sigterm_to_one_process_stops_both_within_seconds_then_resume(tmp_path, synthetic, rank):
    cfg = make_config(
        max_steps=100_000, save_every=100_000, log_every=1, batch_tokens=512, update_tokens=1024
    )
    workdir = fresh_workdir(tmp_path, synthetic)
    recipe = write_recipe(tmp_path / "r.yaml", cfg)
    proc = torchrun(recipe, workdir)
    deadline = time.monotonic() + 120
    while (
        not (workdir / "metrics.jsonl").exists()
        or len((workdir / "metrics.jsonl").read_text().split("\n")) < 4
    ):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    os.kill(worker_of_rank(proc.pid, rank), signal.SIGTERM)
    sent = time.monotonic()
    out = proc.communicate(timeout=60)[1]  # before: both hung in different collectives for minutes
    assert time.monotonic() - sent < 30
    assert "stopped by SIGTERM" in out, out[-3000:]
    step = step_of(workdir)
    assert step >= 3
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=step + 2))
    proc = torchrun(write_recipe(tmp_path / "more.yaml", more), workdir)
    out = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, out[-3000:]
    assert step_of(workdir) == step + 2


@pytest.mark.parametrize(
    "change, named",
    [
        ({"model": {"d_ff": 128}}, "model.d_ff 256, the recipe now says 128"),
        ({"train": {"batch_tokens": 512}}, "train.batch_tokens 1024, the recipe now says 512"),
        ({"train": {"seed": 2}}, "train.seed 1, the recipe now says 2"),
        ("vocabulary", "another SentencePiece model"),
    ],
)
def test_resume_refuses_what_changed_with_one_line_and_exit_2(tmp_path, synthetic, change, named):
    import shutil

    from nmt.config import config_from_dict

    data = tmp_path / "data"
    shutil.copytree(synthetic, data)
    workdir = fresh_workdir(tmp_path, data)
    cfg = make_config(max_steps=10, save_every=10)
    train(cfg, workdir)
    raw = config_to_dict(make_config(max_steps=20, save_every=10))
    if change == "vocabulary":  # preprocessing redone: a SentencePiece model of other bytes
        from nmt.subword import train_sentencepiece

        from .synthetic import LETTERS

        # the same letters, other frequencies: other scores, other bytes
        lines = [" ".join(LETTERS[: 1 + i % 16]) for i in range(500)]
        train_sentencepiece(lines, data / "spm", len(LETTERS) + 4, model_type="word")
    else:
        for section, values in change.items():
            raw[section].update(values)
    recipe = write_recipe(tmp_path / "changed.yaml", config_from_dict(raw))
    result = CliRunner().invoke(app, ["train", str(recipe), "--workdir", str(workdir)])
    err = result.stderr
    assert result.exit_code == 2, result.output  # 2: no exception escaped
    assert named in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_longer_budgets_resume(tmp_path, synthetic):
    workdir = fresh_workdir(tmp_path, synthetic)
    train(make_config(max_steps=10, save_every=10), workdir)
    train(make_config(max_steps=15, save_every=10, max_minutes=5.0, log_every=1), workdir)
    assert load_checkpoint(workdir / "checkpoints" / "last.pt").train_state["progress"]["step"] == 15


@pytest.mark.slow
def test_resume_on_more_processes_maps_the_data_position(tmp_path, synthetic):
    cfg = make_config(max_steps=5, save_every=5, batch_tokens=512, update_tokens=1024)
    workdir = fresh_workdir(tmp_path, synthetic)
    train(cfg, workdir)
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=8))
    proc = torchrun(write_recipe(tmp_path / "more.yaml", more), workdir)
    out = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0, out[-3000:]
    assert "1 processes before, 2 now" in " ".join(out.split())
    assert step_of(workdir) == 8
