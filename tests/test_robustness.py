"""Nothing lost, nothing silently wrong: outputs, damaged checkpoints, averaging, loading, strict recipes,
input limits and the command line's edges, each as a user meets it (the real CLI, often a subprocess)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nmt.checkpoint import load_checkpoint, save_checkpoint
from nmt.cli import app
from nmt.config import config_from_dict, config_to_dict, load_config
from nmt.errors import CheckpointError, ConfigError, DataError
from nmt.model import Transformer
from nmt.subword import train_sentencepiece
from nmt.translate.stream import read_chunks

from .conftest import cli, one_error_line
from .synthetic import make_config, make_subword

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
NMT = [sys.executable, "-m", "nmt"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """A tiny random model of the reversal task's vocabulary (a few ms to build), and its parts."""
    d = tmp_path_factory.mktemp("robust")
    subword = make_subword(d / "spm")
    cfg = make_config()
    torch.manual_seed(0)
    model = Transformer(cfg.model, subword.vocab_size)
    path = d / "model.pt"
    save(path, model.state_dict(), cfg, subword.proto)
    return {"dir": d, "path": path, "cfg": cfg, "subword": subword, "state": model.state_dict()}


def save(path: Path, state: dict, cfg, proto: bytes) -> Path:
    save_checkpoint(path, model_state=state, config=cfg, subword_proto=proto, vocab_size=VOCAB)
    return path


VOCAB = 20  # the reversal task's letters and the 4 reserved ids


def run(*args: str, stdin: bytes = b"", **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*NMT, *args], input=stdin, capture_output=True, env=ENV, timeout=120, **kw)


def flip_bytes(path: Path, count: int = 64) -> None:
    """Damage the middle of a file the way a bad disk or a broken copy does: the size stays the same."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


# ---- 1. outputs -----------------------------------------------------------------------------------


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
@pytest.mark.parametrize("how", ["same name", "symlink", "hard link", "stdin"])
def test_an_output_that_is_the_input_is_refused_before_anything_is_written(made, tmp_path, how):
    text = b"a b c\nd e f\n"
    src = tmp_path / "in.txt"
    src.write_bytes(text)
    out = {"same name": src, "symlink": tmp_path / "link.txt", "hard link": tmp_path / "hard.txt"}.get(
        how, src
    )
    if how == "symlink":
        out.symlink_to(src)
    if how == "hard link":
        os.link(src, out)
    args = ["translate", "-m", str(made["path"]), "-o", str(out)]
    if how == "stdin":
        with open(src, "rb") as f:
            result = subprocess.run([*NMT, *args], stdin=f, capture_output=True, env=ENV, timeout=120)
    else:
        result = cli(*args, "-i", str(src))
    assert result.returncode == 2
    one_error_line(result.stderr, str(out), "input")
    assert src.read_bytes() == text


def default_sigint() -> None:
    """Ctrl-C as from a terminal: a suite started in the background (`make test &`) hands its children
    SIGINT ignored, and Python then never turns it into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
def test_ctrl_c_mid_translation_leaves_the_previous_output(made, tmp_path):
    previous = tmp_path / "prev.de"
    previous.write_bytes(b"an earlier translation\n" * 320)
    before = previous.read_bytes()
    cmd = [*NMT, "translate", "-m", str(made["path"]), "-o", str(previous), "--interactive"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, preexec_fn=default_sigint
    )
    try:
        proc.stdin.write(b"a b c\n")  # answered at once: the first translation is written, the rest to come
        proc.stdin.flush()
        deadline = time.monotonic() + 60
        while (
            not any(p.stat().st_size for p in tmp_path.glob(".prev.de.*")) and previous.read_bytes() == before
        ):
            assert time.monotonic() < deadline and proc.poll() is None, "no translation was written"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 128 + signal.SIGINT  # as a shell reports Ctrl-C, not click's 1
    finally:
        proc.kill()
        proc.stdin.close()
    assert previous.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prev.de"]  # and no temporary file left


def test_o_writes_the_whole_output_atomically(made, tmp_path):
    out = tmp_path / "out.de"
    out.write_text("old\n")
    result = cli("translate", "-m", str(made["path"]), "-o", str(out), stdin=b"a b\n\nc d e\n")
    assert result.returncode == 0, result.stderr
    assert len(out.read_text().split("\n")) == 4 and out.read_text().split("\n")[1] == ""


