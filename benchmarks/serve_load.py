"""Load on `nmt serve`, set against `nmt translate --interactive`.

    python benchmarks/serve_load.py --model runs/multi30k-en-de/checkpoints/average.pt \
        --input runs/multi30k-en-de/data/test/test_2016_flickr.en --record

A real `nmt serve` on 127.0.0.1 (a free port; every wait bounded). Load: for each client count, that many
threads each send one sentence per LibreTranslate request until `--requests` are answered in all (input
order, cycling); latency is from send to answer, requests/s is requests over the row's wall time.
Interactive: `nmt translate --interactive` on the same sentences, one line at a time (benchmarks/README.md,
Serving).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import common  # benchmarks/common.py: these scripts run with benchmarks/ on sys.path

SECTION = "## Serving"


def threads_env(threads: int) -> dict[str, str]:
    """The environment with OMP_NUM_THREADS set to `threads`; 0: unset, so that the command chooses."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {**env, "OMP_NUM_THREADS": str(threads)} if threads > 0 else env


class Server:
    """`nmt serve` in a subprocess, its log kept for the message when it does not start."""

    def __init__(self, model: Path, threads: int, wait_ms: float):
        env = {**threads_env(threads), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "nmt", "serve", "-m", str(model), "--port", "0", "--device", "cpu"]
        cmd += ["--batch-wait-ms", str(wait_ms)]
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            if m := re.search(r"on http://127\.0\.0\.1:(\d+)", line):
                self.url = f"http://127.0.0.1:{m.group(1)}"
                threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
                return
        self.proc.kill()
        raise SystemExit("nmt serve did not start:\n" + "".join(self.log))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def post(url: str, body, timeout: float = 120) -> tuple[int, bytes]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + "/translate", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def interactive(model: Path, sentences: list[str], lines: int, threads: int) -> dict:
    """`nmt translate --interactive`, one line written and its translation read back before the next:
    the per-line latency a user of the command line sees, to set the server's one-client latency against."""
    env = {**threads_env(threads), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "nmt", "translate", "-m", str(model), "--interactive", "--device", "cpu"]
    proc = subprocess.Popen(
        cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    latencies = []
    try:
        for i in range(lines + 10):  # the first 10 warm up, as the server's load rows do
            start = time.perf_counter()
            proc.stdin.write(sentences[i % len(sentences)] + "\n")
            proc.stdin.flush()
            if not proc.stdout.readline():
                raise SystemExit("nmt translate --interactive ended early")
            if i >= 10:
                latencies.append(time.perf_counter() - start)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    q = statistics.quantiles(latencies, n=20)
    return {"lines": lines, "p50_ms": 1000 * statistics.median(latencies), "p95_ms": 1000 * q[18]}


def load(url: str, sentences: list[str], clients: int, requests: int, src: str, tgt: str) -> dict:
    latencies: list[float] = []
    failed = 0
    counter = iter(range(requests))
    lock = threading.Lock()

    def client() -> None:
        nonlocal failed
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            start = time.perf_counter()
            status, _ = post(url, {"q": sentences[i % len(sentences)], "source": src, "target": tgt})
            with lock:
                latencies.append(time.perf_counter() - start)
                failed += status != 200

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    seconds = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=20)
    return {
        "clients": clients,
        "requests": len(latencies),
        "failed": failed,
        "per_s": len(latencies) / seconds,
        "p50_ms": statistics.median(latencies) * 1000,
        "p95_ms": q[18] * 1000,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--input", type=Path, required=True, help="sentences, one per line")
    p.add_argument("--clients", default="1,8,64")
    p.add_argument("--requests", type=int, default=300, help="requests per client count")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server (0: its default)")
    p.add_argument("--batch-wait-ms", type=float, default=10.0)
    p.add_argument("--only", default="load,interactive", help="which parts to run (comma-separated)")
    p.add_argument("--label", default="", help="a word for the entry's heading, e.g. before or after")
    p.add_argument("--record", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    args = p.parse_args()

    from nmt.checkpoint import load_checkpoint

    cfg = load_checkpoint(args.model).config
    src, tgt = cfg.data.src_lang, cfg.data.tgt_lang
    sentences = [s for s in args.input.read_text(encoding="utf-8").split("\n") if s.strip()]
    parts = args.only.split(",")
    tables: list[str] = []
    server = Server(args.model, args.threads, args.batch_wait_ms)
    try:
        if "load" in parts:
            load(server.url, sentences, 1, 10, src, tgt)  # warm-up
            rows = [
                load(server.url, sentences, int(c), args.requests, src, tgt) for c in args.clients.split(",")
            ]
            header = ["concurrent clients", "requests", "failed", "requests/s", "p50 latency", "p95 latency"]
            cells = ("clients", "requests", "failed", "per_s", "p50_ms", "p95_ms")
            formats = ("{}", "{}", "{}", "{:.1f}", "{:.0f} ms", "{:.0f} ms")
            body = [[f.format(r[c]) for f, c in zip(formats, cells, strict=True)] for r in rows]
            tables += [*common.markdown_table(header, body), ""]
        if "interactive" in parts:
            line = interactive(args.model, sentences, args.requests, args.threads)
            one = next((r for r in rows if r["clients"] == 1), None) if "load" in parts else None
            versus = f"{one['p50_ms']:.0f} ms, {one['p50_ms'] / line['p50_ms']:.2f}x" if one else "not run"
            tables += [
                "| `nmt translate --interactive`, one line at a time | p50 latency | p95 latency | "
                "`nmt serve`, one client: p50, and against the line's |",
                "| --- | --- | --- | --- |",
                f"| {line['lines']} lines | {line['p50_ms']:.0f} ms | {line['p95_ms']:.0f} ms | {versus} |",
                "",
            ]
    finally:
        if server.proc.poll() is None:
            server.stop()
    print("\n".join(tables))
    if args.record:
        import torch

        label = f" ({args.label})" if args.label else ""
        entry = [
            f"### {common.now()}{label}: {args.model}, cpu",
            "",
            f"- machine: {common.machine_name('cpu')}, {args.threads or 'its default'} torch threads for the "
            f"server, torch {torch.__version__}",
            f"- command: `{common.command_line(__file__, None)}`",
            f"- one sentence per request, {args.requests} requests per row, batch window "
            f"{args.batch_wait_ms:g} ms, beam and length penalty from the checkpoint; the clients share the "
            "machine's cores with the server",
            "",
            *tables,
            "",
        ]
        common.record("\n".join(entry), SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
