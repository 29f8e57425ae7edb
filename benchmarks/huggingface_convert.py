"""How long `nmt export --format huggingface` and `nmt import` take on a base-size model (63M parameters).

Random weights: the paper's base Transformer (6+6 layers, d_model 512, d_ff 2048, 8 heads) over a
37,000-piece vocabulary, with two small SentencePiece models (the conversion copies them, whatever
their size). Each command runs as a user runs it, a fresh `nmt` process, so interpreter start and
imports are part of the time; the round trip is checked to give back the same weights.

    python benchmarks/huggingface_convert.py [--vocab 37000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sentencepiece as spm
import torch

from nmt.checkpoint import load_checkpoint, save_checkpoint
from nmt.config import config_from_dict
from nmt.model import Transformer, count_parameters
from nmt.subword import Subword
from nmt.tokens import BOS, EOS, PAD, UNK


def base_checkpoint(path: Path, vocab: int, workdir: Path) -> int:
    """A random base-size checkpoint with a `vocab`-piece vocabulary; returns its parameter count."""
    rng = random.Random(0)
    text = workdir / "spm.txt"
    text.write_text("\n".join(" ".join(rng.choice("abcdefgh") * 3 for _ in range(8)) for _ in range(200)))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(workdir / "spm"), vocab_size=20, minloglevel=2,
        pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
    )  # fmt: skip
    proto = (workdir / "spm.model").read_bytes()
    pieces = ["<pad>", "<unk>", "<s>", "</s>"] + [f"▁w{i}" for i in range(vocab - 4)]
    subword = Subword.pair(proto, proto, pieces)
    cfg = config_from_dict(
        {"data": {"src_lang": "en", "tgt_lang": "de", "train": [], "valid": [], "vocab_size": vocab}},
        corpora=False,
    )
    torch.manual_seed(0)
    model = Transformer(cfg.model, vocab)
    save_checkpoint(
        path, model_state=model.state_dict(), config=cfg, subword_proto=subword.proto, vocab_size=vocab
    )
    return count_parameters(model)


def timed(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "nmt", *args], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        original = work / "base.pt"
        params = base_checkpoint(original, args.vocab, work)
        exports, imports = [], []
        for i in range(args.repeats):
            folder, back = work / f"hf{i}", work / f"back{i}.pt"
            exports.append(
                timed(["export", "-m", str(original), "--format", "huggingface", "-o", str(folder)])
            )
            imports.append(timed(["import", str(folder), "-o", str(back)]))
        a, b = load_checkpoint(original).model_state, load_checkpoint(back).model_state
        same = all(torch.equal(a[k], b[k]) for k in a)
        size = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
    print(f"parameters: {params:,}; MarianMT folder {size:.0f} MiB; round trip same weights: {same}")
    print("export --format huggingface: " + ", ".join(f"{s:.1f} s" for s in exports))
    print("import:                      " + ", ".join(f"{s:.1f} s" for s in imports))


if __name__ == "__main__":
    main()
