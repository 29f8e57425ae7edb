"""Load on `nmt serve`, and what a public endpoint meets: slow clients, hostile requests, SIGTERM.

    python benchmarks/serve_load.py --model runs/multi30k-en-de/checkpoints/average.pt \
        --input runs/multi30k-en-de/data/test/test_2016_flickr.en --record

Starts a real `nmt serve` on 127.0.0.1 (a free port), then:

- load: for each client count, that many threads each send one sentence per LibreTranslate request, one
  after the other, until `--requests` are answered in all (input order, cycling). Latency is from send to
  answer; requests/s is requests over the wall time of the row.
- 200 slow clients: 200 connections each send half a request and stall; meanwhile one ordinary request is
  timed, the server's threads counted, and after 15 s the connections the server has closed are counted.
- hostile: one row per request a public endpoint meets (a lone surrogate among 8 good requests, a chunked
  body, no Content-Length, Content-Length -1, another method, GET on a POST route, a one-line request sent
  while a 10,000-line one is being translated): what the server answered and how long it took.
- SIGTERM under load: 8 clients sending, plus an idle keep-alive connection and a stalled body; SIGTERM;
  the seconds to exit (killed after 60 s), the exit status, and how many requests in flight got answers.
- interactive: `nmt translate --interactive` on the same sentences, one line at a time, against which the
  one-client row of the load table is set (`--only load,interactive --clients 1`).

Loopback only; every wait is bounded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import machine_name, record

SECTION = "## Serving"


class Server:
    """`nmt serve` in a subprocess; its log is kept so tracebacks can be counted."""

    def __init__(self, model: Path, threads: int, wait_ms: float, extra: list[str]):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "nmt", "serve", "-m", str(model), "--port", "0", "--device", "cpu"]
        cmd += ["--batch-wait-ms", str(wait_ms), *extra]
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            if m := re.search(r"on http://127\.0\.0\.1:(\d+)", line):
                self.port = int(m.group(1))
                self.url = f"http://127.0.0.1:{self.port}"
                threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
                return
        self.proc.kill()
        raise SystemExit("nmt serve did not start:\n" + "".join(self.log))

    def threads(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
        return -1

    def tracebacks(self) -> int:
        return sum("Traceback" in line for line in self.log)

    def stop(self, timeout: float = 60) -> tuple[float, int | None]:
        start = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        return time.perf_counter() - start, code


def post(url: str, body, timeout: float = 120) -> tuple[int, bytes]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + "/translate", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def raw_exchange(port: int, request: bytes, timeout: float = 10) -> tuple[str, float]:
    """Send raw bytes, read until the server closes or `timeout`: (status line and content type, seconds)."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        got = b""
        try:
            while b"\r\n\r\n" not in got and (chunk := s.recv(65536)):
                got += chunk
        except (TimeoutError, ConnectionError):
            pass
    seconds = time.perf_counter() - start
    if not got:
        return "no answer", seconds
    head = got.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    ctype = next((h.split(":", 1)[1].strip() for h in head[1:] if h.lower().startswith("content-type")), "-")
    return f"{head[0].split(' ', 1)[1]}, {ctype.split(';')[0]}", seconds


