"""Training speed side by side with fairseq: the same data, model, batches and threads, one after the other.

Target tokens/s and peak RSS of `nmt train` (--variants) and `fairseq-train` (--peers or $PEERS), each
for --minutes at --threads. Configuration, method and figures: benchmarks/README.md, Training speed side
by side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import common  # benchmarks/common.py: these scripts run with benchmarks/ on sys.path
from common import GIB, RESULTS

SECTION = "## Training speed side by side"
RECIPE = "multi30k-en-de"
OVERRIDES = (
    *"model.encoder_layers=3 model.decoder_layers=3 model.d_model=256 model.heads=4 model.d_ff=1024".split(),
    *"model.norm=post model.dropout=0.1 data.vocab_size=8000".split(),
    *"train.batch_tokens=4096 train.update_tokens=4096 train.warmup=1000 train.peak_lr=0.001".split(),
    *"train.validate_every=1000000 train.save_every=1000000 train.log_every=10".split(),
)
VARIANTS = {
    "fp32": ("train.precision=fp32", "train.compile=false"),
    "default": ("train.compile=false",),
    "compiled": ("train.compile=true",),
}
FAIRSEQ = "fairseq 0.12.3 fp32"


@dataclass
class Row:
    system: str
    tokens_per_s: float
    peak_rss: float  # GiB
    log_lines: int


def median_after_warmup(values: list[float]) -> float:
    """Median of the values after the first quarter (warm-up, compilation); nan when there are none."""
    return statistics.median(values[len(values) // 4 :]) if values else float("nan")


def run_timed(cmd: list[str], log: Path, env: dict) -> float:
    """Run `cmd` to the end with its output in `log`; returns its peak RSS in GiB."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    if (returncode := os.waitstatus_to_exitcode(status)) != 0:
        print(f"warning: {cmd[0]} exited {returncode}; see {log}", file=sys.stderr)
    return usage.ru_maxrss * 1024 / GIB


def nmt_row(name: str, overrides: tuple[str, ...], data: Path, out: Path, args, env: dict) -> Row:
    workdir = out / f"nmt-{name}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    (workdir / "data").symlink_to(data.resolve())
    sets = [*OVERRIDES, f"train.threads={args.threads}", f"train.max_minutes={args.minutes}", *overrides]
    sets += args.set or []
    cmd = [sys.executable, "-m", "nmt", "train", RECIPE, "--workdir", str(workdir)]
    cmd += [a for s in sets for a in ("--set", s)]
    rss = run_timed(cmd, out / f"nmt-{name}.log", env)
    metrics = workdir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.open()] if metrics.exists() else []
    speeds = [r["tokens_per_s"] for r in records if r.get("kind") == "train"]
    return Row(f"nmt {name}", median_after_warmup(speeds), rss, len(speeds))


def fairseq_row(peers: Path, out: Path, args, env: dict) -> Row:
    cmd = [str(peers / "venv-fairseq" / "bin" / "fairseq-train"), str(peers / "fairseq" / "data-bin")]
    cmd += shlex.split(
        "--cpu --num-workers 0 --seed 1 --source-lang en --target-lang de --arch transformer "
        "--encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256 "
        "--encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024 --encoder-attention-heads 4 "
        "--decoder-attention-heads 4 --share-all-embeddings --dropout 0.1 --attention-dropout 0.0 "
        "--activation-dropout 0.0 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 "
        "--optimizer adam --adam-betas (0.9,0.98) --adam-eps 1e-9 --clip-norm 0.0 --lr 1e-3 "
        "--lr-scheduler inverse_sqrt --warmup-updates 1000 --warmup-init-lr 1e-7 --max-tokens 4096 "
        "--no-save --disable-validation --log-format simple --log-interval 10"
    )
    cmd += ["--stop-time-hours", str(args.minutes / 60), "--save-dir", str(out / "fairseq-ckpt")]
    log = out / "fairseq.log"
    rss = run_timed(cmd, log, env)
    speeds = [float(x) for x in re.findall(r"wps=(\d+(?:\.\d+)?)", log.read_text(errors="replace"))]
    return Row(FAIRSEQ, median_after_warmup(speeds), rss, len(speeds))


def has_fairseq(peers: Path | None) -> bool:
    return (
        bool(peers)
        and (peers / "venv-fairseq" / "bin" / "fairseq-train").exists()
        and (peers / "fairseq" / "data-bin").is_dir()
    )


def table(rows: list[Row]) -> list[str]:
    base = next((r.tokens_per_s for r in rows if r.system == FAIRSEQ), None)
    return common.markdown_table(
        ["system", "target tok/s", "vs fairseq", "peak RSS", "log lines"],
        [
            [r.system, f"{r.tokens_per_s:,.0f}", f"{r.tokens_per_s / base:.2f}" if base else "n/a"]
            + [f"{r.peak_rss:.2f} GiB", str(r.log_lines)]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--data", type=Path, required=True, help="the data/ folder of `nmt preprocess multi30k-en-de`"
    )
    p.add_argument("--minutes", type=float, default=4.0, help="training minutes per system (default 4)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every system (default 2)")
    p.add_argument("--variants", default="fp32,default,compiled", help="nmt variants, comma-separated")
    p.add_argument("--peers", type=Path, default=os.environ.get("PEERS"), help="fairseq's folder (or $PEERS)")
    p.add_argument("--out", type=Path, default=Path("runs/train-speed"), help="scratch folder for the runs")
    p.add_argument("--set", action="append", help="extra nmt override KEY=VALUE (repeatable)")
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    p.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown or not (args.data / "train.src.idx").exists():
        error = f"unknown variant {unknown[0]!r}" if unknown else f"{args.data}: no nmt data"
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    rows, started = [], common.now()
    if has_fairseq(args.peers):
        rows.append(fairseq_row(args.peers, args.out, args, env))
    else:
        print("fairseq not found (set PEERS to the folder of ../shared/peers/install_fairseq.sh): nmt only")
    for name in args.variants.split(","):
        rows.append(nmt_row(name, VARIANTS[name], args.data, args.out, args, env))
    lines = table(rows)
    print("\n".join(lines))
    if args.record:
        command = common.command_line(__file__, argv)
        title = f"### {started}: peers' configuration, {args.minutes:g} minutes each, {args.threads} threads"
        peers = " (PEERS set)" if has_fairseq(args.peers) else ""
        machine = (
            f"Machine: {common.machine_name('cpu')}, {os.cpu_count()} cores. Command: `{command}`{peers}."
        )
        entry = "\n".join([title, "", f"{machine} Recorded {common.now()}.", "", *lines, ""])
        common.record(entry, SECTION, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
