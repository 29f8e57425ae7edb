"""A synthetic translation task built in seconds: reverse a random sequence of letter-words.

`make_workdir` writes exactly what `nmt preprocess` would (a SentencePiece model, binarized train and
valid splits, raw validation text), so the real trainer, checkpoints and translator run on it unchanged.
"""

from __future__ import annotations

import random
from pathlib import Path

from nmt.config import Config, config_from_dict
from nmt.data.binarized import write_split
from nmt.subword import Subword, train_sentencepiece

LETTERS = "abcdefghijklmnop"


def sentence(rng: random.Random, low: int = 1, high: int = 10) -> str:
    """From one word up: tests send one- and two-word lines (an HTML text node, a short request), which a
    model trained on three words and more answered by CPU-dependent chance ('e' -> 'e e')."""
    return " ".join(rng.choice(LETTERS) for _ in range(rng.randint(low, high)))


def reverse(line: str) -> str:
    return " ".join(reversed(line.split()))


def make_subword(directory: Path) -> Subword:
    """A character-level SentencePiece model over the letters (each word is one piece)."""
    rng = random.Random(0)
    lines = [sentence(rng) for _ in range(2000)]
    return train_sentencepiece(lines, directory / "spm", len(LETTERS) + 4, model_type="word")


def make_config(**train_overrides) -> Config:
    dummy = {"url": "http://127.0.0.1/none", "sha256": "0" * 64}
    corpus = {"name": "synthetic", "src": dummy, "tgt": dummy}
    return config_from_dict(
        {
            "data": {
                "src_lang": "xx",
                "tgt_lang": "yy",
                "train": [corpus],
                "valid": [corpus],
                "vocab_size": 64,
            },
            "model": {
                "encoder_layers": 2,
                "decoder_layers": 2,
                "d_model": 64,
                "d_ff": 256,
                "heads": 4,
                "dropout": 0.0,
                "max_positions": 64,
            },
            "train": {
                "batch_tokens": 1024,
                "update_tokens": 1024,
                "warmup": 50,
                "peak_lr": 0.003,
                "label_smoothing": 0.1,
                "max_steps": 100,
                "log_every": 10,
                "validate_every": 1000,
                "save_every": 1000,
                "valid_bleu": False,
                # fp32 unless a test asks otherwise: `auto` picks bf16 on a CPU with AVX512-BF16 or AMX,
                # which would make every model trained here another model on such a machine.
                "precision": "fp32",
                **train_overrides,
            },
            "decode": {"beam": 4, "lenpen": 0.6, "max_len_a": 1.0, "max_len_b": 5},
        }
    )


def make_workdir(workdir: Path, n_train: int = 4000, n_valid: int = 100, seed: int = 1) -> Subword:
    """Preprocessed data of the reversal task under workdir/data, as `nmt preprocess` lays it out."""
    data = workdir / "data"
    subword = make_subword(data)
    rng = random.Random(seed)
    for split, n in (("train", n_train), ("valid", n_valid)):
        src = [sentence(rng) for _ in range(n)]
        tgt = [reverse(s) for s in src]
        write_split(data / split, subword.encode(src), subword.encode(tgt), vocab_size=subword.vocab_size)
        if split == "valid":
            (data / "valid.xx").write_text("\n".join(src) + "\n")
            (data / "valid.yy").write_text("\n".join(tgt) + "\n")
    return subword


def translate_summary(run: Path, *options: str) -> str:
    """The summary line (`translated N lines in ...; device ...`) of `nmt translate` of a trained
    synthetic run's best model over its validation source, with `options`."""
    from typer.testing import CliRunner

    from nmt.cli import app

    model, source = run / "checkpoints" / "best.pt", run / "data" / "valid.xx"
    result = CliRunner().invoke(app, ["translate", "-m", str(model), "-i", str(source), *options])
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("translated ")]
    return line
