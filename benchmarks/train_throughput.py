"""Training throughput of a recipe, measured against the device's own matrix-multiply rate.

Target tokens/s, MFU, peak memory and data wait of the trainer's own update on a recipe (--data, --device,
--updates, --warmup-updates, --windows, --matmul-size, --profile, --json). Method and figures:
benchmarks/README.md, Training throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import common  # benchmarks/common.py: these scripts run with benchmarks/ on sys.path
import torch
from common import GIB, MULTI30K_LENGTHS, RESULTS, WMT_LENGTHS, LengthModel, SyntheticPairs, max_rss
from torch import Tensor

from nmt.config import Config, ModelConfig, load_config
from nmt.data.loader import Loader, Update, batch_plan, prepare, to_device, update_plan
from nmt.errors import NmtError
from nmt.model import count_parameters
from nmt.tokens import PAD
from nmt.train.optim import learning_rate
from nmt.train.runtime import Runtime, setup_runtime
from nmt.train.update import build_learner, train_step

SECTION = "## Training throughput"

# ---------------------------------------------------------------------------------------------------------
# Model FLOPs


def model_flops(cfg: ModelConfig, src_lens: Iterable[int], tgt_lens: Iterable[int], vocab: int) -> int:
    """Matrix-multiply FLOPs of one training pass (forward + backward) over the given pairs: source tokens
    including EOS, target positions including BOS, padding not counted. The formula and what it leaves out:
    benchmarks/README.md, Training throughput."""
    d, f, le, ld = cfg.d_model, cfg.d_ff, cfg.encoder_layers, cfg.decoder_layers
    s = torch.as_tensor(list(src_lens), dtype=torch.int64)
    t = torch.as_tensor(list(tgt_lens), dtype=torch.int64)
    if s.shape != t.shape:
        raise ValueError(f"{len(s)} source lengths but {len(t)} target lengths")
    src_tok, tgt_tok = int(s.sum()), int(t.sum())
    weights = (
        le * (4 * d * d + 2 * d * f) * src_tok
        + ld * (6 * d * d + 2 * d * f) * tgt_tok
        + ld * 2 * d * d * src_tok
        + d * vocab * tgt_tok
    )
    attention = 2 * 2 * d * (le * int((s * s).sum()) + ld * int((t * t).sum()) + ld * int((t * s).sum()))
    forward = 2 * weights + attention
    return 3 * forward


# ---------------------------------------------------------------------------------------------------------
# Synthetic data


def synthetic_data(cfg: Config, lengths: LengthModel, updates: int) -> SyntheticPairs:
    """A pool large enough that length-sorted batches are about as tight as on a real corpus."""
    per_pair = lengths.mean * max(lengths.ratio, 1.0) + 1
    n = max(30_000, int(2 * updates * cfg.train.update_tokens / per_pair))
    src, tgt = lengths.pairs(n, cfg.train.seed)
    return SyntheticPairs(src, tgt, cfg.data.vocab_size, cfg.train.seed)


# ---------------------------------------------------------------------------------------------------------
# The device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, trials: int = 3) -> list[float]:
    """FLOP/s of n x n x n matrix products in `dtype`, one figure per trial of about 8 products."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):
        torch.mm(a, b)
    rates = []
    for _ in range(trials):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(8):
            torch.mm(a, b)
        synchronize(device)
        rates.append(8 * 2 * n**3 / (time.perf_counter() - start))
    return rates


# ---------------------------------------------------------------------------------------------------------
# The measurement


@dataclass
class Window:
    seconds: float
    updates: int
    src_tokens: int
    tgt_tokens: int
    flops: int


