"""Load on `nmt serve`: sentences/s and latency percentiles under 1, 8 and 32 concurrent clients.

    python benchmarks/serve_load.py --model runs/multi30k-en-de/checkpoints/average.pt \
        --input runs/multi30k-en-de/data/test/test_2016_flickr.en --record

Starts a real `nmt serve` on 127.0.0.1 (a free port), then for each client count runs that many threads,
each sending one sentence per LibreTranslate request, one after the other, until `--requests` requests
are answered in all (the sentences in input order, cycling). Latency is from send to answer; sentences/s
is requests over the wall time of the run. Loopback only, bounded in count and time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import machine_name, record

SECTION = "## Serving"


def start_server(model: Path, threads: int, wait_ms: float) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "nmt", "serve", "-m", str(model), "--port", "0", "--device", "cpu"]
    cmd += ["--batch-wait-ms", str(wait_ms)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        if m := re.search(r"on (http://127\.0\.0\.1:\d+)", line):
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("nmt serve did not start")


def load(url: str, sentences: list[str], clients: int, requests: int, src: str, tgt: str) -> dict:
    latencies: list[float] = []
    counter = iter(range(requests))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            body = json.dumps({"q": sentences[i % len(sentences)], "source": src, "target": tgt}).encode()
            req = urllib.request.Request(
                url + "/translate", data=body, headers={"Content-Type": "application/json"}
            )
            start = time.perf_counter()
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
            with lock:
                latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    seconds = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=20)
    return {
        "clients": clients,
        "requests": len(latencies),
        "sentences_per_s": len(latencies) / seconds,
        "p50_ms": statistics.median(latencies) * 1000,
        "p95_ms": q[18] * 1000,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--input", type=Path, required=True, help="sentences, one per line")
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--requests", type=int, default=300, help="requests per client count")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    p.add_argument("--batch-wait-ms", type=float, default=10.0)
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args()

    from nmt.checkpoint import load_checkpoint

    cfg = load_checkpoint(args.model).config
    sentences = [s for s in args.input.read_text(encoding="utf-8").split("\n") if s.strip()]
    proc, url = start_server(args.model, args.threads, args.batch_wait_ms)
    try:
        load(url, sentences, 1, 10, cfg.data.src_lang, cfg.data.tgt_lang)  # warm-up
        rows = [
            load(url, sentences, int(c), args.requests, cfg.data.src_lang, cfg.data.tgt_lang)
            for c in args.clients.split(",")
        ]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    table = [
        "| concurrent clients | requests | sentences/s | p50 latency | p95 latency |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {r['clients']} | {r['requests']} | {r['sentences_per_s']:.1f} | {r['p50_ms']:.0f} ms "
            f"| {r['p95_ms']:.0f} ms |"
            for r in rows
        ),
    ]
    print("\n".join(table))
    if args.record:
        import torch

        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        entry = [
            f"### {now}: {args.model}, cpu",
            "",
            f"- machine: {machine_name('cpu')}, {args.threads} torch threads for the server, "
            f"torch {torch.__version__}",
            f"- command: `python benchmarks/serve_load.py {' '.join(sys.argv[1:])}`",
            f"- one sentence per request, {args.requests} requests per row, batch window "
            f"{args.batch_wait_ms:g} ms, beam and length penalty from the checkpoint; the clients share the "
            "machine's cores with the server",
            "",
            *table,
            "",
        ]
        record("\n".join(entry), SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
