"""One self-describing checkpoint file: config, SentencePiece model, weights and training state.

A checkpoint is enough to translate (it carries its own subword model) and enough to resume (optimizer,
schedule, scaler, RNG and data position). It holds only tensors, dicts, lists, strings and numbers, so it
loads with `torch.load(weights_only=True)` and never unpickles code. Writes are atomic (nmt.atomic), so a
kill at any moment leaves the previous file intact.

Fine-tuning: a run may start from a checkpoint (`data.init_from`, or `--init-from` on preprocess, train
and run) instead of from random weights and new subwords. The checkpoint decides what its weights mean:
the model keys and the vocabulary. A recipe may leave them out (they are taken from the checkpoint,
`checkpoint_config`) or repeat them, but not contradict them; only the dropout rates, which change
training and not the weights, are the recipe's to set (nmt.config.merge_init_from). Preprocessing encodes
with the checkpoint's own subword models (`checkpoint_subword`) rather than training new ones, and
training starts from its weights (`init_weights`) with the recipe's optimizer and schedule, fresh.
Everything else (stops, resume, averaging) is an ordinary run.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from nmt.atomic import atomic_write, refuse_inputs
from nmt.config import Config, config_from_dict, config_to_dict
from nmt.errors import CheckpointError, ConfigError, DataError
from nmt.limits import check
from nmt.subword import Subword

FORMAT = "nmt-checkpoint"
VERSION = 1
STEP_FILE = re.compile(r"step-(\d+)\.pt$")


@dataclass
class Checkpoint:
    config: Config
    vocab_size: int
    model_state: dict[str, Tensor]
    subword_proto: bytes
    train_state: dict | None = None
    shortlist: dict[str, Tensor] | None = None  # nmt.shortlist: frequent (F,) and table (V, K) target ids


def save_checkpoint(
    path: Path,
    *,
    model_state: dict[str, Tensor],
    config: Config,
    subword_proto: bytes,
    vocab_size: int,
    train_state: dict | None = None,
    shortlist: dict[str, Tensor] | None = None,
) -> None:
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "config": config_to_dict(config),
        "vocab_size": vocab_size,
        "model": {k: v.detach().cpu() for k, v in model_state.items()},
        # bytes as a uint8 tensor: the weights-only unpickler is guaranteed to accept tensors.
        "subword": torch.frombuffer(bytearray(subword_proto), dtype=torch.uint8),
        "train_state": train_state,
    }
    if shortlist is not None:  # only then: checkpoints without one stay as they were
        payload["shortlist"] = shortlist
    with atomic_write(path) as f:
        torch.save(payload, f)


def verify_checkpoint(path: Path) -> None:
    """Check every entry of the checkpoint's zip against its CRC-32, which torch.load does not.

    torch.save stores each entry uncompressed with its CRC, so damage inside a file (a flipped byte in
    a tensor) loads as other weights unless the CRCs are checked; this reads the file once more, at
    zlib's CRC speed, and leaves it in the page cache for the load that follows.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError):
        damaged = "its zip directory"
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    if damaged is not None:
        raise CheckpointError(f"{path}: damaged checkpoint: {damaged} does not match its checksum")


def load_checkpoint(path: Path) -> Checkpoint:
    """Read and check a checkpoint: its checksums, its fields and types, finite weights and a loadable
    SentencePiece model. Anything wrong is a CheckpointError naming the file and the field."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            f"{path}: is a directory, not a checkpoint file (a folder from nmt export "
            "is read with --engine ctranslate2)"
        )
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: not a readable nmt checkpoint (truncated, or another kind of file)")
    verify_checkpoint(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a foreign pickle, a zip of something else: all the same to a user
        raise CheckpointError(
            f"{path}: not a readable nmt checkpoint (truncated, or another kind of file)"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an nmt checkpoint")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {payload.get('version')} is not supported")

    def field(name: str, ok: bool, why: str) -> None:
        if not ok:
            raise CheckpointError(f"{path}: field {name}: {why}")

    field("config", isinstance(payload.get("config"), dict), "missing or not a mapping")
    try:
        config = config_from_dict(payload["config"], source=f"{path}: field config", corpora=False)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    vocab_size = payload.get("vocab_size")
    field("vocab_size", type(vocab_size) is int and vocab_size > 0, "missing or not a positive integer")
    weights = payload.get("model")
    field("model", isinstance(weights, dict) and len(weights) > 0, "missing or not a mapping of weights")
    for name, tensor in weights.items():
        problem = weight_problem(tensor)
        field(f"model.{name}", problem is None, problem or "")
    subword = payload.get("subword")
    field("subword", dense(subword) and subword.dtype == torch.uint8, "missing or not bytes")
    proto = subword.numpy().tobytes()
    try:
        pieces = Subword(proto).vocab_size
    except DataError:  # SentencePiece's own message is a C++ source location
        raise CheckpointError(f"{path}: field subword: not a loadable SentencePiece model") from None
    field("subword", pieces == vocab_size, f"{pieces} subwords, but vocab_size says {vocab_size}")
    train_state = payload.get("train_state")
    field("train_state", train_state is None or isinstance(train_state, dict), "not a mapping")
    for key in ("progress", "optimizer", "rng") if train_state is not None else ():
        field(f"train_state.{key}", isinstance(train_state.get(key), dict), "missing or not a mapping")
    shortlist = payload.get("shortlist")
    if shortlist is not None:
        check_shortlist(shortlist, vocab_size, field)
    return Checkpoint(
        config=config,
        vocab_size=vocab_size,
        model_state=weights,
        subword_proto=proto,
        train_state=train_state,
        shortlist=shortlist,
    )


WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # a model's own are float32


def dense(value: object) -> bool:
    """Whether `value` is a tensor of the ordinary (strided) layout: a sparse one, which torch.load also
    reads, has none of the operators a check or a model uses (each raised an error of its own)."""
    return isinstance(value, Tensor) and value.layout == torch.strided


def all_finite(tensor: Tensor) -> bool:
    """Whether a floating-point tensor holds no NaN and no infinity: from its least and largest values,
    which NaN and the infinities reach. torch.isfinite(t).all() made 1.5x the tensor in temporaries
    (+129 MiB at the peak of loading a wmt14 base model, its embedding) and took 11x as long."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def weight_problem(tensor: object) -> str | None:
    """Why `tensor` cannot be a model weight, in words; None where it can: a dense tensor of one of
    WEIGHT_DTYPES (a float8, integer or complex one would reach operators that do not take it) holding
    only finite values."""
    if not isinstance(tensor, Tensor):
        return "not a tensor"
    if not dense(tensor):
        return f"a {str(tensor.layout).removeprefix('torch.')} tensor, not a dense one"
    if tensor.dtype not in WEIGHT_DTYPES:
        return f"{str(tensor.dtype).removeprefix('torch.')}, not float16, bfloat16, float32 or float64"
    return None if all_finite(tensor) else "holds NaN or infinite values"