def test_o_through_a_link_writes_the_file_and_keeps_the_link(made, tmp_path):
    target, link = tmp_path / "real.de", tmp_path / "link.de"
    target.write_text("old\n")
    link.symlink_to(target)
    result = cli("translate", "-m", str(made["path"]), "-o", str(link), stdin=b"a b\n")
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and target.read_text() != "old\n" and len(target.read_text().split("\n")) == 2
    result = cli("translate", "-m", str(made["path"]), "-o", str(tmp_path), stdin=b"a b\n")
    assert result.returncode == 2
    one_error_line(result.stderr, "is a directory")


# ---- 2. checkpoint integrity ------------------------------------------------------------------------


def test_a_damaged_checkpoint_is_one_line_naming_it(made, tmp_path):
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(made["path"].read_bytes())
    flip_bytes(damaged)
    with pytest.raises(CheckpointError, match="damaged.pt"):
        load_checkpoint(damaged)
    result = cli("translate", "-m", str(damaged), stdin=b"a b\n")
    assert result.returncode == 2 and result.stdout == b""
    one_error_line(result.stderr, "damaged.pt", "damaged")
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (10, 20, 30):
        (folder / f"step-{step}.pt").write_bytes(made["path"].read_bytes())
    flip_bytes(folder / "step-20.pt")
    result = cli("average", "--last", "5", "--dir", str(folder), "-o", str(tmp_path / "avg.pt"))
    assert result.returncode == 2 and not (tmp_path / "avg.pt").exists()
    one_error_line(result.stderr, "step-20.pt")


# ---- 3. averaging -----------------------------------------------------------------------------------


def test_average_accepts_only_checkpoints_of_one_model(made, tmp_path):
    raw = config_to_dict(made["cfg"])
    other_cfg = config_from_dict({**raw, "model": {**raw["model"], "d_ff": 128}})
    other_model = Transformer(other_cfg.model, VOCAB)
    nan_state = {k: v.clone() for k, v in made["state"].items()}
    nan_state[next(k for k, v in nan_state.items() if v.is_floating_point())].view(-1)[0] = float("nan")
    # The same number of pieces, other ones: a model of another language pair.
    letters = "qrstuvwxyzäöüßéè"
    lines = [" ".join(letters[(i * 7 + j) % 16] for j in range(8)) for i in range(500)]
    other_vocab = train_sentencepiece(lines, tmp_path / "other" / "spm", VOCAB, model_type="word").proto
    cases = {
        "config": save(tmp_path / "config.pt", other_model.state_dict(), other_cfg, made["subword"].proto),
        "vocabulary": save(tmp_path / "vocab.pt", made["state"], made["cfg"], other_vocab),
        "nan": save(tmp_path / "nan.pt", nan_state, made["cfg"], made["subword"].proto),
    }
    for name, path in cases.items():
        result = CliRunner().invoke(
            app, ["average", str(made["path"]), str(path), "-o", str(tmp_path / "a.pt")]
        )
        assert result.exit_code == 2, (name, result.output)
        one_error_line(result.stderr, path.name)
    assert not (tmp_path / "a.pt").exists()


def test_average_holds_one_input_at_a_time_and_is_the_mean(made, tmp_path, monkeypatch):
    import weakref

    import nmt.checkpoint

    paths = []
    for i in range(3):
        state = {k: v + 0.25 * i for k, v in made["state"].items()}
        paths.append(save(tmp_path / f"step-{i}.pt", state, made["cfg"], made["subword"].proto))
    alive, read = [], nmt.checkpoint.load_checkpoint

    def tracked(path: Path):
        # no earlier input may still be in memory (last.pt carries its optimizer's state too)
        assert all(ref() is None for ref in alive), f"an input before {path.name} is still held"
        ckpt = read(path)
        alive.extend(weakref.ref(v) for v in ckpt.model_state.values())
        return ckpt

    monkeypatch.setattr(nmt.checkpoint, "load_checkpoint", tracked)
    nmt.checkpoint.average_checkpoints(paths, tmp_path / "a.pt")
    averaged = read(tmp_path / "a.pt").model_state
    for k, v in made["state"].items():  # the inputs' weights summed in float64, in order, over 3
        expected = (v.double() + (v + 0.25).double() + (v + 0.5).double()) / 3
        assert torch.equal(averaged[k], expected.to(v.dtype)), k


