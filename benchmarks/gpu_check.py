"""The GPU path, proven and measured in one command.

    make gpu-check                                              # the next line, into runs/gpu-check
    PYTHONPATH=. python3 benchmarks/gpu_check.py runs/gpu-check  # on a CUDA machine: about 8 minutes
    PYTHONPATH=. python3 benchmarks/gpu_check.py /tmp/gc --tiny  # every stage, tiny, on the CPU: < 1 min
    PYTHONPATH=. python3 benchmarks/gpu_check.py out --stages demo --data runs/multi30k-en-de

Stages, in this order, each a child process under its own time cap. A stage that fails, crashes or runs
out of time is recorded with its reason and the end of its log, and the next one runs:

  environment   the device, torch/CUDA versions, bf16, which optional packages import, a C compiler
  tests         `python -m pytest -m gpu tests`: the CUDA cases of tests/test_gpu.py (and any other
                gpu-marked test), each test's outcome read from pytest's JUnit XML
  train-*       training throughput of wmt14-en-de-base and -big at their per-GPU batch (12,500 tokens,
                two micro-batches an update), bf16 autocast, eager and compiled, on synthetic WMT-length
                batches through the trainer's own update and loader (benchmarks/train_throughput.py):
                target tokens/s, MFU = 6 x parameters x target tokens/s over the dense bf16 matmul rate
                measured in the same process (8192^3 products), MFU from the counted FLOPs of every
                pair, peak GPU memory, and the share of a loader-fed window spent waiting for data
  decode        nmt bf16 against CTranslate2 float16 and bfloat16 on one checkpoint of
                wmt14-en-de-base's shape (random weights, 37,000 subwords) exported by `nmt export`:
                beam 4, every output 30 subwords, 300 sentences of newstest2014's length distribution,
                target tokens/s (benchmarks/translate_speed.py)
  demo          the multi30k-en-de recipe trained on the GPU for 3 minutes from binarized data (--data,
                or preprocessed first from --mirror / NMT_DATA_MIRROR), its last checkpoints averaged,
                test_2016_flickr translated and scored: updates, tokens/s, sacreBLEU

The whole run keeps within --budget seconds (default 540: 9 minutes). A stage is given its own cap or
what the budget has left after keeping the minimum of the stages after it, whichever is less, and is
skipped when that is below its own minimum; the demo trains for less than 3 minutes when that is all
the budget leaves, and says so. `--stages` runs chosen stages, to finish the rest in a second command.
Nothing here needs more than the runtime dependencies: without pytest the tests are skipped, without
ctranslate2 the CTranslate2 rows, each with the reason; `--wheels DIR` unpacks wheels carried there
(pytest, ctranslate2 and their dependencies) into OUT/site-packages, first on the stages' path.

Writes OUT/report.md and OUT/report.json (rewritten after every stage, so a run cut short still leaves
a report), each stage's log in OUT/logs/ and its work in OUT/work/. `--tiny` shrinks every model,
batch, count and duration and runs the stages on the CPU (a minute or two on 2 shared cores, less on an
idle machine): its figures mean nothing; it proves the harness.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
GIB = 1024**3
OPTIONAL = ("pytest", "ctranslate2", "triton", "numpy")


# ---------------------------------------------------------------------------------------------------------
# The stages and their time


@dataclass(frozen=True)
class Stage:
    name: str
    cap: float  # seconds at most on a GPU
    minimum: float  # seconds below which starting it is pointless
    tiny_cap: float = 240.0  # --tiny proves the harness on a CPU that may be shared: no tight caps


STAGES = [
    Stage("environment", cap=60, minimum=5),
    Stage("tests", cap=240, minimum=60),  # two of its tests compile: a minute or more each, cold
    Stage("train-base-eager", cap=75, minimum=30),
    Stage("train-base-compiled", cap=150, minimum=60),
    Stage("train-big-eager", cap=90, minimum=30),
    Stage("train-big-compiled", cap=150, minimum=60),
    Stage("decode", cap=150, minimum=45),
    Stage("demo", cap=330, minimum=120),
]
BY_NAME = {s.name: s for s in STAGES}
DEMO_MINUTES = 3.0
DEMO_OVERHEAD = 90.0  # seconds of the demo that are not training: start, average, translate, score
DEMO_PREPROCESS = 30.0  # and preprocessing from the raw files (7 s on 2 busy cores)

TINY_MODEL = [
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "model.d_model=32",
    "model.d_ff=64",
    "model.heads=2",
]
TINY_TRAIN = [*TINY_MODEL, "data.vocab_size=100", "train.batch_tokens=256", "train.update_tokens=512"]


def stage_budget(stage: Stage, left: float, later: list[Stage], tiny: bool) -> float:
    """Seconds this stage may take: its cap, or what is left once the later stages' minimums are kept."""
    cap = stage.tiny_cap if tiny else stage.cap
    keep = 0.0 if tiny else sum(s.minimum for s in later)
    return min(cap, left - keep)


