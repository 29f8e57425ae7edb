"""Translation speed: nmt's PyTorch engine and CTranslate2, side by side on one model and one input.

    python benchmarks/translate_speed.py --repeats 3          # random-weights model, synthetic input
    python benchmarks/translate_speed.py --model runs/multi30k-en-de/checkpoints/average.pt \\
        --input runs/multi30k-en-de/data/test/test_2016_flickr.en --repeats 3 --record

Engines: nmt (fp32 and int8 on a CPU, bf16 on a GPU) and CTranslate2 on a folder exported from the same
checkpoint by nmt.formats.ctranslate2 (float32 and int8 on a CPU; float16 and bfloat16 on a GPU; nmt's rows
alone without ctranslate2). Every engine gets the same decode settings (beam 4, the checkpoint's length
penalty and length limit), batch budget (both cut batches with nmt.translate.token_batches) and threads.
Each engine lives in its own worker process, which loads the model once; the parent runs the timed passes
round-robin (engine order rotated each repetition), so a neighbour stealing the CPU for a while slows
every engine alike, and reads each worker's resident-set high-water mark (VmHWM) as its peak memory, and
that minus the RSS right after the imports as what the model and the decoding cost ("over imports").

Figures: target subwords/s and sentences/s of a full pass (median over repetitions; subwords counted by
re-encoding each engine's output), the speed ratio nmt time / engine time per repetition, the latency of
one sentence at a time (median), peak RSS, and how many outputs are the same as nmt's.

Without --model nothing is trained: a Transformer of --recipe's size (wmt14-en-de-base: the paper's base
model, 63M parameters; `--set` to change it) with random weights and a SentencePiece model trained on
synthetic text. Random weights almost never emit EOS, so every output runs to its length limit, set to
0 x |x| + 30 subwords for every sentence: every engine does the same work (the CTranslate2 engine decodes
a batch up to its longest sentence's limit), and 30 subwords is about a real translation's length. Random
weights also make near-ties everywhere, so the "same as nmt" column means nothing for them. Without
--input the sentences are synthetic, with newstest2014's words per sentence: log-normal with mean 25 and
standard deviation 14 (mu = 3.08, sigma = 0.52), clipped to 1..120.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import common  # benchmarks/common.py: these scripts run with benchmarks/ on sys.path
from common import MIB, NEWSTEST_WORDS, RESULTS, SyntheticText, max_rss, random_model

SECTION = "## Translation speed"
CPU_ENGINES = [("nmt", "fp32"), ("nmt", "int8"), ("ctranslate2", "float32"), ("ctranslate2", "int8")]
GPU_ENGINES = [("nmt", "bf16"), ("ctranslate2", "float16"), ("ctranslate2", "bfloat16")]


# ---------------------------------------------------------------------------------------------------------
# One engine in its own process


def worker() -> None:
    """Load one engine, then answer commands on stdin (run, latency, quit) with one JSON line each."""
    job = json.loads(sys.stdin.readline())
    from nmt.config import DecodeConfig

    decode = DecodeConfig(**job["decode"])
    if job["engine"] == "nmt":
        import torch

        from nmt.checkpoint import load_model
        from nmt.translate import Translator, inference_model

        torch.set_num_threads(job["threads"])
        rss_imports = max_rss()
        device = torch.device(job["device"])
        model, subword, _ = load_model(Path(job["checkpoint"]), device)
        translator = Translator(inference_model(model, job["compute"], device), subword, decode, device)
    else:
        from nmt.translate import ctranslate2_translator

        rss_imports = max_rss()
        translator = ctranslate2_translator(
            Path(job["ct2_dir"]), decode, job["device"], job["compute"], job["threads"]
        )
        subword = translator.subword
    lines, latency_lines = job["lines"], job["latency_lines"]
    translator.translate(lines[:16])  # warm-up: allocators, kernels' first calls
    send({"rss_imports": rss_imports, "rss_loaded": max_rss()})
    for command in sys.stdin:
        command = command.strip()
        if command == "run":
            start = time.perf_counter()
            out = translator.translate(lines)
            seconds = time.perf_counter() - start
            tokens = sum(len(ids) for ids in subword.encode(out))
            send({"seconds": seconds, "target_tokens": tokens, "sentences": len(lines), "outputs": out})
        elif command == "latency":
            times = []
            for line in latency_lines:
                start = time.perf_counter()
                translator.translate([line])
                times.append(time.perf_counter() - start)
            send({"latency": times})
        else:
            send({"rss_peak": max_rss()})
            return


def send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class Worker:
    """The parent's handle on one engine's process."""

    def __init__(self, engine: str, compute: str, job: dict):
        self.engine, self.compute = engine, compute
        self.name = f"{'nmt' if engine == 'nmt' else 'CTranslate2'} {compute}"
        cmd = [sys.executable, __file__, "--worker"]
        env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self.ask(json.dumps({**job, "engine": engine, "compute": compute}))  # after loading
        self.runs: list[dict] = []

    def ask(self, line: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise SystemExit(f"the {self.name} worker died (exit status {self.proc.wait()})")
        return json.loads(reply)


# ---------------------------------------------------------------------------------------------------------
# The measurement


@dataclass
class Result:
    name: str
    tokens_per_s: float  # median over repetitions
    sentences_per_s: float
    ratios: list[float]  # nmt time / this engine's time, per repetition
    latency_ms: float  # median, one sentence at a time
    rss_peak: int
    rss_over_imports: int
    same_as_nmt: float  # fraction of lines


def measure(job: dict, engines: list[tuple[str, str]], repeats: int) -> list[Result]:
    # Started one after another, each waited for: loading is not timed, and would share the CPU.
    workers = [Worker(engine, compute, job) for engine, compute in engines]
    for rep in range(repeats):
        for w in workers[rep % len(workers) :] + workers[: rep % len(workers)]:
            w.runs.append(w.ask("run"))
            seconds = w.runs[-1]["seconds"]
            print(f"repetition {rep + 1}/{repeats}: {w.name:22s} {seconds:7.2f} s", file=sys.stderr)
    latencies = {w.name: w.ask("latency")["latency"] for w in workers}
    peaks = {w.name: w.ask("quit")["rss_peak"] for w in workers}
    for w in workers:
        w.proc.wait()

    base = workers[0]
    results = []
    for w in workers:
        outputs = w.runs[0]["outputs"]
        same = sum(a == b for a, b in zip(outputs, base.runs[0]["outputs"], strict=True)) / len(outputs)
        results.append(
            Result(
                name=w.name,
                tokens_per_s=statistics.median(r["target_tokens"] / r["seconds"] for r in w.runs),
                sentences_per_s=statistics.median(r["sentences"] / r["seconds"] for r in w.runs),
                ratios=[b["seconds"] / r["seconds"] for b, r in zip(base.runs, w.runs, strict=True)],
                latency_ms=1000 * statistics.median(latencies[w.name]),
                rss_peak=peaks[w.name],
                rss_over_imports=peaks[w.name] - w.ready["rss_imports"],
                same_as_nmt=same,
            )
        )
    return results


def table_rows(results: list[Result]) -> list[list[str]]:
    rows = []
    for r in results:
        speeds = f"{r.tokens_per_s:,.0f}", f"{r.sentences_per_s:,.1f}"
        speedup = f"{statistics.median(r.ratios):.2f} ({min(r.ratios):.2f}-{max(r.ratios):.2f})"
        rss = f"{r.rss_peak / MIB:,.0f}", f"{r.rss_over_imports / MIB:,.0f}"
        rows.append([r.name, *speeds, speedup, f"{r.latency_ms:,.1f}", *rss, f"{100 * r.same_as_nmt:.1f}%"])
    return rows


# speed-up: nmt's time / this engine's time; latency: one sentence at a time; RSS: the worker process's
# high-water mark, and that minus its RSS after the imports; same: outputs identical to nmt's.
HEADER = ["engine", "tgt tok/s", "sent/s", "speed-up (min-max)", "latency ms", "RSS MiB", "Δ MiB", "same"]


def record_entry(results: list[Result], about: dict) -> str:
    return "\n".join(
        [
            f"### {common.now()}: {about['model']}, {about['device']}",
            "",
            f"- machine: {about['machine']}, threads: {about['threads']}; torch {about['torch']}, "
            f"ctranslate2 {about['ctranslate2']}",
            f"- command: `{about['command']}`",
            f"- model: {about['model_detail']}",
            f"- input: {about['input']}",
            f"- decoding: {about['decoding']}",
            f"- {about['repeats']} repetitions, round-robin; latency: {about['latency_lines']} sentences "
            "one at a time; speed-up and latency are medians",
            "",
            *common.markdown_table(HEADER, table_rows(results)),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> list[Result]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="an nmt checkpoint (default: random weights, --recipe's size)")
    p.add_argument(
        "--recipe", default="multi30k-en-de", help="without --model: whose model gets random weights"
    )
    p.add_argument("--input", type=Path, help="source sentences, one a line (default: synthetic)")
    p.add_argument("--lines", type=int, help="use the first N input lines (default: all; synthetic: 300)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per engine (default 3)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for every engine")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument(
        "--max-tokens", type=int, help="batch budget (default: the checkpoint's decode.batch_tokens)"
    )
    p.add_argument("--max-len-a", type=float, help="length limit a (default: checkpoint's; random model: 0)")
    p.add_argument("--max-len-b", type=int, help="length limit b (default: checkpoint's; random model: 30)")
    p.add_argument("--latency-lines", type=int, default=30, help="sentences translated one at a time")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="without --model: a recipe override for the random model (repeatable)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the rows and what ran as one JSON object")
    p.add_argument("--record", action="store_true", help="append the figures to benchmarks/RESULTS.md")
    p.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker()
        return []
    import importlib.util

    import torch
    from rich.console import Console

    from nmt.checkpoint import load_checkpoint
    from nmt.formats.export import export

    console = Console(stderr=True)
    ct2 = importlib.util.find_spec("ctranslate2") is not None
    engines = GPU_ENGINES if args.device.startswith("cuda") else CPU_ENGINES
    engines = engines if ct2 else [e for e in engines if e[0] == "nmt"]
    with tempfile.TemporaryDirectory(prefix="translate-speed-") as tmp:
        work = Path(tmp)
        if args.model is None:
            console.print(
                f"no --model: random weights of the {args.recipe} recipe's size (nothing is trained)"
            )
            checkpoint, random_weights = random_model(work, args.recipe, args.overrides), True
        else:
            checkpoint, random_weights = args.model, False
        ckpt = load_checkpoint(checkpoint)
        d = ckpt.config.decode
        default_a, default_b = (0.0, 30) if random_weights else (d.max_len_a, d.max_len_b)
        decode = dataclasses.replace(
            d,
            beam=args.beam,
            nbest=1,
            batch_tokens=args.max_tokens or d.batch_tokens,
            max_len_a=default_a if args.max_len_a is None else args.max_len_a,
            max_len_b=default_b if args.max_len_b is None else args.max_len_b,
        )
        if args.input is not None:
            lines = [line for line in args.input.read_text(encoding="utf-8").splitlines() if line.strip()]
            lines = lines[: args.lines] if args.lines else lines
            input_about = f"{args.input} ({len(lines)} lines)"
        else:
            lines = SyntheticText(seed=2).lines(args.lines or 300, NEWSTEST_WORDS)
            input_about = (
                f"{len(lines)} synthetic sentences, words per sentence log-normal with newstest2014's "
                f"mean 25 and sd 14 (here: mean {statistics.mean(map(len, map(str.split, lines))):.1f})"
            )
        ct2_dir = export(checkpoint, work / "ct2") if ct2 else work / "ct2"
        latency_lines = random.Random(3).sample(lines, min(args.latency_lines, len(lines)))
        job = {
            "checkpoint": str(checkpoint),
            "ct2_dir": str(ct2_dir),
            "decode": dataclasses.asdict(decode),
            "device": args.device,
            "threads": args.threads,
            "lines": lines,
            "latency_lines": latency_lines,
        }
        results = measure(job, engines, args.repeats)

    cfg = ckpt.config.model
    params = sum(v.numel() for k, v in ckpt.model_state.items())
    about = {
        "model": f"random weights, {args.recipe} size" if random_weights else str(checkpoint),
        "model_detail": f"{cfg.encoder_layers}+{cfg.decoder_layers} layers, d_model {cfg.d_model}, "
        f"d_ff {cfg.d_ff}, {cfg.heads} heads, vocabulary {ckpt.vocab_size}, {params:,} parameters"
        + (" (random weights: outputs run to the length limit)" if random_weights else ""),
        "device": args.device,
        "machine": common.machine_name(args.device),
        "threads": args.threads,
        "torch": torch.__version__,
        "ctranslate2": importlib.import_module("ctranslate2").__version__ if ct2 else "not installed",
        "command": common.command_line(__file__, argv),
        "input": input_about,
        "decoding": f"beam {decode.beam}, lenpen {decode.lenpen}, max length {decode.max_len_a:g} x |x| + "
        f"{decode.max_len_b}, batch budget {decode.batch_tokens} (sentences x beam x max(source, output))",
        "repeats": args.repeats,
        "latency_lines": len(latency_lines),
    }
    if args.record:
        common.record(record_entry(results, about), SECTION, args.results)
        console.print(f"recorded in {args.results}")
    if args.json:
        print(json.dumps({"about": about, "rows": [dataclasses.asdict(r) for r in results]}, indent=1))
    else:
        print(f"Translation speed: {about['model']} on {args.device}, {args.threads} threads\n")
        print("\n".join(common.markdown_table(HEADER, table_rows(results))))
        print("\n".join(f"{key}: {about[key]}" for key in ("machine", "model_detail", "input", "decoding")))
    return results


if __name__ == "__main__":
    main()