def test_average_refuses_other_shapes_with_one_line(made, tmp_path):
    shaped = {k: v.clone() for k, v in made["state"].items()}
    key = next(k for k, v in shaped.items() if v.dim() == 2)
    shaped[key] = torch.zeros(shaped[key].shape[0] + 1, shaped[key].shape[1])
    # Written by hand: load_checkpoint itself accepts any shapes, only a model or an average cares.
    path = save(tmp_path / "shapes.pt", shaped, made["cfg"], made["subword"].proto)
    result = CliRunner().invoke(app, ["average", str(made["path"]), str(path), "-o", str(tmp_path / "a.pt")])
    assert result.exit_code == 2
    one_error_line(result.stderr, "shapes.pt", key)


@pytest.mark.parametrize("n", ["0", "-2"])
def test_average_last_wants_one_or_more(made, tmp_path, n):
    (tmp_path / "step-1.pt").write_bytes(made["path"].read_bytes())
    (tmp_path / "step-2.pt").write_bytes(made["path"].read_bytes())
    result = CliRunner().invoke(
        app, ["average", "--last", n, "--dir", str(tmp_path), "-o", str(tmp_path / "a.pt")]
    )
    assert result.exit_code == 2 and not (tmp_path / "a.pt").exists()
    one_error_line(result.stderr, f"--last {n}")


# ---- 4. loading validates ---------------------------------------------------------------------------


def rewrite(source: Path, target: Path, change) -> Path:
    payload = torch.load(source, weights_only=True)
    change(payload)
    torch.save(payload, target)
    return target


def set_nan(p: dict) -> None:
    name = next(k for k, v in p["model"].items() if v.is_floating_point())
    p["model"][name].view(-1)[0] = float("nan")


def wrong_shape(p: dict) -> None:
    name = next(k for k, v in p["model"].items() if v.dim() == 2)
    p["model"][name] = torch.zeros(3, 3)


def a_weight_as(make):
    """A change that replaces a matrix of the checkpoint by make(matrix)."""

    def change(p: dict) -> None:
        name = next(k for k, v in p["model"].items() if v.dim() == 2)
        p["model"][name] = make(p["model"][name])

    return change


@pytest.mark.parametrize(
    "change, field",
    [
        (set_nan, "model."),
        (wrong_shape, "weights do not fit"),
        (lambda p: p["model"].pop(next(iter(p["model"]))), "weights do not fit"),
        (lambda p: p["model"].update(extra=torch.zeros(2)), "weights do not fit"),
        # types torch.load reads: float8 and sparse ended in a traceback, integer and complex were cast
        (a_weight_as(lambda w: w.to(torch.float8_e4m3fn)), "float8_e4m3fn, not float16"),
        (a_weight_as(lambda w: w.to(torch.int32)), "int32, not float16"),
        (a_weight_as(lambda w: w.to(torch.complex64)), "complex64, not float16"),
        (a_weight_as(lambda w: w.to_sparse()), "sparse_coo tensor, not a dense one"),
        (lambda p: p.update(subword=p["subword"].to_sparse()), "subword"),
        (lambda p: p.update(shortlist={"frequent": torch.tensor([4]).to_sparse()}), "shortlist.frequent"),
        (lambda p: p.pop("vocab_size"), "vocab_size"),
        (lambda p: p.update(vocab_size="twenty"), "vocab_size"),
        (lambda p: p.update(config=[1, 2]), "config"),
        (lambda p: p["config"]["model"].update(heads="four"), "config: model.heads"),
        (lambda p: p.update(model={"encoder.embed": "weights"}), "model.encoder.embed"),
        (lambda p: p.pop("model"), "model"),
        (
            lambda p: p.update(subword=torch.tensor(list(b"not a sentencepiece model"), dtype=torch.uint8)),
            "subword",
        ),
        (lambda p: p.update(subword=torch.zeros(3)), "subword"),
        (lambda p: p.update(train_state="yes"), "train_state"),
        (lambda p: p.update(train_state={"progress": {}}), "train_state.optimizer"),
    ],
)
def test_loading_validates_each_field_with_one_line(made, tmp_path, change, field):
    path = rewrite(made["path"], tmp_path / "bad.pt", change)
    result = CliRunner().invoke(app, ["translate", "-m", str(path)], input=b"a b\n")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    one_error_line(result.stderr, "bad.pt", field)