def check_shortlist(shortlist, vocab_size: int, field) -> None:
    """The `shortlist` entry (nmt.shortlist): integer tensors frequent (F,) and table (vocab_size, K) of
    target ids within the vocabulary."""
    field("shortlist", isinstance(shortlist, dict), "not a mapping")
    for key, dims in (("frequent", 1), ("table", 2)):
        ids = shortlist.get(key)
        ok = dense(ids) and ids.dtype in (torch.int32, torch.int64) and ids.dim() == dims
        field(f"shortlist.{key}", ok, f"missing or not a {dims}-dimensional integer tensor")
        inside = ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < vocab_size)
        field(f"shortlist.{key}", inside, f"holds ids outside the {vocab_size} subwords")
    rows = shortlist["table"].shape[0]
    field("shortlist.table", rows == vocab_size, f"{rows} rows, but vocab_size says {vocab_size}")


def checkpoint_config(path: Path) -> dict:
    """A checkpoint's config as a plain dict: what a fine-tuning recipe takes its model keys from."""
    return config_to_dict(load_checkpoint(path).config)


def checkpoint_subword(path: str | Path) -> bytes:
    """A checkpoint's subword model, as a fine-tuning run's data/spm.model holds it."""
    return load_checkpoint(Path(path)).subword_proto


def init_weights(model, path: str | Path, subword: Subword) -> None:
    """Load the checkpoint's weights into `model`, after checking that the run's subwords are its own."""
    ckpt = load_checkpoint(Path(path))
    if ckpt.subword_proto != subword.proto:
        raise DataError(
            f"data/spm.model is not the subword model of {path}: run `nmt preprocess --init-from {path}` "
            "with this recipe first"
        )
    model.load_state_dict(ckpt.model_state)


class LoadedModel(NamedTuple):
    """A model ready to translate, with what it needs: its subwords and its config."""

    model: torch.nn.Module  # nmt.model.Transformer
    subword: Subword
    config: Config


def load_model(path: Path, device: str | torch.device = "cpu") -> LoadedModel:
    """A checkpoint as a ready model: (Transformer in eval mode, Subword, Config)."""
    return read_model(path, device)[0]


def read_model(
    path: Path, device: str | torch.device = "cpu"
) -> tuple[LoadedModel, dict[str, Tensor] | None]:
    """`load_model`, and the `shortlist` entry the checkpoint carries (None where it has none), from one
    read of the file."""
    from nmt.model import Transformer

    ckpt = load_checkpoint(path)
    try:
        model = Transformer.with_weights(ckpt.config.model, ckpt.vocab_size, ckpt.model_state)
    except RuntimeError as e:
        why = " ".join(str(e).split())[:160]  # torch's message spans lines: the error is one
        raise CheckpointError(f"{path}: weights do not fit the model it describes ({why})") from None
    return LoadedModel(model.to(device).eval(), Subword(ckpt.subword_proto), ckpt.config), ckpt.shortlist


def step_checkpoints(directory: Path) -> list[Path]:
    """The `step-N.pt` files of a folder, oldest step first."""
    found = [
        (int(m.group(1)), p) for p in Path(directory).glob("step-*.pt") if (m := STEP_FILE.search(p.name))
    ]
    return [p for _, p in sorted(found)]


