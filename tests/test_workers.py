"""`nmt translate --workers N` (nmt.translate.workers): a file's batches searched by N forked processes give
the bytes one process gives, in input order; an error in a worker is the single process's one line and
exit status; SIGTERM stops the workers and leaves no temporary output."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nmt.errors import NmtError
from nmt.limits import max_workers
from nmt.translate.frontend import LineTranslator
from nmt.translate.workers import plan, plan_workers
from nmt.untrained import save_random_model

from .conftest import cli, one_error_line
from .synthetic import make_config, make_subword, sentence

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("workers")
    return save_random_model(d / "model.pt", make_config(), make_subword(d / "spm"))


@pytest.fixture(scope="module")
def lines() -> list[str]:
    """Lines of 1 to 12 words; blank ones, one of spaces, one of control characters, and one long line
    that is a batch of its own under the budget the tests give (--max-tokens 200)."""
    rng = random.Random(5)
    lines = [sentence(rng, 1, 12) for _ in range(60)]
    lines[0] = lines[17] = lines[-1] = ""
    lines[9], lines[30] = "   ", "\x07\x1b"
    lines[40] = " ".join("abcdefghijklmnop")  # 16 words: 4 rows x 50 positions, alone over 200
    return lines


def translate(model: Path, src: Path, out: Path, *extra: str) -> bytes:
    result = cli("translate", "-m", model, "-i", src, "-o", out, "--max-tokens", "200", *extra)
    assert result.returncode == 0, result.stderr.decode()
    return out.read_bytes()


def logged_pids(monkeypatch, log: Path) -> None:
    """Each searched batch appends the searching process's id to `log` (the fork inherits the patch)."""
    search = LineTranslator.search_batch

    def logged(self, *args, **kw):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return search(self, *args, **kw)

    monkeypatch.setattr(LineTranslator, "search_batch", logged)


@pytest.mark.numerics
@pytest.mark.parametrize("nbest", [None, "2"])
def test_two_workers_write_the_bytes_of_one_process(model, lines, tmp_path, monkeypatch, nbest):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n")
    extra = ["--nbest", nbest] if nbest else []
    one = translate(model, src, tmp_path / "one.txt", "--workers", "1", *extra)
    log = tmp_path / "pids"
    logged_pids(monkeypatch, log)
    two = translate(model, src, tmp_path / "two.txt", "--workers", "2", *extra)
    assert two == one
    out = one.decode().split("\n")[:-1]
    if nbest:  # every line's index, in order: up to 2 hypotheses each, 1 for a blank line
        indices = [int(t.split("\t")[0]) for t in out]
        assert sorted(indices) == indices and set(indices) == set(range(len(lines)))
    else:  # blank in, blank out, at the same places
        assert len(out) == len(lines)
        assert [i for i, t in enumerate(out) if not t] == [0, 9, 17, 30, 59]
    pids = log.read_text().split()
    assert len(pids) >= 3 and os.getpid() not in map(int, pids)  # searched in the workers alone
    assert len(set(pids)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "one.txt", "pids", "two.txt"]


@pytest.mark.numerics
def test_a_glossary_through_workers_writes_the_bytes_of_one_process(model, lines, tmp_path, monkeypatch):
    """The lines with terms are searched by the workers too, not by the parent while they wait."""
    src, glossary = tmp_path / "in.txt", tmp_path / "terms.tsv"
    src.write_text("\n".join(lines) + "\n")
    glossary.write_text("p\tk\no\tm\n")
    with_terms = [i for i, line in enumerate(lines) if {"p", "o"} & set(line.split())]
    assert 5 <= len(with_terms) <= len(lines) - 10  # both kinds of line, in several batches
    extra = ["--glossary", glossary]
    one = translate(model, src, tmp_path / "one.txt", "--workers", "1", *extra)
    search = LineTranslator.search_batch
    log = tmp_path / "pids"

    def logged(self, ids, wanted, constraints=None, nbest=None):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {constraints is not None}\n")
        return search(self, ids, wanted, constraints, nbest)

    monkeypatch.setattr(LineTranslator, "search_batch", logged)
    assert translate(model, src, tmp_path / "two.txt", "--workers", "2", *extra) == one
    out = one.decode().split("\n")
    for i in with_terms:  # each term placed as often as its source word is there
        for word, term in [("p", "k"), ("o", "m")]:
            assert out[i].split().count(term) >= lines[i].split().count(word), (lines[i], out[i])
    searched = [line.split() for line in log.read_text().splitlines()]
    assert os.getpid() not in {int(pid) for pid, _ in searched}  # no batch searched in the parent
    assert {terms for _, terms in searched} == {"True", "False"}
    assert len({pid for pid, _ in searched}) == 2


