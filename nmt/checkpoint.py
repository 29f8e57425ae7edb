"""One self-describing checkpoint file: config, SentencePiece model, weights and training state.

A checkpoint is enough to translate (it carries its own subword model) and enough to resume (optimizer,
schedule, scaler, RNG and data position). It holds only tensors, dicts, lists, strings and numbers, so it
loads with `torch.load(weights_only=True)` and never unpickles code. Writes are atomic (nmt.atomic), so a
kill at any moment leaves the previous file intact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from nmt.atomic import atomic_write
from nmt.config import Config, config_from_dict, config_to_dict
from nmt.errors import CheckpointError, ConfigError

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


def save_checkpoint(
    path: Path,
    *,
    model_state: dict[str, Tensor],
    config: Config,
    subword_proto: bytes,
    vocab_size: int,
    train_state: dict | None = None,
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
    with atomic_write(path) as f:
        torch.save(payload, f)


def load_checkpoint(path: Path) -> Checkpoint:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a truncated zip, a foreign pickle, random bytes: all the same to a user
        raise CheckpointError(
            f"{path}: not a readable nmt checkpoint (truncated, or another kind of file)"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an nmt checkpoint")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {payload.get('version')} is not supported")
    try:
        config = config_from_dict(payload["config"], source=str(path), corpora=False)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    return Checkpoint(
        config=config,
        vocab_size=int(payload["vocab_size"]),
        model_state=payload["model"],
        subword_proto=payload["subword"].numpy().tobytes(),
        train_state=payload.get("train_state"),
    )


def load_model(path: Path, device: str | torch.device = "cpu"):
    """A checkpoint as a ready model: (Transformer in eval mode, Subword, Config)."""
    from nmt.data.subword import Subword
    from nmt.model import Transformer

    ckpt = load_checkpoint(path)
    model = Transformer(ckpt.config.model, ckpt.vocab_size)
    try:
        model.load_state_dict(ckpt.model_state)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not fit the model it describes ({str(e)[:160]})") from None
    return model.to(device).eval(), Subword(ckpt.subword_proto), ckpt.config


def step_checkpoints(directory: Path) -> list[Path]:
    """The `step-N.pt` files of a folder, oldest step first."""
    found = [
        (int(m.group(1)), p) for p in Path(directory).glob("step-*.pt") if (m := STEP_FILE.search(p.name))
    ]
    return [p for _, p in sorted(found)]


def last_checkpoints(directory: Path, n: int) -> list[Path]:
    found = step_checkpoints(directory)
    if not found:
        raise CheckpointError(f"{directory}: no step-N.pt checkpoints")
    return found[-n:]


def average_checkpoints(paths: list[Path], output: Path) -> None:
    """Element-wise mean of the weights (paper, 6.1); config and subwords from the last file."""
    total: dict[str, Tensor] | None = None
    last = None
    for path in paths:
        last = load_checkpoint(path)
        if total is None:
            total = {
                k: v.double().clone() if v.is_floating_point() else v for k, v in last.model_state.items()
            }
            continue
        if total.keys() != last.model_state.keys():
            raise CheckpointError(f"{path}: its weights do not match those of {paths[0]}")
        for k, v in last.model_state.items():
            if v.is_floating_point():
                total[k] += v.double()
    assert total is not None and last is not None
    averaged = {
        k: (v / len(paths)).to(last.model_state[k].dtype) if v.is_floating_point() else v
        for k, v in total.items()
    }
    save_checkpoint(
        output,
        model_state=averaged,
        config=last.config,
        subword_proto=last.subword_proto,
        vocab_size=last.vocab_size,
    )