def test_a_directory_as_model_says_it_is_one(made, tmp_path):
    result = cli("translate", "-m", str(tmp_path), stdin=b"a\n")
    assert result.returncode == 2
    one_error_line(result.stderr, f"{tmp_path}: is a directory")


# ---- 5. strict recipes ------------------------------------------------------------------------------


def recipe_with(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


BASE = """data:
  src_lang: en
  tgt_lang: de
  train: [{name: t, src: {url: "http://h/a", sha256: "0"}, tgt: {url: "http://h/b", sha256: "0"}}]
  valid: [{name: v, src: {url: "http://h/c", sha256: "0"}, tgt: {url: "http://h/d", sha256: "0"}}]
train:
  batch_tokens: 2048
  warmup: 100
"""


def test_a_duplicate_section_is_an_error_naming_the_key_and_both_lines(tmp_path):
    load_config(recipe_with(tmp_path, BASE))  # the base is valid
    with pytest.raises(ConfigError) as e:
        load_config(recipe_with(tmp_path, BASE + "model:\n  heads: 4\ntrain:\n  max_steps: 10\n"))
    assert "'train'" in str(e.value) and "line 6" in str(e.value) and "line 11" in str(e.value)
    nested = BASE + "  warmup: 200\n"
    with pytest.raises(ConfigError) as e:
        load_config(recipe_with(tmp_path, nested))
    assert "'warmup'" in str(e.value) and "line 8" in str(e.value) and "line 9" in str(e.value)
    result = CliRunner().invoke(app, ["train", str(tmp_path / "recipe.yaml"), "--dry-run"])
    assert result.exit_code == 2
    one_error_line(result.stderr, "recipe.yaml", "warmup")


@pytest.mark.parametrize("key, value", [("max_len_b", "-100"), ("max_len_a", "-1"), ("lenpen", ".nan")])
def test_decode_limits_have_one_set_of_rules(made, key, value):
    with pytest.raises(ConfigError, match=f"decode.{key}"):
        load_config("multi30k-en-de", [f"decode.{key}={value}"])
    if value != ".nan":
        option = "--" + key.replace("_", "-")
        result = CliRunner().invoke(
            app, ["translate", "-m", str(made["path"]), f"{option}={value}"], input=b"a\n"
        )
        assert result.exit_code == 2 and result.stdout == ""
        one_error_line(result.stderr, option)


# ---- 6. limits before work --------------------------------------------------------------------------


def test_an_over_long_line_is_cut_before_sentencepiece_sees_it(made, monkeypatch):
    from nmt.subword import Subword
    from nmt.translate import Translator

    seen: list[int] = []
    encode = Subword.encode

    def spy(self, lines):
        seen.extend(len(line) for line in lines)
        return encode(self, lines)

    monkeypatch.setattr(Subword, "encode", spy)
    model = Transformer(made["cfg"].model, made["subword"].vocab_size).eval()
    translator = Translator(model, made["subword"], made["cfg"].decode, torch.device("cpu"))
    huge = "a b " * 1_000_000  # 4 MB of words
    out = translator.translate([huge, "c d"])
    assert len(out) == 2
    assert max(seen) <= translator.max_chars < 4_000_000
    # The cut keeps every character the model's positions can hold: a line just fitting is not cut.
    fitting = " ".join(["a"] * translator.max_source)
    seen.clear()
    translator.translate([fitting])
    assert seen == [len(fitting)]


def test_reading_a_huge_line_keeps_only_what_the_model_can_use():
    huge = b"x" * 5_000_000
    stream = io.BytesIO(b"first\n" + huge + "\u00e9".encode() * 10 + b"\nlast")
    (chunk,) = read_chunks(stream, 10, max_bytes=1000)
    assert chunk == [b"first", b"x" * 1000, b"last"]
    stream = io.BytesIO(b"y" * 999 + "\u00e9".encode() + b"\n")  # the cut falls inside a character
    (chunk,) = read_chunks(stream, 10, max_bytes=1000)
    assert chunk == [b"y" * 999]  # never half a character (it would read as invalid UTF-8)


def test_a_line_of_control_characters_is_not_a_sentence(made):
    result = cli("translate", "-m", str(made["path"]), stdin=b"\x00\n\x00\x07\x1b\na\x00b\n")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.decode().split("\n")
    assert lines[:2] == ["", ""] and len(lines) == 4
    assert (
        "control characters replaced" in result.stderr.decode() and "line 1, 2, 3" in result.stderr.decode()
    )


# ---- 7. quiet edges ---------------------------------------------------------------------------------


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
def test_a_reader_that_goes_away_ends_quietly(made, tmp_path):
    # --interactive answers line by line; the later lines come after head has gone, so their
    # translations meet the closed pipe.
    result = subprocess.run(
        f"(echo a b c; sleep 1; yes a b c | head -n 50) | {sys.executable} -m nmt translate "
        f"-m {made['path']} --interactive | head -n 1; " 'echo "status ${PIPESTATUS[1]}" >&2',
        shell=True, executable="/bin/bash", capture_output=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert len(result.stdout.splitlines()) == 1
    assert result.stderr.decode().strip() == "status 141"  # as a Unix tool that SIGPIPE ended, and silent


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
def test_a_closed_stdout_is_one_line(made):
    result = subprocess.run(
        f"{sys.executable} -m nmt translate -m {made['path']} >&-",
        shell=True, input=b"a b\n", capture_output=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    one_error_line(result.stderr, "standard output is closed")


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("how", ["-o /dev/full", "> /dev/full", "score > /dev/full"])
def test_a_full_disk_is_one_line_and_exit_1(made, tmp_path, how):
    ref = tmp_path / "ref.txt"
    ref.write_text("a b c\n" * 3)
    if how.startswith("score"):
        command = f"{sys.executable} -m nmt score -r {ref} -i {ref} --json > /dev/full"
    else:
        command = f"{sys.executable} -m nmt translate -m {made['path']} -i {ref} {how}"
    result = subprocess.run(command, shell=True, capture_output=True, env=ENV, timeout=120)
    assert result.returncode == 1
    assert "No space left on device" in one_error_line(result.stderr)
    assert Path("/dev/full").is_char_device()  # written to, never replaced by a file


def test_serve_refuses_an_impossible_port_in_one_line(made):
    result = CliRunner().invoke(app, ["serve", "-m", str(made["path"]), "--port", "70000"])
    assert result.exit_code == 2
    one_error_line(result.stderr, "--port 70000")


def test_serve_refuses_to_start_on_non_finite_weights(made, tmp_path):
    pytest.importorskip("uvicorn", reason="nmt serve needs its extra: pip install 'nmt[serve]'")
    path = rewrite(made["path"], tmp_path / "nan.pt", set_nan)
    result = CliRunner().invoke(app, ["serve", "-m", str(path), "--port", "0"])
    assert result.exit_code == 2  # before listening: no server that would answer every request 500
    one_error_line(result.stderr, "nan.pt", "NaN")


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
def test_long_warnings_are_one_line_when_stderr_is_a_file(made):
    stdin = b"\n" * 1000 + b"".join(b"bad \xff utf-8\n" for _ in range(15))  # lines 1001 to 1015
    result = run("translate", "-m", str(made["path"]), stdin=stdin)
    assert result.returncode == 0
    warning = [line for line in result.stderr.decode().splitlines() if "invalid UTF-8" in line]
    assert len(warning) == 1 and len(warning[0]) > 80 and warning[0].endswith("and 5 more")


# ---- 8. no local paths in model files ----------------------------------------------------------------


def test_the_sentencepiece_model_is_the_same_in_any_work_directory(tmp_path):
    from nmt.subword import train_subword

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"the {w} sat on a mat number {i}\n" for i, w in enumerate(["cat", "dog"] * 200)))
    data = make_config().data
    models = [
        train_subword([text], tmp_path / name / "data" / "spm", data).read_bytes()
        for name in ("work-one", "a-much-longer-work-directory")
    ]
    assert models[0] == models[1]
    assert b"work-one" not in models[0] and str(tmp_path).encode() not in models[0]
    assert (tmp_path / "work-one" / "data" / "spm.vocab").read_text().startswith("<pad>\t")


def test_an_empty_training_corpus_says_so(tmp_path):
    from nmt.subword import train_subword

    empty = tmp_path / "train.clean.en"
    empty.write_text("\n\n")
    with pytest.raises(DataError) as e:
        train_subword([empty], tmp_path / "spm", make_config().data)
    assert "train.clean.en" in str(e.value) and "empty" in str(e.value) and "vocab_size" not in str(e.value)
