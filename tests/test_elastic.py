"""Elastic recovery: two torchrun launchers as two nodes; a worker killed by SIGKILL is restarted by its
launcher, the job resumes from last.pt and ends with the weights of an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nmt.checkpoint import load_checkpoint

from .synthetic import make_config, make_workdir
from .test_train import ENV, fresh_workdir, step_of, torchrun, weights, write_recipe

# The launch the README shows. Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, torchrun keeps one store
# across restarts and the restarted workers find the dead ones' addresses (see nmt.train.runtime).
ELASTIC_ENV = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synthetic")
    make_workdir(root)
    return root / "data"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(recipe: Path, workdir: Path, port: int, log: Path) -> subprocess.Popen:
    """One "node": a torchrun agent with one worker, joining the job's c10d rendezvous on 127.0.0.1."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    cmd += ["--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    cmd += ["--rdzv-id", "elastic-test", "-m", "nmt", "train", str(recipe), "--workdir", str(workdir)]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=ELASTIC_ENV, stdout=out, stderr=subprocess.STDOUT)


def children(pids: set[int]) -> set[int]:
    """Every live descendant of `pids` (torchrun starts its workers in sessions of their own, so killing
    a launcher's process group would leave them running)."""
    parent = {}
    for proc in Path("/proc").iterdir():
        try:
            parent[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    found, frontier = set(), set(pids)
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def worker_of(agents: list[subprocess.Popen], rank: int) -> int:
    for agent in agents:
        for pid in children({agent.pid}):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID=elastic-test" in environ:
                return pid
    raise AssertionError(f"no worker of rank {rank}")


@pytest.mark.slow
def test_a_worker_killed_on_one_of_two_nodes_restarts_and_ends_as_if_uninterrupted(tmp_path, synthetic):
    cfg = make_config(max_steps=30, save_every=10, log_every=1, batch_tokens=512, update_tokens=1024)
    recipe = write_recipe(tmp_path / "r.yaml", cfg)
    straight = fresh_workdir(tmp_path, synthetic, "straight")
    proc = torchrun(recipe, straight)
    out = proc.communicate(timeout=300)[1]
    assert proc.returncode == 0, out[-3000:]

    workdir = fresh_workdir(tmp_path, synthetic, "elastic")
    port, logs = free_port(), [tmp_path / "node0.log", tmp_path / "node1.log"]
    agents = [launcher(recipe, workdir, port, log) for log in logs]
    deadline = time.monotonic() + 420
    seen: set[int] = set()
    try:
        while not (workdir / "checkpoints" / "last.pt").exists():
            assert all(a.poll() is None for a in agents), "a launcher ended before the first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        # rank 0: the worker that writes the checkpoints and, on this launch, hosts the job's store
        victim = worker_of(agents, 0)
        os.kill(victim, signal.SIGKILL)
        for agent in agents:
            seen |= children({a.pid for a in agents})
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        seen |= children({a.pid for a in agents})
        for p in [*agents]:
            if p.poll() is None:
                p.kill()
        for pid in seen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in agents:
            p.wait(timeout=30)
    text = "\n".join(log.read_text() for log in logs)
    assert [a.returncode for a in agents] == [0, 0], text[-5000:]
    assert "connectFullMesh" not in text, text[-5000:]
    joined = " ".join(text.split())  # the log wraps at 80 columns
    # one restart, which resumed from the checkpoint of step 10 (or a later one)
    assert [int(s) >= 10 for s in re.findall(r"resuming from .*?\(step (\d+)\)", joined)] == [True]
    assert "torchrun restart 1 of at most 3 on this node" in joined
    assert step_of(workdir) == cfg.train.max_steps
    a, b = weights(straight / "checkpoints" / "last.pt"), weights(workdir / "checkpoints" / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), max((a[k] - b[k]).abs().max().item() for k in a)
    # and the resumed part did train: the weights at the checkpoint it resumed from are not the final ones
    first = weights(workdir / "checkpoints" / "step-10.pt")
    assert not torch.equal(first["embed.weight"], b["embed.weight"])
    assert load_checkpoint(workdir / "checkpoints" / "last.pt").train_state["run"]["world_size"] == 2


START = """
import sys, torch, torch.distributed as dist
from nmt.errors import NmtError
from nmt.train.runtime import Runtime, check_same_start
rank, port, step = map(int, sys.argv[1:])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:
    check_same_start(step, Runtime(torch.device("cpu"), torch.float32, rank, 2))
    print("same")
except NmtError as e:
    print(e)
"""


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
def test_processes_that_would_resume_from_different_steps_stop_with_one_line():
    """Nodes that do not share the work directory: rank 1 finds no checkpoint, rank 0 one of step 10.
    (That equal steps pass, every torchrun test shows.)"""
    steps = (10, 0)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", START, str(rank), str(port), str(step)],
            env=ENV,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank, step in enumerate(steps)
    ]
    try:
        said = [p.communicate(timeout=120)[0].strip() for p in procs]
    finally:
        for p in procs:
            p.kill()
    for line in said:  # every process knows, so all leave (and torchrun restarts them, or the job ends)
        assert "resume from different steps (0 to 10)" in line and "--workdir" in line, line


def test_the_log_names_the_restart_and_warns_of_a_launch_that_cannot_recover(monkeypatch):
    from nmt.train.runtime import elastic_notes

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert elastic_notes() == []
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's default
    restart, warning = elastic_notes()
    assert restart == "torchrun restart 1 of at most 3 on this node"
    assert "warning" in warning and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what that variable gives the workers
    assert elastic_notes() == [restart]