def batch_figures(cfg: Config, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[int, int, int, int]:
    """(source tokens, target tokens, padded slots of both sides, model FLOPs) of one collated batch."""
    src, tgt_in, _ = batch
    s = (src != PAD).sum(1).cpu()  # (B,) source tokens incl. EOS
    t = (tgt_in != PAD).sum(1).cpu()  # (B,) target positions incl. BOS
    vocab = cfg.data.vocab_size
    return int(s.sum()), int(t.sum()), src.numel() + tgt_in.numel(), model_flops(cfg.model, s, t, vocab)


class Trainer:
    """The trainer's objects (`build_learner`, one process: no DDP) and its update at the loop's rate,
    schedule x cool-down, with the budget counted in steps."""

    def __init__(self, cfg: Config, rt: Runtime):
        self.cfg, self.rt = cfg, rt
        self.learner = build_learner(cfg, rt, cfg.data.vocab_size)
        self.step = 0

    def update(self, update: Update) -> None:
        self.step += 1
        used = (self.step - 1) / self.cfg.train.max_steps  # a step budget, as the loop's budget_used
        train_step(self.learner, update, learning_rate(self.step, used, self.cfg.model, self.cfg.train))


def measure(cfg: Config, data, args: argparse.Namespace) -> dict:
    """Run the benchmark as the command line asks; its figures (benchmarks/README.md, Training throughput)."""
    updates, warmup, windows = args.updates, args.warmup_updates, args.windows
    if updates < windows:
        raise NmtError(f"--updates {updates} is fewer than --windows {windows}")
    rt = setup_runtime(cfg)
    n = args.matmul_size or (8192 if rt.device.type == "cuda" else 2048)
    rates = matmul_rate(rt.device, rt.dtype, n)
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    trainer = Trainer(cfg, rt)
    accum = batch_plan(cfg, rt.world_size).accumulation
    plan = update_plan(data, cfg, rt.rank, rt.world_size, 0, 0)

    # Batches of the warm-up and timed updates, collated and on the device before the clock starts.
    prepared = []
    for _ in range(warmup + updates):
        update = to_device(prepare(data, next(plan), rt.device.type == "cuda"), rt.device)
        prepared.append((update, [batch_figures(cfg, b) for b in update.batches]))
    for update, _ in prepared[:warmup]:
        trainer.update(update)
    synchronize(rt.device)

    timed, padded, real = [], 0, 0
    per_window = [updates // windows + (i < updates % windows) for i in range(windows)]
    cursor = warmup
    for size in per_window:
        chunk = prepared[cursor : cursor + size]
        cursor += size
        synchronize(rt.device)
        start = time.perf_counter()
        for update, _ in chunk:
            trainer.update(update)
        synchronize(rt.device)
        seconds = time.perf_counter() - start
        figs = [f for _, fs in chunk for f in fs]
        timed.append(Window(seconds, size, *(sum(f[i] for f in figs) for i in (0, 1, 3))))
        padded += sum(f[2] for f in figs)
        real += sum(f[0] + f[1] for f in figs)
    memory = torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda" else max_rss()
    del prepared

    e2e = data_wait = None
    if not args.no_end_to_end:
        # The trainer's own data path: the background loader collating (and pinning) ahead of the step.
        size = per_window[0]
        with Loader(data, plan, rt.device) as loader:
            synchronize(rt.device)
            start = time.perf_counter()
            tokens = 0
            for _ in range(size):
                update = next(loader)
                trainer.update(update)
                tokens += update.targets
            synchronize(rt.device)
            e2e = tokens / (time.perf_counter() - start)
            data_wait = loader.wait_seconds / (time.perf_counter() - start)

    profile_table = profile_updates(trainer, data, plan, args.profile) if args.profile else None
    rates += matmul_rate(rt.device, rt.dtype, n)

    rate = statistics.median(rates)
    by_speed = sorted(timed, key=lambda w: w.tgt_tokens / w.seconds)
    mid = by_speed[len(by_speed) // 2]
    total_s = sum(w.seconds for w in timed)
    result = {
        "device": common.machine_name(str(rt.device)),
        "device_type": rt.device.type,
        "dtype": str(rt.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "parameters": count_parameters(trainer.learner.model),
        "vocab": cfg.data.vocab_size,
        "batch_tokens": cfg.train.batch_tokens,
        "accumulation": accum,
        "updates": updates,
        "warmup_updates": warmup,
        "windows": windows,
        "target_tokens_per_s": mid.tgt_tokens / mid.seconds,
        "source_tokens_per_s": mid.src_tokens / mid.seconds,
        "updates_per_s": mid.updates / mid.seconds,
        "window_target_tokens_per_s": [w.tgt_tokens / w.seconds for w in timed],
        "mean_target_tokens_per_s": sum(w.tgt_tokens for w in timed) / total_s,
        "target_tokens_per_update": sum(w.tgt_tokens for w in timed) / updates,
        "padding_fraction": 1 - real / padded,
        "peak_memory_bytes": memory,
        "peak_memory_kind": "torch.cuda.max_memory_allocated"
        if rt.device.type == "cuda"
        else "RSS high-water",
        "model_flops_per_update": sum(w.flops for w in timed) / updates,
        "model_flops_per_s": mid.flops / mid.seconds,
        "matmul": f"{str(rt.dtype).removeprefix('torch.')} {n}^3",
        "matmul_flops_per_s": rate,
        "mfu": mid.flops / mid.seconds / rate,
        "end_to_end_target_tokens_per_s": e2e,
        "end_to_end_data_wait": data_wait,
    }
    steps, tokens = cfg.train.max_steps, cfg.train.update_tokens
    result["projection"] = {
        "steps": steps,
        "tokens_per_update": tokens,
        "hours": steps * tokens / result["target_tokens_per_s"] / 3600,
        "hours_as_batched": steps / result["updates_per_s"] / 3600,
    }
    if profile_table is not None:
        result["profile"] = profile_table
    return result


# ---------------------------------------------------------------------------------------------------------
# Where the time goes

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")
# (category, words of the outermost op or autograd node that put an op's self time there), first match wins
CATEGORIES = (
    ("optimizer (Adam, grad norm)", ("Optimizer.", "_foreach", "clip_grad")),
    ("attention (scaled dot-product, head split)", ("scaled_dot_product", "ScaledDotProduct", "Unbind")),
    (
        "loss (log-softmax, label smoothing)",
        ("SmoothedNLL", "log_softmax", "LogSoftmax", "gather", "Gather", "mean", "Mean", "masked_fill"),
    ),
    ("dropout", ("dropout", "Dropout", "bernoulli")),
    ("LayerNorm", ("layer_norm", "LayerNorm")),
    ("embeddings", ("embedding", "Embedding")),
    ("linear layers (attention projections, FFN)", ("linear", "Addmm", "MmBackward")),
    ("other (residual adds, ReLU, views and copies)", ("",)),
)


def categorize(name: str, root: str, shapes: Sequence, vocab: int) -> str:
    """The category of an op's self time, from its own name and input shapes and its outermost op."""
    if name in MATMULS and not root.startswith("Optimizer."):
        dims = {d for shape in shapes if isinstance(shape, list | tuple) for d in shape}
        return "output projection (matmul)" if vocab in dims else "linear layers (attention projections, FFN)"
    return next(category for category, words in CATEGORIES if any(w in root for w in words))


def profile_updates(trainer: Trainer, data, plan, updates: int) -> dict[str, float]:
    """Share of self time (device time on a GPU) by category over `updates` trainer updates."""
    from torch.profiler import ProfilerActivity, profile

    rt = trainer.rt
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    chunks = [
        to_device(prepare(data, next(plan), rt.device.type == "cuda"), rt.device) for _ in range(updates)
    ]
    with profile(activities=activities, record_shapes=True) as prof:
        for update in chunks:
            trainer.update(update)
        synchronize(rt.device)
    totals: dict[str, float] = {}
    for event in prof.events():
        root = event
        while root.cpu_parent is not None:
            root = root.cpu_parent
        spent = event.self_device_time_total if rt.device.type == "cuda" else event.self_cpu_time_total
        key = categorize(event.name, root.name, event.input_shapes or [], trainer.cfg.data.vocab_size)
        totals[key] = totals.get(key, 0.0) + spent
    whole = sum(totals.values()) or 1.0
    return {k: v / whole for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


# ---------------------------------------------------------------------------------------------------------
# Reporting


def figure_rows(r: dict) -> list[tuple[str, str]]:
    """The figures as (name, value): the printout's lines and the RESULTS.md table's rows."""
    p, e2e = r["projection"], r["end_to_end_target_tokens_per_s"]
    windows = ", ".join(f"{x:,.0f}" for x in r["window_target_tokens_per_s"])
    return [
        ("target tokens/s", f"{r['target_tokens_per_s']:,.0f} (median window; windows: {windows})"),
        ("source tokens/s", f"{r['source_tokens_per_s']:,.0f}"),
        ("updates/s", f"{r['updates_per_s']:.3f} ({r['target_tokens_per_update']:,.0f} target tokens each)"),
        ("padding", f"{100 * r['padding_fraction']:.1f}% of batch slots"),
        ("peak memory", f"{r['peak_memory_bytes'] / GIB:.2f} GiB ({r['peak_memory_kind']})"),
        (
            "model FLOP/s",
            f"{r['model_flops_per_s'] / 1e9:,.1f} G ({r['model_flops_per_update'] / 1e12:.3f} TFLOP/update)",
        ),
        ("matmul rate", f"{r['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s ({r['matmul']}, measured)"),
        ("MFU", f"{100 * r['mfu']:.1f}%"),
        (
            "end to end",
            f"{e2e:,.0f} target tokens/s (the trainer's background loader; "
            f"{r['end_to_end_data_wait']:.1%} of the time waiting for data)"
            if e2e
            else "not measured",
        ),
        (
            "projected",
            f"{p['steps'] / 1000:g}k x {p['tokens_per_update'] / 1000:g}k tokens -> {p['hours']:.2f} h on "
            f"this device ({p['hours_as_batched']:.2f} h at this run's tokens/update)",
        ),
        *((f"profile: {name}", f"{100 * share:.1f}%") for name, share in r.get("profile", {}).items()),
    ]


def about(r: dict) -> list[str]:
    """Where and what ran: device, model, batches, timing."""
    return [
        f"device: {r['device']} ({r['device_type']}, {r['dtype']}), {r['threads']} threads, "
        f"torch {r['torch']}",
        f"model: {r['parameters']:,} parameters, vocabulary {r['vocab']}, batches of {r['batch_tokens']} "
        f"tokens x {r['accumulation']}; {r['updates']} timed updates in {r['windows']} windows after "
        f"{r['warmup_updates']} warm-up",
    ]


def report_lines(recipe: str, r: dict) -> list[str]:
    return [recipe, *about(r), *(f"{name:20} {value}" for name, value in figure_rows(r))]


def record_entry(title: str, command: str, r: dict) -> str:
    """A dated Markdown entry: device, command, then the figures as a table."""
    lines = [*about(r), f"command: `{command}`", f"data: {r['data']}"]
    table = common.markdown_table(["figure", "value"], figure_rows(r))
    return "\n".join([f"### {common.now()}: {title}", "", *(f"- {line}" for line in lines), "", *table, ""])


# ---------------------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", help="a recipe name (wmt14-en-de-base) or YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--updates", type=int, default=30, help="timed updates (default 30)")
    p.add_argument("--warmup-updates", type=int, default=5, help="untimed updates first (default 5)")
    p.add_argument("--windows", type=int, default=3, help="timed windows; the median is shown (default 3)")
    p.add_argument("--data", type=Path, help="a preprocessed work directory: time its training split")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="overrides train.device")
    p.add_argument("--matmul-size", type=int, help="matmul side for the peak rate (8192 GPU, 2048 CPU)")
    p.add_argument("--no-end-to-end", action="store_true", help="skip the window with collation")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="profile N more updates")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--record", action="store_true", help="append the figures to benchmarks/RESULTS.md")
    p.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    overrides = [*args.overrides, *([f"train.device={args.device}"] if args.device else [])]
    try:
        cfg = load_config(args.recipe, overrides)
        if args.data:
            from nmt.data.binarized import ParallelData

            data, source = ParallelData(args.data / "data" / "train"), f"{args.data}/data/train"
        else:
            lengths = MULTI30K_LENGTHS if "multi30k" in args.recipe else WMT_LENGTHS
            data = synthetic_data(cfg, lengths, args.warmup_updates + 2 * args.updates)
            source = f"synthetic ({lengths})"
        figures = {**measure(cfg, data, args), "recipe": args.recipe, "data": source}
    except NmtError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(figures, indent=1) if args.json else "\n".join(report_lines(args.recipe, figures)))
    if args.record:
        title = f"{Path(args.recipe).stem}, {figures['device_type']} {figures['dtype']}"
        entry = record_entry(title, common.command_line(__file__, argv), figures)
        common.record(entry, SECTION, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
