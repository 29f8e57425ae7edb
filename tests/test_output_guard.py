"""The one guard every written file goes through (nmt.atomic): an output that is an input is refused by
device and inode, a new file or folder gets the umask's mode, SIGTERM and SIGHUP leave no temporary file,
and a full disk or a read-only folder is one line naming the path written, exit status 1."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nmt.cli import app
from nmt.untrained import save_random_model

from .conftest import cli
from .conftest import one_error_line as one_line
from .synthetic import make_config, make_subword

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
NMT = [sys.executable, "-m", "nmt"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny random post-norm model (a MarianMT export), saved by the real writer."""
    d = tmp_path_factory.mktemp("guard")
    return save_random_model(d / "model.pt", make_config(), make_subword(d / "spm"))


@pytest.fixture(scope="module")
def marian(model, tmp_path_factory) -> Path:
    """The model as a MarianMT folder, written by `nmt export --format huggingface`."""
    folder = tmp_path_factory.mktemp("marian") / "hf"
    result = CliRunner().invoke(
        app, ["export", "-m", str(model), "--format", "huggingface", "-o", str(folder)]
    )
    assert result.exit_code == 0, result.output
    return folder


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---- outputs that are inputs ------------------------------------------------------------------------


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
def test_translate_into_dev_null_with_stdin_from_dev_null_is_not_refused(model, tmp_path):
    src = tmp_path / "in.xx"
    src.write_text("a b c\n")
    command = [*NMT, "translate", "-m", model, "-i", src, "-o", "/dev/null"]
    result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, env=ENV, timeout=120)
    assert result.returncode == 0, result.stderr.decode()


@pytest.mark.parametrize("how", ["same name", "symlink", "hard link"])
def test_translate_refuses_to_write_over_its_model(model, tmp_path, how):
    copy = tmp_path / "model.pt"
    copy.write_bytes(model.read_bytes())
    out = {"same name": copy, "symlink": tmp_path / "link.pt", "hard link": tmp_path / "hard.pt"}[how]
    if how == "symlink":
        out.symlink_to(copy)
    elif how == "hard link":
        os.link(copy, out)
    result = cli("translate", "-m", copy, "-o", out, stdin=b"a b\n")
    assert result.returncode == 2
    one_line(result.stderr, str(out), "input")
    assert copy.read_bytes() == model.read_bytes()