# ---------------------------------------------------------------------------------------------------------
# The parent: run each stage in its own process, collect, report


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.stage:
        return run_stage(args)
    out = args.out.resolve()
    if args.budget is None:
        args.budget = 900.0 if args.tiny else 540.0
    names = [s.strip() for s in args.stages.split(",")] if args.stages else [s.name for s in STAGES]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"error: --stages: no stage {unknown[0]!r}; stages: {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    if args.data is not None and demo_data(args.data) is None:
        print(f"error: --data {args.data}: no preprocessed data there (spm.model, train.*)", file=sys.stderr)
        return 2
    for folder in ("logs", "stages"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    report = {
        "title": "GPU check" + (" (--tiny: on the CPU, shapes and durations shrunk)" if args.tiny else ""),
        "started": now(),
        "command": shlex.join(["python3", "benchmarks/gpu_check.py", *(argv or sys.argv[1:])]),
        "tiny": args.tiny,
        "budget_s": args.budget,
        "stages": {},
    }
    env = child_env(out, args, report)
    write_report(out, report)
    # SIGTERM (a scheduler's time limit) unwinds like Ctrl-C: the running stage's processes are killed
    # and the report says where the run stopped.
    signal.signal(signal.SIGTERM, interrupt)
    try:
        run_stages(names, out, args, env, report)
    except KeyboardInterrupt:
        running = [n for n, e in report["stages"].items() if e["status"] == "running"]
        for name in running:
            report["stages"][name] = {"status": "failed", "reason": "the check was stopped during it"}
        report["stopped"] = now()
        write_report(out, report)
        print(f"stopped; report: {out / 'report.md'}", file=sys.stderr)
        return 130
    report["finished"] = now()
    write_report(out, report)
    print(f"\n{(out / 'report.md').read_text()}\nreport: {out / 'report.md'}, {out / 'report.json'}")
    return 0


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_stages(names: list[str], out: Path, args: argparse.Namespace, env: dict, report: dict) -> None:
    """Each stage in turn, within the budget; the report rewritten after each."""
    started = time.monotonic()
    no_gpu = None
    for i, name in enumerate(names):
        stage = BY_NAME[name]
        left = args.budget - (time.monotonic() - started)
        allowed = stage_budget(stage, left, [BY_NAME[n] for n in names[i + 1 :]], args.tiny)
        if no_gpu and name != "environment":
            entry = {"status": "skipped", "reason": no_gpu}
        elif allowed < (0 if args.tiny else stage.minimum) or allowed <= 0:
            why = (
                f"the {args.budget:.0f}-second budget was spent before it"
                if left <= 0
                else f"{left:.0f} s of the {args.budget:.0f}-second budget left, {left - allowed:.0f} s of "
                "them kept for the stages after it"
            )
            entry = {"status": "skipped", "reason": f"{why}; run it alone with --stages {name}"}
        else:  # recorded first, so that a run killed from outside leaves a report naming the stage
            report["stages"][name] = {"status": "running", "cap_s": round(allowed), "started": now()}
            write_report(out, report)
            entry = run_child(stage, allowed, out, args, env)
        report["stages"][name] = entry
        print(f"{name}: {entry['status']}" + (f" ({entry['reason']})" if entry.get("reason") else ""))
        if (
            name == "environment"
            and entry["status"] == "ok"
            and not args.tiny
            and not entry["figures"]["cuda"]
        ):
            no_gpu = (
                "no CUDA GPU here (torch.cuda.is_available() is False); --tiny runs the stages on the CPU"
            )
        report["seconds"] = round(time.monotonic() - started, 1)
        write_report(out, report)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for report.md, report.json, logs/ and work/")
    p.add_argument(
        "--tiny", action="store_true", help="tiny shapes and durations, on the CPU: tests the harness"
    )
    p.add_argument("--budget", type=float, help="seconds for all the stages (default 540; --tiny 900)")
    p.add_argument("--stages", help=f"comma-separated, in this order: {','.join(BY_NAME)} (default: all)")
    p.add_argument(
        "--data", type=Path, help="the demo's data: a work directory of `nmt preprocess multi30k-en-de`"
    )
    p.add_argument(
        "--mirror", default=os.environ.get("NMT_DATA_MIRROR"), help="raw Multi30k files for the demo"
    )
    p.add_argument("--demo-minutes", type=float, default=DEMO_MINUTES, help="the demo's training time")
    p.add_argument("--wheels", type=Path, help="install these carried wheels (pytest, ctranslate2) first")
    p.add_argument("--work", type=Path, help="the stages' work, about 1 GB of checkpoints (default OUT/work)")
    p.add_argument("--stage", help=argparse.SUPPRESS)  # in a child: run this one stage
    p.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)  # the child's allowance
    return p


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def child_env(out: Path, args: argparse.Namespace, report: dict) -> dict:
    """The children's environment: the source tree (and carried wheels) first on the path."""
    paths = [str(ROOT)]
    if args.wheels:
        site, note = install_wheels(args.wheels, out / "site-packages")
        report["wheels"] = note
        if site:
            paths.insert(0, str(site))
    old = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])),
        "PYTHONUNBUFFERED": "1",
    }


