"""Fine-tuning: a run that starts from a checkpoint (`data.init_from`, or `--init-from` on preprocess,
train and run) instead of from random weights and new subwords.

The checkpoint decides what its weights mean: the model keys and the vocabulary. A recipe may leave them
out (they are taken from the checkpoint) or repeat them, but not contradict them; only the dropout rates,
which change training and not the weights, are the recipe's to set. Preprocessing encodes with the
checkpoint's own subword models rather than training new ones, and training starts from its weights with
the recipe's optimizer and schedule, fresh. Everything else (stops, resume, averaging) is an ordinary run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from nmt.errors import ConfigError, DataError

# Model keys a fine-tuning recipe may change: they shape training, not the weights.
REGULARIZATION = ("dropout", "attention_dropout", "activation_dropout")
# Data keys that describe the vocabulary, which the checkpoint fixes.
VOCABULARY_KEYS = ("vocab_size", "subword_type")


def merge_init_from(raw: dict, source: str) -> None:
    """Fill a raw recipe's model and vocabulary keys from the checkpoint `data.init_from` names, or
    raise ConfigError naming the first key that contradicts it."""
    from nmt.checkpoint import load_checkpoint
    from nmt.config import config_to_dict
    from nmt.errors import CheckpointError

    path = raw["data"]["init_from"]
    if not isinstance(path, str):
        raise ConfigError(f"{source}: data.init_from: expected a checkpoint path, got {path!r}")
    try:
        base = config_to_dict(load_checkpoint(Path(path)).config)
    except CheckpointError as e:
        raise ConfigError(f"{source}: data.init_from: {e}") from None
    model = raw.setdefault("model", {})
    if not isinstance(model, dict):
        raise ConfigError(f"{source}: model: expected a mapping")
    for section, keys, given in (
        ("model", [k for k in base["model"] if k not in REGULARIZATION], model),
        ("data", VOCABULARY_KEYS, raw["data"]),
    ):
        for key in keys:
            want = base[section][key]
            if key in given and given[key] != want:
                raise ConfigError(
                    f"{source}: {section}.{key} is {given[key]!r} but {path} has {want!r}; "
                    f"leave {section}.{key} out to take the checkpoint's"
                )
            given[key] = want
    for key in REGULARIZATION:
        model.setdefault(key, base["model"][key])


def init_subword(path: str | Path) -> bytes:
    """The checkpoint's subword model, as data/spm.model holds it."""
    from nmt.checkpoint import load_checkpoint

    return load_checkpoint(Path(path)).subword_proto


def subword_sha256(proto: bytes) -> str:
    return hashlib.sha256(proto).hexdigest()


def init_weights(model, path: str | Path, subword) -> None:
    """Load the checkpoint's weights into `model`, after checking that the run's subwords are its own."""
    from nmt.checkpoint import load_checkpoint

    ckpt = load_checkpoint(Path(path))
    if ckpt.subword_proto != subword.proto:
        raise DataError(
            f"data/spm.model is not the subword model of {path}: run `nmt preprocess --init-from {path}` "
            "with this recipe first"
        )
    model.load_state_dict(ckpt.model_state)