def test_split_sentences_through_workers(model, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("a b c. d e f.\n\ng h i j. k\n")
    one = translate(model, src, tmp_path / "one.txt", "--split-sentences", "--workers", "1")
    assert translate(model, src, tmp_path / "two.txt", "--split-sentences", "--workers", "2") == one
    assert len(one.split(b"\n")) == 4


def test_an_error_in_a_worker_is_one_line_and_status_2(model, lines, tmp_path, monkeypatch):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(line.replace("\x07\x1b", "") for line in lines) + "\n")  # no warning
    out = tmp_path / "out.txt"
    search = LineTranslator.search_batch

    def failing(self, ids, *args, **kw):
        if any(len(x) >= 16 for x in ids):  # the long line's batch
            raise NmtError("line 41: cannot be searched")
        return search(self, ids, *args, **kw)

    monkeypatch.setattr(LineTranslator, "search_batch", failing)
    result = cli("translate", "-m", model, "-i", src, "-o", out, "--max-tokens", "200", "--workers", "2")
    assert result.returncode == 2
    one_error_line(result.stderr, "line 41")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_a_short_prefix_file_with_workers_is_the_one_process_error(model, lines, tmp_path):
    src, prefix = tmp_path / "in.txt", tmp_path / "prefix.txt"
    src.write_text("\n".join(line.replace("\x07\x1b", "") for line in lines) + "\n")
    prefix.write_text("a\n\nb\n")
    result = cli(
        "translate", "-m", model, "-i", src, "--prefix", prefix, "-o", tmp_path / "out", "--workers", "2"
    )
    assert result.returncode == 2
    one_error_line(result.stderr, str(prefix), "line 4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "prefix.txt"]


def test_where_one_process_translates():
    cpu = torch.device("cpu")
    assert plan_workers(None, "torch", cpu, interactive=True) == 1
    assert plan_workers(None, "torch", torch.device("cuda"), interactive=False) == 1
    assert plan_workers(max_workers(), "torch", cpu, interactive=False) == max_workers()
    for device, interactive, why in [
        (cpu, True, "one by one"),
        (torch.device("cuda"), False, "--device cuda"),
    ]:
        with pytest.raises(NmtError, match=why):
            plan_workers(2, "torch", device, interactive)
    with pytest.raises(NmtError, match="--workers 0"):
        plan_workers(0, "torch", cpu, interactive=False)
    assert plan_workers(None, "ctranslate2", cpu, interactive=False, sampling=True) == 1
    with pytest.raises(NmtError, match="random stream"):
        plan_workers(2, "ctranslate2", cpu, interactive=False, sampling=True)


@pytest.mark.numerics
def test_ctranslate2_inter_threads_write_the_bytes_of_one(model, lines, tmp_path, monkeypatch):
    pytest.importorskip("ctranslate2")
    folder = tmp_path / "ct2"
    exported = cli("export", "-m", model, "--format", "ctranslate2", "-o", folder)
    assert exported.returncode == 0, exported.stderr.decode()
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n")
    ct2 = ["--engine", "ctranslate2", "--dtype", "fp32"]
    one = translate(folder, src, tmp_path / "one.txt", *ct2, "--workers", "1")
    threads: set[int] = set()
    search = LineTranslator.search_batch

    def logged(self, *args, **kw):
        threads.add(threading.get_ident())
        return search(self, *args, **kw)

    monkeypatch.setattr(LineTranslator, "search_batch", logged)
    assert translate(folder, src, tmp_path / "two.txt", *ct2, "--workers", "2") == one
    assert threads and threading.get_ident() not in threads  # searched by the pool's threads


def test_sampling_refuses_workers(model, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("a b\n")
    result = cli("translate", "-m", model, "-i", src, "--sampling", "--workers", "2")
    assert result.returncode == 2
    one_error_line(result.stderr, "--workers 2", "sampling")


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not ended (an orphan that ended may stay a zombie a while)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def new_group_default_sigint() -> None:
    os.setsid()  # a group of its own, as a shell's job: Ctrl-C reaches the command and its workers
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a suite run in the background hands children SIG_IGN


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_workers_and_leaves_no_temporary_file(model, tmp_path, signum):
    """SIGTERM to the command (a scheduler), SIGINT to its whole process group (Ctrl-C at a terminal)."""
    out = tmp_path / "out.txt"
    out.write_text("previous\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
    command = [sys.executable, "-m", "nmt", "translate", "-m", model, "-o", out, "--workers", "2"]
    command += ["--max-tokens", "200"]
    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=new_group_default_sigint
    )
    try:
        rng = random.Random(1)
        proc.stdin.write("".join(sentence(rng, 1, 12) + "\n" for _ in range(3000)).encode())
        proc.stdin.flush()  # and stdin stays open: the command never runs out of work before the signal
        deadline = time.monotonic() + 60
        while len(list(tmp_path.iterdir())) < 2 or len(children(proc.pid)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "no workers, or no temporary file"
            time.sleep(0.05)
        workers = children(proc.pid)
        time.sleep(0.5)  # the workers busy with batches
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, stderr.decode()
    assert ("SIGTERM" if signum == signal.SIGTERM else "interrupted") in one_error_line(stderr)
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"] and out.read_text() == "previous\n"
    assert not any(map(running, workers))


@pytest.mark.slow
def test_workers_end_when_the_command_is_killed(model, tmp_path):
    """SIGKILL runs no handler: the workers see their pipe close and exit, never left waiting."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    command = [
        sys.executable,
        "-m",
        "nmt",
        "translate",
        "-m",
        model,
        "-o",
        tmp_path / "out",
        "--workers",
        "2",
    ]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while len(children(proc.pid)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "no workers"
            time.sleep(0.05)
        workers = children(proc.pid)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(map(running, workers)):
            assert time.monotonic() < deadline, "a worker outlived its parent"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.stdin.close()


def test_more_workers_than_cpus_are_refused_before_any_fork(model, tmp_path, monkeypatch):
    """`--workers 100000` forked for minutes: the count is bounded by the CPUs, before the model loads."""
    too_many = max_workers() + 1
    monkeypatch.setattr("multiprocessing.context.ForkContext.Process", None)  # a fork would fail here
    for n in (too_many, 100000):
        with pytest.raises(NmtError, match=f"--workers {n}: at most {max_workers()}"):
            plan(n, "torch", torch.device("cpu"), interactive=False)
    src = tmp_path / "src.txt"
    src.write_text("a b c\n")
    start = time.monotonic()
    result = cli("translate", "-m", model, "-i", src, "-o", tmp_path / "out", "--workers", str(too_many))
    assert result.returncode == 2
    assert f"--workers {too_many}: at most {max_workers()}" in one_error_line(result.stderr)
    assert time.monotonic() - start < 60 and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_worker_killed_while_idle_is_one_line_and_status_1(model, tmp_path):
    """An OOM kill between chunks: the next batch sent to the dead worker fails to send, which is the
    worker's death (one line, status 1), not a reader gone (quiet status 141); -o keeps what it held."""
    out = tmp_path / "out.txt"
    out.write_text("previous\n")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    command = [sys.executable, "-m", "nmt", "translate", "-m", model, "-o", out, "--workers", "2"]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        rng = random.Random(2)
        chunk = "".join(sentence(rng, 1, 6) + "\n" for _ in range(2000))  # one chunk (CHUNK_LINES)
        proc.stdin.write(chunk.encode())
        proc.stdin.flush()
        deadline = time.monotonic() + 120

        def written() -> bool:  # the first chunk's translations flushed to -o's temporary file
            return any(p.name != "out.txt" and p.stat().st_size > 0 for p in tmp_path.iterdir())

        while not written() or len(children(proc.pid)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "no workers, or no first chunk"
            time.sleep(0.05)
        time.sleep(0.2)  # the parent back to reading stdin: both workers idle
        os.kill(children(proc.pid)[0], signal.SIGKILL)
        time.sleep(0.2)
        _, stderr = proc.communicate(chunk.encode(), timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr.decode()
    line = one_error_line(stderr)
    assert "worker" in line and "died: signal 9" in line, line
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"] and out.read_text() == "previous\n"


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
def test_a_reader_gone_with_workers_stays_quiet_status_141(model, tmp_path):
    """stdout closed by its reader (`| head -n 1`): the quiet status 141 of a Unix tool, with workers too."""
    src = tmp_path / "src.txt"
    rng = random.Random(3)
    src.write_text("".join(sentence(rng, 1, 6) + "\n" for _ in range(3000)))
    command = [sys.executable, "-m", "nmt", "translate", "-m", model, "-i", src, "--workers", "2"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, stderr.decode()
    assert b"error" not in stderr and b"died" not in stderr


@pytest.mark.slow
def test_sigterm_while_the_workers_start_stops_the_command(model, tmp_path):
    """A SIGTERM landing as a worker forks was raised in the new worker and lost by the parent, which
    translated on to the end (status 0): blocked over the fork, it stops the command."""
    src = tmp_path / "src.txt"
    rng = random.Random(4)
    src.write_text("".join(sentence(rng, 1, 12) + "\n" for _ in range(20000)))
    for attempt in range(3):
        out = tmp_path / f"out{attempt}.txt"
        command = [
            sys.executable,
            "-m",
            "nmt",
            "translate",
            "-m",
            model,
            "-i",
            src,
            "-o",
            out,
            "--workers",
            "2",
        ]
        proc = subprocess.Popen(command, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            while not children(proc.pid):  # the first fork: signalled as soon as it is seen
                assert time.monotonic() < deadline and proc.poll() is None, "no worker"
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=30)
        finally:
            proc.kill()
        assert proc.returncode == 128 + signal.SIGTERM, (attempt, stderr.decode())
        assert not out.exists()