def test_average_refuses_to_replace_one_of_its_inputs(model, tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    a.write_bytes(model.read_bytes())
    b.write_bytes(model.read_bytes())
    result = cli("average", a, b, "-o", b)
    assert result.returncode == 2
    one_line(result.stderr, str(b), "input")
    assert b.read_bytes() == model.read_bytes() and listing(tmp_path) == ["a.pt", "b.pt"]


def test_import_refuses_to_write_into_the_folder_it_reads(marian, tmp_path):
    before = {p.name: p.read_bytes() for p in marian.iterdir()}
    result = cli("import", marian, "-o", marian / "model.safetensors")
    assert result.returncode == 2
    one_line(result.stderr, "model.safetensors", "input")
    assert {p.name: p.read_bytes() for p in marian.iterdir()} == before


def test_export_refuses_a_folder_that_holds_its_model(model, tmp_path):
    copy = tmp_path / "run" / "model.pt"
    copy.parent.mkdir()
    copy.write_bytes(model.read_bytes())
    result = cli("export", "-m", copy, "--format", "huggingface", "-o", copy.parent, "--force")
    assert result.returncode == 2
    one_line(result.stderr, "input")
    assert copy.read_bytes() == model.read_bytes()


# ---- modes ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_new_files_and_folders_get_the_umasks_mode(model, tmp_path, mask):
    with umask(mask):
        assert cli("translate", "-m", model, "-o", tmp_path / "out.txt", stdin=b"a b\n").returncode == 0
        assert cli("average", model, model, "-o", tmp_path / "avg.pt").returncode == 0
        result = cli("export", "-m", model, "--format", "huggingface", "-o", tmp_path / "hf")
        assert result.returncode == 0, result.stderr
    for name in ("out.txt", "avg.pt", "hf/model.safetensors", "hf/config.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~mask, name
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o777 & ~mask


# ---- signals ----------------------------------------------------------------------------------------


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_mid_translation_leaves_no_temporary_file(model, tmp_path, signum):
    out = tmp_path / "out.txt"
    out.write_text("previous\n")
    command = [*NMT, "translate", "-m", model, "-o", out]

    # A suite run under nohup hands its children an ignored SIGHUP, which nmt rightly keeps ignored
    def default_hangup():
        signal.signal(signal.SIGHUP, signal.SIG_DFL)

    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, preexec_fn=default_hangup
    )
    try:
        proc.stdin.write(b"a b c\n")  # and stdin stays open: the command waits for more lines
        proc.stdin.flush()
        deadline = time.monotonic() + 60
        while len(listing(tmp_path)) < 2:  # the temporary file beside out.txt: writing has begun
            assert time.monotonic() < deadline and proc.poll() is None, "no temporary file appeared"
            time.sleep(0.05)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, stderr.decode()
    assert signal.Signals(signum).name in one_line(stderr)
    assert listing(tmp_path) == ["out.txt"] and out.read_text() == "previous\n"


# ---- write failures ---------------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A small filesystem of its own (needs root and mount): a real full disk or read-only folder."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def write_commands(model: Path, marian: Path, folder: Path) -> dict[str, list]:
    return {
        "translate": ["translate", "-m", model, "-o", folder / "out.txt"],
        "average": ["average", model, model, "-o", folder / "avg.pt"],
        "import": ["import", marian, "-o", folder / "imported.pt"],
        "export hf": ["export", "-m", model, "--format", "huggingface", "-o", folder / "hf"],
    }


@pytest.mark.parametrize(
    "command", [pytest.param("translate", marks=pytest.mark.slow), "average", "import", "export hf"]
)
def test_a_full_disk_is_one_line_naming_the_file(model, marian, tmp_path, command):
    with tmpfs(tmp_path / "small", "size=64k") as small:
        args = write_commands(model, marian, small)[command]
        stdin = "a b\n" * 20_000 if command == "translate" else ""  # more than 64 kB of output
        result = CliRunner().invoke(app, [str(a) for a in args], input=stdin)
        assert result.exit_code == 1, result.output
        line = one_line(result.stderr, str(small), "No space left on device")
        assert "standard output" not in line
        assert listing(small) == []  # no temporary file, no half-written output


@pytest.mark.parametrize("command", ["translate", "average", "import", "export hf"])
def test_a_read_only_folder_is_one_line_naming_the_file(model, marian, tmp_path, command):
    with tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        args = write_commands(model, marian, ro)[command]
        result = CliRunner().invoke(app, [str(a) for a in args], input="a b\n")
        assert result.exit_code == 1, result.output
        one_line(result.stderr, str(ro), "Read-only file system")


def test_a_device_or_a_fifo_is_written_in_place_never_replaced(model, tmp_path):
    """Never with the real /dev/full: a code that renamed over it would replace the machine's device."""
    full, fifo = tmp_path / "full", tmp_path / "fifo"
    try:
        os.mknod(full, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # /dev/full's own device numbers
    except PermissionError:
        pytest.skip("making a device node needs root")
    result = cli("average", model, model, "-o", full)
    assert result.returncode == 1
    one_line(result.stderr, str(full), "No space left on device")
    assert full.is_char_device()
    os.mkfifo(fifo)
    got = tmp_path / "got"
    with open(got, "wb") as sink:  # a file, not a pipe this process reads only later: no deadlock
        reader = subprocess.Popen(["cat", str(fifo)], stdout=sink)
    result = cli("average", model, model, "-o", fifo)
    assert result.returncode == 0, result.stderr
    reader.wait(timeout=60)
    written = got.read_bytes()
    assert written.startswith(b"PK") and len(written) > 10_000  # a whole checkpoint (a zip) went through
    assert fifo.is_fifo()


@pytest.mark.parametrize("stop", ["SIGTERM", "full disk"])
def test_preprocess_leaves_no_part_file_when_stopped_or_out_of_space(tmp_path, stop):
    import errno

    from nmt.data.binarized import write_split
    from nmt.errors import OutputError, Signalled

    def source():
        yield [5, 6, 7]
        if stop == "full disk":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise Signalled(signal.SIGTERM)

    raised = OutputError if stop == "full disk" else Signalled
    with pytest.raises(raised):
        write_split(tmp_path / "train", source(), iter([[5], [6]]), vocab_size=64)
    assert listing(tmp_path) == []


def test_the_command_line_gives_back_the_signal_handlers_it_found(model, tmp_path):
    """A program that calls the CLI in its own process (a test runner, a notebook) keeps its own SIGTERM."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    assert cli("average", model, model, "-o", tmp_path / "avg.pt").returncode == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == before


# ---- every command, each output at each input --------------------------------------------------------

# The commands that write no file: a new command is either here or in GUARDED below, so none can ship
# without its outputs checked against its inputs.
WRITES_NOTHING = {"score", "serve"}


def _model_copy(model: Path, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.read_bytes())
    return path


def _text(_model: Path | None, path: Path, text: str = "a b c\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _recipe(_model: Path, path: Path) -> Path:
    from nmt.config import resolve_recipe

    return _text(None, path, resolve_recipe("multi30k-en-de").read_text())


def _student_recipe(_model: Path, path: Path) -> Path:
    from nmt.config import resolve_recipe

    return _text(None, path, resolve_recipe("multi30k-en-de-student").read_text())


def _split(model: Path, folder: Path) -> Path:
    """A work directory whose data/ holds a binarized split made with `model`'s subwords."""
    from nmt.checkpoint import load_checkpoint
    from nmt.data.binarized import write_split

    proto = load_checkpoint(model).subword_proto
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "data" / "spm.model").write_bytes(proto)
    write_split(folder / "data" / "train", [[5, 6, 7], [6, 7]], [[7, 6, 5], [7, 6]], 20)
    return folder


# Per command: (argv with {name} for each input and {out} for the output, the inputs' makers,
# whether the output is a work directory). A file output is pointed at each input by name, through a
# symlink and, for a folder input, at a file inside it; a work directory is given with each input
# placed in one of the folders a run writes (data/, checkpoints/).
GUARDED = {
    "preprocess": ("preprocess {recipe} -w {out}", {"recipe": _recipe}, True),
    "train": ("train {recipe} -w {out} --init-from {init}", {"recipe": _recipe, "init": _model_copy}, True),
    "run": ("run {recipe} -w {out} --init-from {init}", {"recipe": _recipe, "init": _model_copy}, True),
    "distill": (
        "distill {recipe} -t {teacher} --mono {mono} --select top1 -w {out}",
        {"recipe": _student_recipe, "teacher": _model_copy, "mono": _text},
        True,
    ),
    "backtranslate": (
        "backtranslate --reverse {reverse} --mono {mono} -o {out}",
        {"reverse": _model_copy, "mono": _text},
        False,
    ),
    "average": ("average {a} {b} -o {out}", {"a": _model_copy, "b": _model_copy}, False),
    "export": ("export -m {model} --format huggingface --force -o {out}", {"model": _model_copy}, False),
    "import": ("import {folder} -o {out}", {"folder": "marian"}, False),
    "translate": (
        "translate -m {model} -i {input} --glossary {glossary} --avoid {avoid} -o {out}",
        {
            "model": _model_copy,
            "input": _text,
            "glossary": lambda m, p: _text(m, p, "b\tc\n"),
            "avoid": lambda m, p: _text(m, p, "x\n"),
        },
        False,
    ),
    "shortlist": (
        "shortlist -m {model} --src {src} --tgt {tgt} -o {out}",
        {"model": _model_copy, "src": _text, "tgt": _text},
        False,
    ),
    "plot": (
        "plot {run} -o {out}",
        {"run": lambda m, p: _text(m, p / "metrics.jsonl", "{}\n").parent},
        False,
    ),
}


def test_every_command_is_guarded_or_writes_nothing():
    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert commands == set(GUARDED) | WRITES_NOTHING


# Commands whose -o is a PREFIX of the files they write (PREFIX.<lang>): an input is in the way when it
# is one of those files, so it is named so here and -o is its name less the suffix.
PREFIXED = {"backtranslate": ".xx"}


def guard_cases() -> list[tuple[str, str, str]]:
    cases = []
    for command, (_, makers, workdir) in GUARDED.items():
        for name in makers:
            forms = ["in data/", "in checkpoints/"] if workdir else ["same name", "symlink"]
            if command in ("import", "plot"):  # folder inputs: the output at a file inside them too
                forms.append("inside")
            if command == "shortlist" and name == "model":
                continue  # -o over -m is the in-place update nmt shortlist documents (tested below)
            cases += [(command, name, form) for form in forms]
    return cases


def snapshot(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("command", "input_name", "form"), guard_cases())
def test_no_command_writes_over_one_of_its_inputs(
    model, marian, tmp_path, monkeypatch, command, input_name, form
):
    monkeypatch.setenv("NMT_DATA_MIRROR", str(tmp_path / "no-mirror"))  # a missed refusal never downloads
    template, makers, workdir = GUARDED[command]
    paths = {}
    for name, make in makers.items():
        if make == "marian":
            paths[name] = tmp_path / "hf"
            shutil.copytree(marian, paths[name])
            continue
        where = tmp_path / "inputs" / (name + PREFIXED.get(command, ""))
        if workdir and name == input_name:  # the input lies where the run writes
            where = tmp_path / "w" / form.split()[1].rstrip("/") / name
        paths[name] = make(model, where)
    victim = paths[input_name]
    if workdir:
        out = tmp_path / "w"
    elif form == "same name":
        out = victim.with_suffix("") if command in PREFIXED else victim
    elif form == "symlink":
        out = tmp_path / "link"
        Path(f"{out}{PREFIXED.get(command, '')}").symlink_to(victim)
    else:  # a file inside the input folder
        out = victim / ("model.safetensors" if command == "import" else "metrics.jsonl")
    before = snapshot(victim)
    args = template.format(out=out, **paths).split()
    result = cli(*args)
    assert result.returncode == 2, (args, result.stderr.decode())
    one_line(result.stderr, "input")
    assert snapshot(victim) == before


def test_shortlist_updates_its_own_model_in_place(model, tmp_path):
    copy = _model_copy(model, tmp_path / "model.pt")
    src, tgt = _text(None, tmp_path / "s", "a b c\nb c\n"), _text(None, tmp_path / "t", "c b a\nc b\n")
    result = cli("shortlist", "-m", copy, "--src", src, "--tgt", tgt, "-o", copy)
    assert result.returncode == 0, result.stderr.decode()
    from nmt.checkpoint import load_checkpoint

    before, after = load_checkpoint(model), load_checkpoint(copy)
    assert after.shortlist is not None and before.shortlist is None
    assert all(torch.equal(after.model_state[k], v) for k, v in before.model_state.items())