def install_wheels(folder: Path, target: Path) -> tuple[Path | None, str]:
    """Unpack every wheel in `folder` into `target`, a folder for the path: (target or None, what happened).

    A wheel is a zip of what goes into site-packages, so unpacking needs neither pip nor an index, and
    works where pip refuses a system python (PEP 668). Console scripts are not made: none is needed.
    """
    import zipfile

    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return None, f"--wheels {folder}: no .whl files there"
    try:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(target)
    except (OSError, zipfile.BadZipFile) as e:
        return None, f"--wheels {folder}: cannot unpack {wheel.name}: {e}"
    return target, f"unpacked {', '.join(w.name.split('-')[0] for w in wheels)} from {folder}"


def run_child(stage: Stage, seconds: float, out: Path, args: argparse.Namespace, env: dict) -> dict:
    """Run one stage in its own process group, killed (with whatever it started) after `seconds`."""
    result = out / "stages" / f"{stage.name}.json"
    result.unlink(missing_ok=True)
    log = out / "logs" / f"{stage.name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), str(out), "--stage", stage.name]
    cmd += [f"--seconds={seconds:.0f}", f"--demo-minutes={args.demo_minutes}"]
    cmd += ["--tiny"] if args.tiny else []
    cmd += [f"--data={args.data.resolve()}"] if args.data else []
    cmd += [f"--work={args.work.resolve()}"] if args.work else []
    if args.mirror:  # a local folder named relative to where the command was run, or a URL
        local = Path(args.mirror)
        cmd.append(f"--mirror={local.resolve() if local.exists() else args.mirror}")
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status = proc.wait(timeout=seconds)
            reason = None if status == 0 else f"exit status {status}"
        except subprocess.TimeoutExpired:
            reason = f"timed out after {seconds:.0f} s (its cap within the budget)"
        finally:  # on a timeout, and when this process is stopped: nothing may keep the GPU after it
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    entry = {
        "seconds": round(time.monotonic() - start, 1),
        "cap_s": round(seconds),
        "log": f"logs/{log.name}",
    }
    if result.exists():  # also when it failed: what it got done (the tests that ran, say)
        entry.update(json.loads(result.read_text()))
    if reason is not None or not result.exists():
        entry.update(status="failed", reason=reason or "it wrote no result")
    if entry["status"] == "failed":
        entry["log_tail"] = log.read_text(errors="replace").splitlines()[-25:]
    return entry


# ---------------------------------------------------------------------------------------------------------
# A child: one stage


def run_stage(args: argparse.Namespace) -> int:
    """Run one stage and write its result; an exception is a failed stage with its message."""
    out = args.out.resolve()
    work = (args.work or out / "work").resolve() / args.stage
    work.mkdir(parents=True, exist_ok=True)
    stage = {
        "environment": stage_environment,
        "tests": stage_tests,
        "train-base-eager": lambda a, w: stage_train(a, w, "wmt14-en-de-base", compiled=False),
        "train-base-compiled": lambda a, w: stage_train(a, w, "wmt14-en-de-base", compiled=True),
        "train-big-eager": lambda a, w: stage_train(a, w, "wmt14-en-de-big", compiled=False),
        "train-big-compiled": lambda a, w: stage_train(a, w, "wmt14-en-de-big", compiled=True),
        "decode": stage_decode,
        "demo": stage_demo,
    }[args.stage]
    try:
        result = stage(args, work)
    except Exception as e:
        import traceback

        traceback.print_exc()
        result = {"status": "failed", "reason": f"{type(e).__name__}: {str(e).strip()[:400]}"}
    write_result(args, result)
    return 0


def write_result(args: argparse.Namespace, result: dict) -> None:
    """The stage's result for the parent (also a partial one, while the stage runs)."""
    path = args.out.resolve() / "stages" / f"{args.stage}.json"
    path.with_suffix(".part").write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".part").replace(path)  # never half a file, whenever the stage is killed