def last_checkpoints(directory: Path, n: int) -> list[Path]:
    check("--last", n)
    found = step_checkpoints(directory)
    if not found:
        raise CheckpointError(f"{directory}: no step-N.pt checkpoints")
    return found[-n:]


def average_last(cfg: Config, ckpt_dir: Path, console) -> Path:
    """Average the last `train.average_last` step checkpoints into average.pt (paper, section 6.1)."""
    out = ckpt_dir / "average.pt"
    sources = last_checkpoints(ckpt_dir, cfg.train.average_last)
    if out.exists() and out.stat().st_mtime >= max(p.stat().st_mtime for p in sources):
        console.print(f"average: already done ({out})")
        return out
    average_checkpoints(sources, out)
    console.print(f"average: {len(sources)} checkpoints ({sources[0].name} .. {sources[-1].name}) -> {out}")
    return out


def average_checkpoints(paths: list[Path], output: Path, shortlist: bool = True) -> str | None:
    """Element-wise mean of the weights (paper, 6.1); config and subwords from the last file.

    Only checkpoints of one model are averaged: the same model config, the same SentencePiece model
    and the same weight names, shapes and types (each file's own checks, on loading, rule out damage
    and non-finite weights); anything else is a CheckpointError naming the file. A shortlist (nmt
    shortlist) that every input carries alike is kept (unless `shortlist` is False); where the inputs
    differ in theirs, none is written and the returned note says so, never in silence.
    """
    refuse_inputs(output, paths)  # before the work: `-o b.pt` would replace an input
    total: dict[str, Tensor] | None = None
    first = last = None
    lists: list[dict[str, Tensor] | None] = []
    for path in paths:
        # One input in memory at a time, with the sum: five base-size step files took 1.2 GiB at the
        # peak when the first stayed whole and every addend was copied to float64, and an input that
        # carries its optimizer's state (last.pt, twice the weights more with Adam) holds that too
        # (benchmarks/RESULTS.md).
        last = None
        last = load_checkpoint(path)
        lists.append(last.shortlist)
        if first is None:
            # what the others are compared with: the first's weights' names, shapes and types (meta)
            meta = {k: v.to("meta") for k, v in last.model_state.items()}
            first = replace(last, model_state=meta, train_state=None)
            # every weight is floating-point (weight_problem); the sum in float64, a copy in any case
            total = {k: v.to(torch.float64, copy=True) for k, v in last.model_state.items()}
            continue
        same_as(path, last, paths[0], first)
        for k, v in total.items():
            v += last.model_state[k]  # in float64, converted element by element: no float64 copy
    assert total is not None and last is not None and first is not None
    config, subword_proto, vocab_size = last.config, last.subword_proto, last.vocab_size
    last = None  # its weights and optimizer state are summed: the mean is made in their place
    averaged = {}
    for k in list(total):  # a weight at a time out of the sum, which shrinks as the mean grows
        averaged[k] = total.pop(k).div_(len(paths)).to(first.model_state[k].dtype)
    kept, note = shared_shortlist(paths, lists) if shortlist else (None, None)
    if not shortlist and any(x is not None for x in lists):
        note = "left out the shortlist of the inputs (--no-shortlist)"
    save_checkpoint(
        output,
        model_state=averaged,
        config=config,
        subword_proto=subword_proto,
        vocab_size=vocab_size,
        shortlist=kept,
    )
    return note


def shared_shortlist(
    paths: list[Path], lists: list[dict[str, Tensor] | None]
) -> tuple[dict[str, Tensor] | None, str | None]:
    """The shortlist all of `lists` hold alike (and no note), or None and a note naming the first input
    that differs; (None, None) when none holds one."""
    if all(x is None for x in lists):
        return None, None
    first = lists[0]
    for path, other in zip(paths, lists, strict=True):
        same = (
            first is not None
            and other is not None
            and first.keys() == other.keys()
            and all(torch.equal(first[k], other[k]) for k in first)
        )
        if not same:
            why = "carries none" if other is None or first is None else "carries another"
            culprit = path if other is None or first is not None else paths[0]
            return None, f"dropped the shortlist: {culprit} {why}; run nmt shortlist on the average"
    return first, None


def same_as(path: Path, ckpt: Checkpoint, first_path: Path, first: Checkpoint) -> None:
    """Refuse, naming `path`, a checkpoint that is not of the same model as `first`."""
    if ckpt.config.model != first.config.model:
        raise CheckpointError(f"{path}: another model config than {first_path}'s; only one model's average")
    if ckpt.subword_proto != first.subword_proto:
        raise CheckpointError(f"{path}: another SentencePiece vocabulary than {first_path}'s")
    if ckpt.model_state.keys() != first.model_state.keys():
        raise CheckpointError(f"{path}: its weights do not match those of {first_path}")
    for k, v in ckpt.model_state.items():
        w = first.model_state[k]
        if v.shape != w.shape or v.dtype != w.dtype:
            raise CheckpointError(
                f"{path}: weight {k} is {v.dtype} {tuple(v.shape)}, "
                f"in {first_path} {w.dtype} {tuple(w.shape)}"
            )