def interactive(model: Path, sentences: list[str], lines: int, threads: int) -> dict:
    """`nmt translate --interactive`, one line written and its translation read back before the next:
    the per-line latency a user of the command line sees, to set the server's one-client latency against."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
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


def slow_clients(server: Server, sentence: str, src: str, tgt: str, n: int = 200) -> list[str]:
    """n connections that send half a request and stall: does an honest client still get through?"""
    threads_before = server.threads()
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        if i % 2:  # half the headers
            s.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\n")
        else:  # all the headers, half the body
            s.sendall(b'POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"q": ')
        socks.append(s)
    time.sleep(1)
    start = time.perf_counter()
    status, _ = post(server.url, {"q": sentence, "source": src, "target": tgt}, timeout=30)
    honest = time.perf_counter() - start
    threads = server.threads()
    time.sleep(15)
    closed = 0
    for s in socks:
        s.settimeout(0.01)
        try:
            s.recv(65536)  # an answer (408) or b"": the server hung up either way
            closed += 1
        except TimeoutError:
            pass
        except ConnectionError:
            closed += 1
    tracebacks = server.tracebacks()
    for s in socks:
        s.close()
    time.sleep(2)
    tracebacks = server.tracebacks() - tracebacks
    return [
        f"| ordinary request among {n} stalled connections | {status} in {honest * 1000:.0f} ms |",
        f"| server threads: idle, with {n} stalled connections | {threads_before}, {threads} |",
        f"| stalled connections the server cut off (answered 408 or closed) within 16 s | {closed} of {n} |",
        f"| tracebacks in the log once they leave | {tracebacks} |",
    ]


def hostile(server: Server, sentence: str, src: str, tgt: str) -> list[str]:
    rows = []
    good = {"q": sentence, "source": src, "target": tgt}
    for name, bad in (
        ("a lone surrogate", {"q": "x \ud800 y", "source": src, "target": tgt}),
        ("a list with a number", {"q": ["x", 5], "source": src, "target": tgt}),
    ):
        worst = 0
        for _ in range(3):
            with ThreadPoolExecutor(max_workers=9) as pool:
                futures = [pool.submit(post, server.url, good) for _ in range(4)]
                bad_future = pool.submit(post, server.url, bad)
                futures += [pool.submit(post, server.url, good) for _ in range(4)]
                failed = sum(f.result()[0] != 200 for f in futures)
                bad_status = bad_future.result()[0]
            worst = max(worst, failed)
        rows.append(
            f"| {name} among 8 good requests, 3 trials | bad one {bad_status}; "
            f"good ones failed: at most {worst}/8 |"
        )
    port = server.port
    body = json.dumps(good).encode()
    for name, req in (
        (
            "chunked body",
            b"POST /translate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            + f"{len(body):x}\r\n".encode()
            + body
            + b"\r\n0\r\n\r\n",
        ),
        ("no Content-Length", b"POST /translate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" + body),
        ("Content-Length: -1", b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n" + body),
        (
            "PUT /translate",
            b"PUT /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        ),
        ("GET /translate", b"GET /translate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        (
            "body of 100 MB announced",
            b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n",
        ),
    ):
        answer, seconds = raw_exchange(port, req)
        rows.append(f"| {name} | {answer} after {seconds * 1000:.0f} ms |")
    big = "\n".join(["a"] * 10000)
    with ThreadPoolExecutor(max_workers=2) as pool:
        start = time.perf_counter()
        big_future = pool.submit(post, server.url, {"q": big, "source": src, "target": tgt}, 300)
        time.sleep(1)
        small_start = time.perf_counter()
        small_status, _ = post(server.url, good, timeout=300)
        small = time.perf_counter() - small_start
        big_status, _ = big_future.result()
        whole = time.perf_counter() - start
    rows.append(
        f"| one-line request sent 1 s after a 10,000-line one | one-line {small_status} in {small:.1f} s; "
        f"10,000 lines {big_status} in {whole:.1f} s |"
    )
    return rows


def sigterm_under_load(server: Server, sentences: list[str], src: str, tgt: str) -> list[str]:
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    body = json.dumps({"q": sentences[0], "source": src, "target": tgt}).encode()
    idle.sendall(
        b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    idle.recv(65536)  # answered; the connection stays open, idle
    stalled = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    stalled.sendall(b'POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"q": ')
    stop = threading.Event()
    answered = failed = 0
    lock = threading.Lock()

    def client(k: int) -> None:
        nonlocal answered, failed
        i = k
        while not stop.is_set():
            try:
                status, _ = post(
                    server.url, {"q": sentences[i % len(sentences)], "source": src, "target": tgt}, 30
                )
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return  # refused: the server no longer accepts, as it should after SIGTERM
            with lock:
                answered += status == 200
                failed += status != 200
            i += 8

    workers = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for w in workers:
        w.start()
    time.sleep(3)
    seconds, code = server.stop()
    stop.set()
    for w in workers:
        w.join(timeout=60)
    idle.close()
    stalled.close()
    return [
        "| SIGTERM with 8 clients sending, an idle keep-alive connection and a stalled body | "
        f"exit {code if code is not None else 'none (killed after 60 s)'} after {seconds:.1f} s; "
        f"{answered} answered, {failed} failed |"
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--input", type=Path, required=True, help="sentences, one per line")
    p.add_argument("--clients", default="1,8,64")
    p.add_argument("--requests", type=int, default=300, help="requests per client count")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    p.add_argument("--batch-wait-ms", type=float, default=10.0)
    p.add_argument(
        "--only", default="load,slow,hostile,sigterm,interactive", help="which parts to run (comma-separated)"
    )
    p.add_argument("--label", default="", help="a word for the entry's heading, e.g. before or after")
    p.add_argument("--record", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    args = p.parse_args()

    from nmt.checkpoint import load_checkpoint

    cfg = load_checkpoint(args.model).config
    src, tgt = cfg.data.src_lang, cfg.data.tgt_lang
    sentences = [s for s in args.input.read_text(encoding="utf-8").split("\n") if s.strip()]
    parts = args.only.split(",")
    tables: list[str] = []
    server = Server(args.model, args.threads, args.batch_wait_ms, [])
    try:
        if "load" in parts:
            load(server.url, sentences, 1, 10, src, tgt)  # warm-up
            rows = [
                load(server.url, sentences, int(c), args.requests, src, tgt) for c in args.clients.split(",")
            ]
            tables += [
                "| concurrent clients | requests | failed | requests/s | p50 latency | p95 latency |",
                "| --- | --- | --- | --- | --- | --- |",
                *(
                    f"| {r['clients']} | {r['requests']} | {r['failed']} | {r['per_s']:.1f} | "
                    f"{r['p50_ms']:.0f} ms | {r['p95_ms']:.0f} ms |"
                    for r in rows
                ),
                "",
            ]
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
        probes = ["| probe | result |", "| --- | --- |"]
        if "slow" in parts:
            probes += slow_clients(server, sentences[0], src, tgt)
        if "hostile" in parts:
            probes += hostile(server, sentences[0], src, tgt)
        if "sigterm" in parts:
            probes += sigterm_under_load(server, sentences, src, tgt)
        if len(probes) > 2:
            tables += probes
    finally:
        if server.proc.poll() is None:
            server.stop()
    print("\n".join(tables))
    if args.record:
        import torch

        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        label = f" ({args.label})" if args.label else ""
        entry = [
            f"### {now}{label}: {args.model}, cpu",
            "",
            f"- machine: {machine_name('cpu')}, {args.threads} torch threads for the server, "
            f"torch {torch.__version__}",
            f"- command: `python benchmarks/serve_load.py {' '.join(sys.argv[1:])}`",
            f"- one sentence per request, {args.requests} requests per row, batch window "
            f"{args.batch_wait_ms:g} ms, beam and length penalty from the checkpoint; the clients share the "
            "machine's cores with the server",
            "",
            *tables,
            "",
        ]
        record("\n".join(entry), SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