def device_name(args: argparse.Namespace) -> str:
    return "cpu" if args.tiny else "cuda"


def version(module: str) -> str | None:
    """The module's version when it imports, else None."""
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return getattr(importlib.import_module(module), "__version__", "present")
    except Exception as e:  # present but broken (a missing shared library, say)
        return f"broken: {type(e).__name__}: {e}"[:200]


def importable(module: str) -> bool:
    found = version(module)
    return found is not None and not found.startswith("broken")


def stage_environment(args: argparse.Namespace, work: Path) -> dict:
    import torch

    f = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda": torch.cuda.is_available(),
        "cpu": machine("cpu"),
        "cpu_count": os.cpu_count(),
        "packages": {m: version(m) for m in OPTIONAL},
        "c_compiler": shutil.which("cc") or shutil.which("gcc"),
    }
    if f["cuda"]:
        props = torch.cuda.get_device_properties(0)
        f.update(
            gpu=props.name,
            gpus=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / GIB, 1),
            bf16=torch.cuda.is_bf16_supported(),
            cudnn=torch.backends.cudnn.version(),
            nccl=nccl_version(),
        )
    return {"status": "ok", "figures": f}


def nccl_version() -> str | None:
    import torch

    try:
        v = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
    except Exception as e:  # NCCL absent from this build
        return f"unavailable: {type(e).__name__}"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def machine(device: str) -> str:
    return import_benchmark("common").machine_name(device)


def stage_tests(args: argparse.Namespace, work: Path) -> dict:
    """`pytest -m gpu tests`; every test's outcome from the JUnit XML."""
    if not importable("pytest"):
        return {
            "status": "skipped",
            "reason": "pytest is not importable: no GPU test ran (carry its wheels and pass --wheels DIR)",
        }
    xml = work / "junit.xml"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-v", "-rA", "-p", "no:cacheprovider"]
    cmd += ["--continue-on-collection-errors", f"--junitxml={xml}", f"--basetemp={work / 'tmp'}"]
    print("$", shlex.join(cmd), flush=True)
    # The outcomes so far are written as each test ends: a run stopped at its cap still reports them.
    seen: list[dict] = []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        ended = VERBOSE_OUTCOME.match(line)
        if ended:
            name = ended[1].removeprefix("tests/").replace(".py::", "::", 1)
            seen.append({"test": name, "outcome": ended[2].lower(), "message": "", "seconds": None})
            write_result(args, test_result(seen, None, "incomplete: pytest was still running"))
    status = proc.wait()
    if not xml.exists():
        return test_result(seen, status, f"pytest exited with status {status} and wrote no report")
    return test_result(junit_outcomes(xml), status)


VERBOSE_OUTCOME = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)\b")


def test_result(tests: list[dict], exit_status: int | None, problem: str | None = None) -> dict:
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    counts["errors"] = counts.pop("error")
    bad = counts["failed"] + counts["errors"]
    ok = not bad and not problem and exit_status in (0, 5)  # 5: nothing was collected
    reason = problem or (f"{bad} of {len(tests)} tests failed" if bad else None)
    if not ok and reason is None:
        reason = f"pytest exited with status {exit_status}"
    return {
        "status": "ok" if ok else "failed",
        "reason": reason,
        "figures": {"counts": counts, "tests": tests, "exit_status": exit_status},
    }


def junit_outcomes(path: Path) -> list[dict]:
    """[{"test", "outcome", "message", "seconds"}] from pytest's JUnit XML."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (found.get("message") or found.text or "").strip()
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}".removeprefix("tests.")
        tests.append(
            {"test": name, "outcome": outcome, "message": message[:500], "seconds": case.get("time")}
        )
    return tests


def import_benchmark(name: str):
    """A sibling script as a module, with benchmarks/ on the path as when run directly."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def stage_train(args: argparse.Namespace, work: Path, recipe: str, compiled: bool) -> dict:
    """benchmarks/train_throughput.py's measurement of one recipe, bf16, eager or compiled."""
    tt = import_benchmark("train_throughput")
    argv = [
        f"--device={device_name(args)}",
        "--set=train.precision=bf16",
        f"--set=train.compile={str(compiled).lower()}",
    ]
    notes = []
    if args.tiny:
        argv += [*(f"--set={s}" for s in TINY_TRAIN), "--updates=2", "--warmup-updates=1", "--windows=2"]
        argv += ["--matmul-size=128"]
        if compiled:
            import functools

            import torch

            # Inductor's code generation takes minutes on a busy CPU and --tiny only proves the harness:
            # dynamo captures the graphs, its eager backend runs them.
            torch.compile = functools.partial(torch.compile, backend="eager")
            notes.append("--tiny: torch.compile with backend='eager' (graph capture, no code generation)")
    else:
        # Compiling a dynamic-shape graph recompiles on the first shapes it meets: more warm-up updates.
        argv += ["--updates=12", f"--warmup-updates={5 if compiled else 3}", "--windows=3"]
    _, r = tt.run(recipe, tt.parser().parse_args(argv), tt.WMT_LENGTHS)
    figures = {
        key: r[key]
        for key in (
            "device",
            "dtype",
            "parameters",
            "batch_tokens",
            "accumulation",
            "updates",
            "target_tokens_per_s",
            "target_tokens_per_update",
            "padding_fraction",
            "peak_memory_bytes",
            "peak_memory_kind",
            "model_flops_per_s",
            "matmul",
            "matmul_flops_per_s",
            "mfu",
            "end_to_end_target_tokens_per_s",
            "end_to_end_data_wait",
        )
    }
    # The definition: the 6N rule of thumb (2N forward, 4N backward FLOPs per token).
    figures["mfu_6n"] = 6 * r["parameters"] * r["target_tokens_per_s"] / r["matmul_flops_per_s"]
    figures.update(
        recipe=recipe,
        mode="compiled" if compiled else "eager",
        command=shlex.join(["python", "benchmarks/train_throughput.py", recipe, *argv]),
    )
    return {"status": "ok", "figures": figures, "notes": notes}


