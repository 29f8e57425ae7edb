"""Training speed side by side with other toolkits, in the configuration they were measured in.

    python benchmarks/train_speed.py                                  # synthetic Multi30k-like lengths
    python benchmarks/train_speed.py --data runs/multi30k-en-de --record

The peers' configuration: the multi30k-en-de recipe with a 3+3-layer post-norm Transformer, d_model 256,
4 heads, d_ff 1024, an 8000-subword vocabulary and batches of 4096 tokens, in fp32 on 2 CPU threads. The
peers' figures were measured on a 2-core machine whose fp32 matmul ran at 200 GFLOP/s; a CPU's speed on
this model follows its matmul rate, so each of their figures (and the target) is scaled by
measured rate / 200 GFLOP/s before comparing. Everything else is train_throughput's measurement.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from train_throughput import (
    GIB,
    MULTI30K_LENGTHS,
    command_line,
    parser,
    record,
    record_entry,
    report_lines,
    run,
)

from nmt.errors import NmtError

RECIPE = "multi30k-en-de"
OVERRIDES = (
    "model.encoder_layers=3",
    "model.decoder_layers=3",
    "model.d_model=256",
    "model.heads=4",
    "model.d_ff=1024",
    "model.norm=post",
    "model.dropout=0.1",  # the peers' scaled-down paper recipe keeps P_drop 0.1 (the nmt recipe drops it)
    "data.vocab_size=8000",
    "train.batch_tokens=4096",
    "train.update_tokens=4096",
    "train.precision=fp32",
)
PEER_MATMUL_RATE = 200e9  # FLOP/s of fp32 matmul on the machine the peers' figures come from
TARGET = 2600  # target tokens/s at PEER_MATMUL_RATE
TARGET_MEMORY = 1.6  # GiB
# (toolkit, target tokens/s at PEER_MATMUL_RATE, peak memory in GiB or None when not published)
PEERS = (
    ("fairseq 0.12.3", 1730, 1.6),
    ("OpenNMT-py 3.5.1", 1630, 3.5),
    ("Sockeye 3.1", 1640, None),
    ("JoeyNMT 2.3", 640, None),
)


def comparison(figures: dict) -> list[tuple[str, str, str, str]]:
    """Rows (system, target tokens/s here, ratio to nmt, peak memory), peers scaled to this machine."""
    scale = figures["matmul_flops_per_s"] / PEER_MATMUL_RATE
    ours = figures["target_tokens_per_s"]
    rows = [("nmt (this run)", f"{ours:,.0f}", "1.00", f"{figures['peak_memory_bytes'] / GIB:.2f} GiB")]
    for name, speed, memory in PEERS:
        rows.append(
            (
                name,
                f"{speed * scale:,.0f} ({speed:,})",
                f"{ours / (speed * scale):.2f}",
                f"{memory} GiB" if memory is not None else "n/a",
            )
        )
    rows.append(
        ("target", f"{TARGET * scale:,.0f} ({TARGET:,})", f"{ours / (TARGET * scale):.2f}", "<= 1.6 GiB")
    )
    return rows


def table(figures: dict) -> list[str]:
    scale = figures["matmul_flops_per_s"] / PEER_MATMUL_RATE
    return [
        f"peers scaled by this machine's matmul rate: {figures['matmul_flops_per_s'] / 1e9:.0f} / "
        f"{PEER_MATMUL_RATE / 1e9:.0f} GFLOP/s = {scale:.2f} (published figure in brackets)",
        "",
        "| system | target tokens/s | nmt / system | peak memory |",
        "| --- | --- | --- | --- |",
        *(f"| {' | '.join(row)} |" for row in comparison(figures)),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="CPU threads (default 2, as the peers)")
    p.set_defaults(device="cpu", updates=12, warmup_updates=3, windows=3)
    args = p.parse_args(argv)
    try:
        _, figures = run(RECIPE, args, MULTI30K_LENGTHS, [*OVERRIDES, f"train.threads={args.threads}"])
    except NmtError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    figures["comparison"] = comparison(figures)
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        print("\n".join(report_lines(f"{RECIPE} (peers' configuration)", figures)))
        print("\n".join(table(figures)))
    if args.record:
        title = f"{RECIPE} in the peers' configuration, cpu fp32"
        entry = record_entry(title, command_line(__file__, argv), figures, after=table(figures))
        record(entry, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