def stage_decode(args: argparse.Namespace, work: Path) -> dict:
    """benchmarks/translate_speed.py's engines on one exported checkpoint of the base model's shape."""
    import dataclasses
    import random

    ts = import_benchmark("translate_speed")
    device = device_name(args)
    if args.tiny:
        checkpoint = random_checkpoint(work, "multi30k-en-de", TINY_MODEL, vocab=200)
        n_lines, repeats, latency, threads = 16, 1, 2, 1
    else:
        checkpoint = random_checkpoint(work, "wmt14-en-de-base", [], vocab=37000)
        n_lines, repeats, latency, threads = 300, 3, 30, min(8, os.cpu_count() or 1)
    from nmt.checkpoint import load_checkpoint

    ckpt = load_checkpoint(checkpoint)
    # Random weights almost never emit EOS: every output runs to one fixed length, the same work for all.
    decode = dataclasses.replace(ckpt.config.decode, beam=4, nbest=1, max_len_a=0.0, max_len_b=30)
    lines = synthetic_lines(work, n_lines)
    engines = ts.CPU_ENGINES if device == "cpu" else ts.GPU_ENGINES
    nmt_only = [e for e in engines if e[0] == "nmt"]  # the rows that need no CTranslate2
    notes = []
    ct2_dir = work / "ct2"
    if importable("ctranslate2"):
        from nmt.formats.export import export

        shutil.rmtree(ct2_dir, ignore_errors=True)
        try:
            export(checkpoint, ct2_dir)
        except Exception as e:
            notes.append(f"CTranslate2 rows skipped: the export failed ({type(e).__name__}: {e})"[:400])
            engines = nmt_only
    else:
        notes.append(
            "CTranslate2 rows skipped: ctranslate2 is not importable "
            f"({version('ctranslate2') or 'not installed'})"
        )
        engines = nmt_only
    job = {
        "checkpoint": str(checkpoint),
        "ct2_dir": str(ct2_dir),
        "decode": dataclasses.asdict(decode),
        "device": device,
        "threads": threads,
        "lines": lines,
        "latency_lines": random.Random(3).sample(lines, latency),
    }
    try:
        results = ts.measure(job, engines, repeats)
    except (Exception, SystemExit) as e:  # a CTranslate2 worker that dies must not take nmt's row along
        if engines == nmt_only:
            raise
        notes.append(f"CTranslate2 rows failed ({type(e).__name__}: {e}); nmt measured alone")
        results = ts.measure(job, nmt_only, repeats)
    rows = [
        {
            "engine": r.name,
            "target_tokens_per_s": r.tokens_per_s,
            "sentences_per_s": r.sentences_per_s,
            "nmt_time_over_engine_time": sorted(r.ratios)[len(r.ratios) // 2],
            "latency_ms": r.latency_ms,
            "rss_peak_bytes": r.rss_peak,
        }
        for r in results
    ]
    params = sum(v.numel() for v in ckpt.model_state.values())
    m = ckpt.config.model
    about = (
        f"{m.encoder_layers}+{m.decoder_layers} layers, d_model {m.d_model}, vocabulary {ckpt.vocab_size}, "
        f"{params:,} parameters, random weights; {len(lines)} sentences, beam 4, every output 30 subwords, "
        f"batch budget {decode.batch_tokens} tokens, timed passes: {repeats} (round-robin), "
        f"CPU threads: {threads}"
    )
    return {
        "status": "ok",
        "figures": {"rows": rows, "about": about, "device": machine(device)},
        "notes": notes,
    }


def random_checkpoint(work: Path, recipe: str, overrides: list[str], vocab: int) -> Path:
    """A checkpoint of the recipe's model with random weights and a word-level SentencePiece model of
    `vocab` made-up words (a word model trains in seconds where a 37,000-piece BPE model would not)."""
    from nmt.config import load_config

    common = import_benchmark("common")
    cfg = load_config(recipe, [*overrides, f"data.vocab_size={vocab}"])
    words = common.make_words("en", vocab, seed=1)
    subword = common.train_spm(
        [" ".join(words[i : i + 20]) for i in range(0, len(words), 20)],
        work / "spm",
        vocab,
        model_type="word",
        hard_vocab_limit=False,  # at most `vocab`: four of the words give way to the special ids
        max_sentencepiece_length=64,  # no word is left out for its length
    )
    (work / "words.txt").write_text("\n".join(words) + "\n")
    return common.save_random_model(work / "random.pt", cfg, subword)


def synthetic_lines(work: Path, n: int) -> list[str]:
    """n sentences of random_checkpoint's words, Zipf-distributed, with newstest2014's words per sentence
    (no capitals or full stops, which a word model would take for other words)."""
    import torch

    common = import_benchmark("common")
    words = (work / "words.txt").read_text().split()
    g = torch.Generator().manual_seed(2)
    lengths = common.NEWSTEST_WORDS.sources(n, g).tolist()
    ids = iter(common.Zipf(len(words)).draw(sum(lengths), g).tolist())
    return [" ".join(words[next(ids)] for _ in range(k)) for k in lengths]


def demo_data(path: Path) -> Path | None:
    """The data folder of a preprocessed work directory, given the directory or the folder itself."""
    for folder in (path / "data", path):
        if (folder / "spm.model").is_file() and (folder / "train.src.idx").is_file():
            return folder.resolve()
    return None


def stage_demo(args: argparse.Namespace, work: Path) -> dict:
    """multi30k-en-de on the device for --demo-minutes (or what the budget leaves), then BLEU."""
    from rich.console import Console

    from nmt.config import DecodeOverrides, load_config
    from nmt.data.preprocess import preprocess
    from nmt.pipeline import average_last, training_summary, translate_test_set
    from nmt.score import corpus_scores, read_lines
    from nmt.train import train
    from nmt.translate import build_translator

    data = demo_data(args.data) if args.data else None
    if data is None and not args.mirror:
        return {
            "status": "skipped",
            "reason": "no Multi30k data: pass --data WORKDIR (preprocessed) or --mirror / NMT_DATA_MIRROR "
            "(the raw files)",
        }
    overhead = DEMO_OVERHEAD + (0 if data else DEMO_PREPROCESS)
    minutes = args.demo_minutes
    notes = []
    if args.tiny:
        minutes = 0.05
    elif args.seconds and (args.seconds - overhead) / 60 < minutes:
        minutes = round(max(0.5, (args.seconds - overhead) / 60), 2)
        notes.append(
            f"trained {minutes} of {args.demo_minutes} minutes, what the budget left; `--stages demo` "
            "alone trains them all"
        )
    device = device_name(args)
    overrides = [f"train.device={device}", f"train.max_minutes={minutes}"]
    if args.tiny:
        overrides += [
            *TINY_MODEL,
            "train.batch_tokens=512",
            "train.update_tokens=512",
            "train.valid_bleu=false",
        ]
        overrides += ["train.save_every=5", "train.log_every=5"]
    cfg = load_config("multi30k-en-de", overrides)
    # A fresh run each time: train() would resume from checkpoints left by an earlier one.
    for old in ("checkpoints", "translations"):
        shutil.rmtree(work / old, ignore_errors=True)
    for old in ("metrics.jsonl", "train.log"):
        (work / old).unlink(missing_ok=True)
    if (work / "data").is_symlink():  # given by an earlier --data: never preprocess into it
        (work / "data").unlink()
    console = Console(stderr=True, width=120)
    figures: dict = {"recipe": "multi30k-en-de", "overrides": overrides, "device": machine(device)}
    if data is not None:
        shutil.rmtree(work / "data", ignore_errors=True)
        (work / "data").symlink_to(data)
        figures["data"] = str(data)
    else:
        start = time.monotonic()
        preprocess(cfg, work, mirror=args.mirror, console=console)
        figures["preprocess_s"] = round(time.monotonic() - start, 1)
        figures["data"] = f"preprocessed from {args.mirror}"
    start = time.monotonic()
    train(cfg, work, console=console)
    figures["train_s"] = round(time.monotonic() - start, 1)
    figures["training"] = training_summary(work)
    model = average_last(cfg, work / "checkpoints", console)
    translator = build_translator(model, DecodeOverrides(), device, "auto", "torch", console).translator
    figures["tests"] = {}
    for corpus in cfg.data.test:
        speed = translate_test_set(cfg, work, corpus.name, translator, model, console)
        hyp = read_lines(work / "translations" / f"{corpus.name}.{cfg.data.tgt_lang}")
        ref = read_lines(work / "data" / "test" / f"{corpus.name}.{cfg.data.tgt_lang}")
        bleu = corpus_scores(hyp, [ref], ("bleu",))["bleu"]
        figures["tests"][corpus.name] = {
            "bleu": round(bleu.score, 2),
            "signature": bleu.signature,
            "speed": speed,
        }
    return {"status": "ok", "figures": figures, "notes": notes}


# ---------------------------------------------------------------------------------------------------------
# The report


def write_report(out: Path, report: dict) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(report_markdown(report))


def report_markdown(report: dict) -> str:
    stages = report["stages"]
    env = stages.get("environment", {}).get("figures", {})
    where = env.get("gpu") or env.get("cpu") or "device not probed"
    lines = [f"# {report['title']}: {where}", ""]
    lines += [
        f"- started {report['started']}"
        + (f", finished {report['finished']}" if "finished" in report else "")
    ]
    lines += [f"- command: `{report['command']}`"]
    if env:
        pk = env.get("packages", {})
        lines.append(
            f"- python {env.get('python')}, torch {env.get('torch')} (CUDA {env.get('cuda_runtime')}), "
            + ", ".join(f"{k} {v or 'not importable'}" for k, v in pk.items())
            + f", C compiler {env.get('c_compiler') or 'none'}"
        )
        if env.get("gpu"):
            lines.append(
                f"- {env['gpus']} x {env['gpu']} (compute {env['capability']}, {env['gpu_memory_gib']} GiB, "
                f"bf16 {'yes' if env['bf16'] else 'no'}), host CPU {env.get('cpu')} x {env.get('cpu_count')}"
            )
    if report.get("wheels"):
        lines.append(f"- wheels: {report['wheels']}")
    lines.append(f"- {report.get('seconds', 0):.0f} s of a {report['budget_s']:.0f}-second budget")
    lines += ["", "| stage | status | seconds | note |", "| --- | --- | --- | --- |"]
    for name in BY_NAME:
        if name in stages:
            e = stages[name]
            note = "; ".join(filter(None, [e.get("reason"), *e.get("notes", [])]))
            lines.append(f"| {name} | {e['status']} | {e.get('seconds', '')} | {note} |")
    lines += targets_section(stages, report["tiny"])
    lines += tests_section(stages.get("tests"))
    lines += train_section(stages)
    lines += decode_section(stages.get("decode"))
    lines += demo_section(stages.get("demo"))
    failed = {n: e for n, e in stages.items() if "log_tail" in e}
    if failed:
        lines += ["", "## Failures", ""]
        for name, e in failed.items():
            tail = e["log_tail"] or ["(the log is empty)"]
            lines += [f"{name}: {e['reason']} (end of {e['log']}):", "", "```", *tail, "```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def figures(stages: dict, name: str) -> dict | None:
    e = stages.get(name)
    return e["figures"] if e and e.get("status") == "ok" else None


def targets_section(stages: dict, tiny: bool) -> list[str]:
    """The issue's targets (on an H100), each with what this run measured (--tiny: not comparable)."""
    rows = []
    for size, goal in (("big", 0.45), ("base", 0.30)):
        runs = [f for m in ("compiled", "eager") if (f := figures(stages, f"train-{size}-{m}"))]
        best = max(runs, key=lambda f: f["mfu_6n"], default=None)
        got = f"{best['mfu_6n']:.1%} ({best['mode']})" if best else "not measured"
        rows.append((f"MFU {size} >= {goal:.0%}", got, met(best and best["mfu_6n"] >= goal)))
    waits = [
        f["end_to_end_data_wait"]
        for n in BY_NAME
        if n.startswith("train-") and (f := figures(stages, n)) and f["end_to_end_data_wait"] is not None
    ]
    rows.append(
        (
            "data_wait < 1%",
            f"at most {max(waits):.2%}" if waits else "not measured",
            met(waits and max(waits) < 0.01),
        )
    )
    ratio = nmt_against_ct2(figures(stages, "decode"))
    got = f"{ratio[1]:.2f} x {ratio[0]}" if ratio else "not measured"
    rows.append(("nmt bf16 >= 0.7 x CTranslate2 float16", got, met(ratio and ratio[1] >= 0.7)))
    out = ["", "## Targets", "", "| target (H100) | measured | met |", "| --- | --- | --- |"]
    return out + [f"| {a} | {b} | {'n/a (--tiny)' if tiny else c} |" for a, b, c in rows]


def met(ok) -> str:
    return "n/a" if ok is None or ok == [] else ("yes" if ok else "no")


def nmt_against_ct2(f: dict | None) -> tuple[str, float] | None:
    """(the CTranslate2 row, nmt's speed as a multiple of it): float16 on a GPU, float32 on a CPU."""
    rows = (f or {}).get("rows", [])
    ct2 = [r for r in rows if r["engine"].startswith("CTranslate2")]
    if not ct2:
        return None
    ref = next(
        (r for r in ct2 if r["engine"].endswith(("float16", "float32")) and "bfloat" not in r["engine"]),
        ct2[0],
    )
    return ref["engine"], 1 / ref["nmt_time_over_engine_time"]


def tests_section(e: dict | None) -> list[str]:
    if not e or "figures" not in e:
        return []
    f = e["figures"]
    c = f["counts"]
    out = ["", "## Tests (`pytest -m gpu tests`)", "", ", ".join(f"{v} {k}" for k, v in c.items())]
    out += ["", "| test | outcome | seconds | message |", "| --- | --- | --- | --- |"]
    for t in f["tests"]:
        message = " ".join(t["message"].split())[:200].replace("|", "\\|")
        out.append(f"| {t['test']} | {t['outcome']} | {t['seconds']} | {message} |")
    return out


def train_section(stages: dict) -> list[str]:
    runs = [(n, f) for n in BY_NAME if n.startswith("train-") and (f := figures(stages, n))]
    if not runs:
        return []
    out = [
        "",
        "## Training throughput (bf16 autocast, per-GPU batch, synthetic WMT-length data)",
        "",
        "| recipe | mode | parameters | target tok/s | MFU (6N) | MFU (counted FLOPs) | matmul TFLOP/s | "
        "peak memory GiB | data wait | end to end tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for _, f in runs:
        e2e = f["end_to_end_target_tokens_per_s"]
        wait = f["end_to_end_data_wait"]
        out.append(
            f"| {f['recipe']} | {f['mode']} | {f['parameters']:,} | {f['target_tokens_per_s']:,.0f} | "
            f"{f['mfu_6n']:.1%} | {f['mfu']:.1%} | {f['matmul_flops_per_s'] / 1e12:,.1f} ({f['matmul']}) | "
            f"{f['peak_memory_bytes'] / GIB:.2f} | {'n/a' if wait is None else f'{wait:.2%}'} | "
            f"{'n/a' if e2e is None else f'{e2e:,.0f}'} |"
        )
    f = runs[0][1]
    out += [
        "",
        f"Batches of {f['batch_tokens']:,} tokens x {f['accumulation']} per update "
        f"({f['target_tokens_per_update']:,.0f} target tokens, {f['padding_fraction']:.1%} padding); "
        f"{f['updates']} timed updates, median window. "
        "MFU (6N) = 6 x parameters x target tokens/s / the matmul rate measured in the same process.",
    ]
    return out


def decode_section(e: dict | None) -> list[str]:
    if not e or e.get("status") != "ok":
        return []
    f = e["figures"]
    out = ["", f"## Decoding on {f['device']}", "", f["about"], ""]
    out += [
        "| engine | target tok/s | sentences/s | nmt time / engine time | latency ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in f["rows"]:
        out.append(
            f"| {r['engine']} | {r['target_tokens_per_s']:,.0f} | {r['sentences_per_s']:,.1f} | "
            f"{r['nmt_time_over_engine_time']:.2f} | {r['latency_ms']:,.1f} |"
        )
    return out


def demo_section(e: dict | None) -> list[str]:
    if not e or e.get("status") != "ok":
        return []
    f = e["figures"]
    t = f["training"]
    out = ["", f"## Multi30k demo on {f['device']}", ""]
    out.append(
        f"- data: {f['data']}" + (f" ({f['preprocess_s']} s of preprocessing)" if "preprocess_s" in f else "")
    )
    out.append(f"- overrides: `{' '.join(f['overrides'])}`")
    out.append(
        f"- training: {t.get('updates')} updates in {f['train_s']} s, median {t.get('target_tokens_per_s')} "
        f"target tokens/s, best validation BLEU {t.get('best_valid_bleu')}"
    )
    for name, r in f["tests"].items():
        s = r["speed"]
        out.append(
            f"- {name}: sacreBLEU {r['bleu']} (`{r['signature']}`), translated at "
            f"{s['sentences_per_s']} sentences/s"
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
