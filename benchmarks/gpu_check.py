"""The GPU path, proven and measured in one command: tests, training, decoding and a demo run.

Each stage (STAGES; --stages) is a command run in a child process within --budget; the report goes to
OUT/report.md and .json (--tiny: every stage tiny, on the CPU; --data, --mirror, --wheels). Stages, budget
and failures: benchmarks/README.md, GPU check.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from common import now  # benchmarks/common.py: these scripts run with benchmarks/ on sys.path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
OPTIONAL = ("pytest", "ctranslate2", "triton", "numpy")
MODULE_OF = {"pyyaml": "yaml"}  # nmt's dependencies whose module is named otherwise


def runtime_modules() -> list[str]:
    """The modules of nmt's own dependencies (pyproject.toml), which a bare GPU image may lack: a CUDA
    image had torch, typer and sacrebleu but not pysbd, and every stage that imports nmt.translate died."""
    import tomllib

    names = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    dists = [re.match(r"[A-Za-z0-9_.-]+", n)[0].lower() for n in names]
    return [MODULE_OF.get(d, d.replace("-", "_")) for d in dists]


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
TINY_MODEL = ["model.encoder_layers=1", "model.decoder_layers=1", "model.d_model=32", "model.d_ff=64"]
TINY_MODEL.append("model.heads=2")
TINY_TRAIN = [*TINY_MODEL, "data.vocab_size=100", "train.batch_tokens=256", "train.update_tokens=512"]
# --tiny runs a compiling script with torch.compile on dynamo's eager backend: the graphs are captured,
# inductor's code generation (minutes on a busy CPU) is left out.
EAGER_COMPILE = (
    "import functools, os, runpy, sys, torch; "
    "torch.compile = functools.partial(torch.compile, backend='eager'); "
    "sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(sys.argv[0])); "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def stage_budget(stage: Stage, left: float, later: list[Stage], tiny: bool) -> float:
    """Seconds this stage may take: its cap, or what is left once the later stages' minimums are kept."""
    cap = stage.tiny_cap if tiny else stage.cap
    keep = 0.0 if tiny else sum(s.minimum for s in later)
    return min(cap, left - keep)


# ---------------------------------------------------------------------------------------------------------
# Running the stages


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.environment:  # in a child: the environment stage
        print(json.dumps(environment()))
        return 0
    out = args.out.resolve()
    args.budget = args.budget or (900.0 if args.tiny else 540.0)
    names = [s.strip() for s in args.stages.split(",")] if args.stages else list(BY_NAME)
    if unknown := [n for n in names if n not in BY_NAME]:
        print(f"error: --stages: no stage {unknown[0]!r}; stages: {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    if args.data is not None and demo_data(args.data) is None:
        print(f"error: --data {args.data}: no preprocessed data there (spm.model, train.*)", file=sys.stderr)
        return 2
    for folder in ("logs", "stages"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    title = "GPU check" + (" (--tiny: on the CPU, shapes and durations shrunk)" if args.tiny else "")
    command = shlex.join(["python3", "benchmarks/gpu_check.py", *(argv or sys.argv[1:])])
    report = dict(title=title, started=now(), command=command, tiny=args.tiny, budget_s=args.budget)
    report["stages"] = {}
    env = child_env(out, args, report)
    write_report(out, report)
    # SIGTERM (a scheduler's time limit) unwinds like Ctrl-C: the running stage's processes are killed
    # and the report says where the run stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run_stages(names, out, args, env, report)
    except KeyboardInterrupt:
        for name in [n for n, e in report["stages"].items() if e["status"] == "running"]:
            report["stages"][name] = {"status": "failed", "reason": "the check was stopped during it"}
        report["stopped"] = now()
        write_report(out, report)
        print(f"stopped; report: {out / 'report.md'}", file=sys.stderr)
        return 130
    report["finished"] = now()
    write_report(out, report)
    print(f"\n{(out / 'report.md').read_text()}\nreport: {out / 'report.md'}, {out / 'report.json'}")
    return 0


def run_stages(names: list[str], out: Path, args: argparse.Namespace, env: dict, report: dict) -> None:
    """Each stage in turn, within the budget; the report rewritten after each."""
    started, no_gpu = time.monotonic(), None
    for i, name in enumerate(names):
        stage = BY_NAME[name]
        left = args.budget - (time.monotonic() - started)
        allowed = stage_budget(stage, left, [BY_NAME[n] for n in names[i + 1 :]], args.tiny)
        if no_gpu and name != "environment":
            entry = {"status": "skipped", "reason": no_gpu}
        elif allowed < (0 if args.tiny else stage.minimum) or allowed <= 0:
            why = f"the {args.budget:.0f}-second budget was spent before it"
            if left > 0:
                why = f"{left:.0f} s of the {args.budget:.0f}-second budget left, {left - allowed:.0f} s "
                why += "of them kept for the stages after it"
            entry = {"status": "skipped", "reason": f"{why}; run it alone with --stages {name}"}
        else:  # recorded first, so that a run killed from outside leaves a report naming the stage
            report["stages"][name] = {"status": "running", "cap_s": round(allowed), "started": now()}
            write_report(out, report)
            entry = run_stage(stage, allowed, out, args, env)
        report["stages"][name] = entry
        print(f"{name}: {entry['status']}" + (f" ({entry['reason']})" if entry.get("reason") else ""))
        if name == "environment" and entry["status"] == "ok" and not (args.tiny or entry["figures"]["cuda"]):
            no_gpu = "no CUDA GPU here (torch.cuda.is_available() is False); --tiny runs them on the CPU"
        report["seconds"] = round(time.monotonic() - started, 1)
        write_report(out, report)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for report.md, report.json, logs/ and work/")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and durations, on the CPU")
    p.add_argument("--budget", type=float, help="seconds for all the stages (default 540; --tiny 900)")
    p.add_argument("--stages", help=f"comma-separated, in this order: {','.join(BY_NAME)} (default: all)")
    p.add_argument("--data", type=Path, help="the demo's data: a work directory of `nmt preprocess`")
    p.add_argument("--mirror", default=os.environ.get("NMT_DATA_MIRROR"), help="the demo's raw Multi30k")
    p.add_argument("--demo-minutes", type=float, default=DEMO_MINUTES, help="the demo's training time")
    p.add_argument("--wheels", type=Path, help="install these carried wheels (pytest, ctranslate2) first")
    p.add_argument("--work", type=Path, help="the stages' work, about 1 GB (default OUT/work)")
    p.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)  # a child: the probe
    return p


def child_env(out: Path, args: argparse.Namespace, report: dict) -> dict:
    """The children's environment: the source tree (and carried wheels) first on the path."""
    paths = [str(ROOT)]
    if args.wheels:
        site, report["wheels"] = install_wheels(args.wheels, out / "site-packages")
        paths = [str(site), *paths] if site else paths
    paths += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def install_wheels(folder: Path, target: Path) -> tuple[Path | None, str]:
    """Unpack every wheel in `folder` into `target`, a folder for the path: (target or None, what happened).
    No pip, no index, no console scripts (benchmarks/README.md, GPU check)."""
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


def run_stage(stage: Stage, seconds: float, out: Path, args: argparse.Namespace, env: dict) -> dict:
    """The stage's command in its own process group, killed (with whatever it started) after `seconds`;
    then what it printed or wrote, read back (the tests that ended, also from a run cut short)."""
    kind = stage.name.split("-")[0]
    work = (args.work or out / "work").resolve() / stage.name
    work.mkdir(parents=True, exist_ok=True)
    job = COMMANDS[kind](stage.name, args, work, seconds)
    if "cmd" not in job:  # nothing to run: skipped, with the reason
        return job
    log, stdout = out / "logs" / f"{stage.name}.log", out / "stages" / f"{stage.name}.out"
    start = time.monotonic()
    with open(log, "w") as err, open(stdout, "w") as result:
        print("$", shlex.join(job["cmd"]), file=err, flush=True)
        proc = subprocess.Popen(
            job["cmd"], cwd=ROOT, env=env, stdout=result, stderr=err, start_new_session=True
        )
        try:
            status = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            status = None
        finally:  # on a timeout, and when this process is stopped: nothing may keep the GPU after it
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    entry = {"seconds": round(time.monotonic() - start, 1), "cap_s": round(seconds)}
    entry.update(log=f"logs/{log.name}", command=shlex.join(job["cmd"]), notes=job.get("notes", []))
    try:
        if status == 0 or kind == "tests":
            entry.update(READERS[kind](stdout.read_text(errors="replace"), work, status, job))
    except (OSError, ValueError, KeyError) as e:
        entry.update(status="failed", reason=f"its output could not be read ({type(e).__name__}: {e})"[:400])
    if status is None:
        entry.update(status="failed", reason=f"timed out after {seconds:.0f} s (its cap within the budget)")
    elif status and kind != "tests":
        entry.update(status="failed", reason=f"exit status {status}")
    if entry["status"] == "failed":
        text = log.read_text(errors="replace") + stdout.read_text(errors="replace")
        entry["log_tail"] = text.splitlines()[-25:]
    return entry


# ---------------------------------------------------------------------------------------------------------
# Each stage's command, and its output read back


def version(module: str) -> str | None:
    """The module's version when it imports, else None."""
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return getattr(importlib.import_module(module), "__version__", "present")
    except Exception as e:  # present but broken (a missing shared library, say)
        return f"broken: {type(e).__name__}: {e}"[:200]


def importable(module: str) -> bool:
    return not (version(module) or "broken").startswith("broken")


def environment() -> dict:
    import torch

    f = {"python": platform.python_version(), "torch": torch.__version__, "cuda_runtime": torch.version.cuda}
    f.update(cuda=torch.cuda.is_available(), cpu=import_benchmark("common").machine_name("cpu"))
    f.update(cpu_count=os.cpu_count(), packages={m: version(m) for m in OPTIONAL})
    f.update(missing=[m for m in runtime_modules() if not importable(m)])
    f.update(c_compiler=shutil.which("cc") or shutil.which("gcc"))
    if f["cuda"]:
        props = torch.cuda.get_device_properties(0)
        f.update(gpu=props.name, gpus=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}")
        f.update(gpu_memory_gib=round(props.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported())
        f.update(cudnn=torch.backends.cudnn.version())
    return f


def environment_command(name: str, args, work: Path, seconds: float) -> dict:
    return {"cmd": [sys.executable, str(Path(__file__).resolve()), str(args.out), "--environment"]}


def tests_command(name: str, args, work: Path, seconds: float) -> dict:
    if not importable("pytest"):
        reason = "pytest is not importable: no GPU test ran (carry its wheels and pass --wheels DIR)"
        return {"status": "skipped", "reason": reason}
    (work / "junit.xml").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-v", "-rA", "-p", "no:cacheprovider"]
    cmd += [
        "--continue-on-collection-errors",
        f"--junitxml={work / 'junit.xml'}",
        f"--basetemp={work / 'tmp'}",
    ]
    return {"cmd": cmd}


VERBOSE_OUTCOME = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)\b")


def tests_result(stdout: str, work: Path, status: int | None, job: dict) -> dict:
    """Every test's outcome from pytest's JUnit XML; from its verbose lines when it was cut short."""
    if (work / "junit.xml").exists():
        return test_result(junit_outcomes(work / "junit.xml"), status)
    seen = []
    for m in filter(None, map(VERBOSE_OUTCOME.match, stdout.splitlines())):
        name = m[1].removeprefix("tests/").replace(".py::", "::", 1)
        seen.append({"test": name, "outcome": m[2].lower(), "message": "", "seconds": None})
    return test_result(seen, status, "incomplete: pytest wrote no report")


def test_result(tests: list[dict], exit_status: int | None, problem: str | None = None) -> dict:
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    counts["errors"] = counts.pop("error")
    bad = counts["failed"] + counts["errors"]
    ok = not bad and not problem and exit_status in (0, 5)  # 5: nothing was collected
    reason = problem or (f"{bad} of {len(tests)} tests failed" if bad else None)
    if not ok and reason is None:
        reason = f"pytest exited with status {exit_status}"
    figures = {"counts": counts, "tests": tests, "exit_status": exit_status}
    return {"status": "ok" if ok else "failed", "reason": reason, "figures": figures}


def junit_outcomes(path: Path) -> list[dict]:
    """[{"test", "outcome", "message", "seconds"}] from pytest's JUnit XML."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind, word in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if (found := case.find(kind)) is not None:
                outcome, message = word, (found.get("message") or found.text or "").strip()
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


def script(name: str, eager_compile: bool = False) -> list[str]:
    path = str(BENCHMARKS / f"{name}.py")
    return [sys.executable, "-c", EAGER_COMPILE, path] if eager_compile else [sys.executable, path]


def train_command(name: str, args, work: Path, seconds: float) -> dict:
    """benchmarks/train_throughput.py on one recipe, bf16, eager or compiled."""
    _, size, mode = name.split("-")
    compiled = mode == "compiled"
    argv = ["--json", "--set=train.precision=bf16", f"--set=train.compile={str(compiled).lower()}"]
    if args.tiny:
        argv += ["--device=cpu", *(f"--set={s}" for s in TINY_TRAIN), "--updates=2", "--warmup-updates=1"]
        argv += ["--windows=2", "--matmul-size=128"]
    else:  # compiling a dynamic-shape graph recompiles on the first shapes it meets: more warm-up
        argv += ["--device=cuda", "--updates=12", f"--warmup-updates={5 if compiled else 3}", "--windows=3"]
    tiny_compiled = args.tiny and compiled
    notes = ["--tiny: torch.compile on the eager backend (graph capture, no code generation)"][:tiny_compiled]
    return {"cmd": [*script("train_throughput", tiny_compiled), f"wmt14-en-de-{size}", *argv], "notes": notes}


def train_result(stdout: str, work: Path, status: int | None, job: dict) -> dict:
    r = json.loads(stdout)
    # The definition of MFU: the 6N rule of thumb (2N forward, 4N backward FLOPs per token).
    r["mfu_6n"] = 6 * r["parameters"] * r["target_tokens_per_s"] / r["matmul_flops_per_s"]
    r["mode"] = "compiled" if "--set=train.compile=true" in job["cmd"] else "eager"
    return {"status": "ok", "figures": r}


def decode_command(name: str, args, work: Path, seconds: float) -> dict:
    """benchmarks/translate_speed.py on random weights of the base model: its GPU engines (nmt bf16,
    CTranslate2 float16 and bfloat16), or with --tiny its CPU ones."""
    argv = ["--json", "--recipe"]
    if args.tiny:
        argv += ["multi30k-en-de", *(f"--set={s}" for s in [*TINY_MODEL, "data.vocab_size=200"])]
        argv += ["--device=cpu", "--lines=16", "--repeats=1", "--latency-lines=2", "--threads=1"]
    else:
        argv += ["wmt14-en-de-base", "--device=cuda", "--lines=300", "--repeats=3", "--latency-lines=30"]
        argv += [f"--threads={min(8, os.cpu_count() or 1)}"]
    why = f"ctranslate2 is not importable ({version('ctranslate2') or 'not installed'})"
    return {"cmd": [*script("translate_speed"), *argv], "notes": [] if importable("ctranslate2") else [why]}


def demo_data(path: Path) -> Path | None:
    """The data folder of a preprocessed work directory, given the directory or the folder itself."""
    for folder in (path / "data", path):
        if (folder / "spm.model").is_file() and (folder / "train.src.idx").is_file():
            return folder.resolve()
    return None


def demo_command(name: str, args, work: Path, seconds: float) -> dict:
    """`nmt run multi30k-en-de` on the device for --demo-minutes of training (or what the budget leaves)."""
    data = demo_data(args.data) if args.data else None
    if data is None and not args.mirror:
        why = "no Multi30k data: pass --data WORKDIR (preprocessed) or --mirror / NMT_DATA_MIRROR (raw files)"
        return {"status": "skipped", "reason": why}
    minutes, notes = (0.05 if args.tiny else args.demo_minutes), []
    left = (seconds - DEMO_OVERHEAD - (0 if data else DEMO_PREPROCESS)) / 60
    if not args.tiny and left < minutes:
        minutes = round(max(0.5, left), 2)
        notes.append(f"trained {minutes} of {args.demo_minutes} minutes, what the budget left")
    overrides = [f"train.device={'cpu' if args.tiny else 'cuda'}", f"train.max_minutes={minutes}"]
    if args.tiny:
        overrides += [*TINY_MODEL, "train.batch_tokens=512", "train.update_tokens=512"]
        overrides += ["train.valid_bleu=false", "train.save_every=5", "train.log_every=5"]
    # A fresh run each time, or `nmt run` would continue an earlier check's; data given by --data is
    # copied, so that nothing is ever preprocessed into it.
    for old in ("checkpoints", "translations", *(["data"] if data else [])):
        shutil.rmtree(work / old, ignore_errors=True)
    for old in ("metrics.jsonl", "train.log", "results.json", "results.md"):
        (work / old).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "nmt", "run", "multi30k-en-de", "--workdir", str(work)]
    cmd += [a for s in overrides for a in ("--set", s)]
    if data:
        shutil.copytree(data, work / "data")
    else:  # a local folder named relative to where the command was run, or a URL
        cmd += ["--mirror", str(Path(args.mirror).resolve()) if Path(args.mirror).exists() else args.mirror]
    return {"cmd": cmd, "notes": notes, "data": str(data) if data else f"preprocessed from {args.mirror}"}


def demo_result(stdout: str, work: Path, status: int | None, job: dict) -> dict:
    figures = json.loads((work / "results.json").read_text())
    figures.update(data=job["data"], results_md=(work / "results.md").read_text())
    return {"status": "ok", "figures": figures}


def json_result(stdout: str, work: Path, status: int | None, job: dict) -> dict:
    return {"status": "ok", "figures": json.loads(stdout)}


COMMANDS = dict(environment=environment_command, tests=tests_command, train=train_command)
COMMANDS.update(decode=decode_command, demo=demo_command)
READERS = dict(environment=json_result, tests=tests_result, train=train_result, decode=json_result)
READERS.update(demo=demo_result)


# ---------------------------------------------------------------------------------------------------------
# The report: the targets, the tests' outcomes, and what each script prints


def write_report(out: Path, report: dict) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(report_markdown(report))


def report_markdown(report: dict) -> str:
    stages, tt, ts = (
        report["stages"],
        import_benchmark("train_throughput"),
        import_benchmark("translate_speed"),
    )
    env = stages.get("environment", {}).get("figures", {})
    lines = [f"# {report['title']}: {env.get('gpu') or env.get('cpu') or 'device not probed'}", ""]
    lines += [
        f"- started {report['started']}"
        + (f", finished {report['finished']}" if "finished" in report else "")
    ]
    lines += [f"- command: `{report['command']}`"]
    if env:
        lines += [f"- python {env['python']}, torch {env['torch']}, CUDA {env['cuda_runtime']}"]
        lines += ["- " + ", ".join(f"{k} {v or 'not importable'}" for k, v in env["packages"].items())]
        lines += [f"- host CPU {env['cpu']} x {env['cpu_count']}, C compiler {env['c_compiler']}"]
        if env.get("missing"):
            missing = ", ".join(env["missing"])
            lines += [f"- **nmt's dependencies missing here: {missing}**: carry their wheels (--wheels)"]
    if env.get("gpu"):
        lines += [f"- {env['gpus']} x {env['gpu']}, compute {env['capability']}, {env['gpu_memory_gib']} GiB"]
        lines += [f"- bf16: {'yes' if env['bf16'] else 'no'}"]
    lines += [f"- wheels: {report['wheels']}"] if report.get("wheels") else []
    lines += [f"- {report.get('seconds', 0):.0f} s of a {report['budget_s']:.0f}-second budget", ""]
    notes = {n: "; ".join(filter(None, [e.get("reason"), *e.get("notes", [])])) for n, e in stages.items()}
    rows = [[n, e["status"], str(e.get("seconds", "")), notes[n]] for n, e in stages.items()]
    lines += [*table(["stage", "status", "seconds", "note"], rows), *targets_section(stages, report["tiny"])]
    if f := stages.get("tests", {}).get("figures"):
        counts = ", ".join(f"{v} {k}" for k, v in f["counts"].items())
        lines += ["", "## Tests (`pytest -m gpu tests`)", "", counts, ""]
        rows = [
            [t["test"], t["outcome"], str(t["seconds"]), " ".join(t["message"].split())] for t in f["tests"]
        ]
        lines += table(["test", "outcome", "seconds", "message"], [[*r[:3], r[3][:200]] for r in rows])
    for name in (n for n in BY_NAME if n.startswith("train-") and figures(stages, n)):
        f, command = figures(stages, name), stages[name]["command"].split("benchmarks/", 1)[-1]
        lines += ["", f"## {name}: `{command}`", "", "```", *tt.report_lines(f["recipe"], f)]
        lines += [f"{'MFU (6N)':20} {f['mfu_6n']:.1%}", "```"]
    if f := figures(stages, "decode"):
        lines += ["", f"## decode: `{f['about']['command']}`", ""]
        lines += [f["about"][k] for k in ("machine", "model_detail", "input")] + [""]
        lines += table(ts.HEADER, ts.table_rows([ts.Result(**r) for r in f["rows"]]))
    if f := figures(stages, "demo"):
        lines += [
            "",
            f"## demo: `{stages['demo']['command'].split(' -m ', 1)[-1]}`",
            "",
            f"Data: {f['data']}",
        ]
        lines += ["", f["results_md"].replace("# Results", "### Results", 1)]
    failed = {n: e for n, e in stages.items() if "log_tail" in e}
    lines += ["", "## Failures", ""] if failed else []
    for name, e in failed.items():
        tail = e["log_tail"] or ["(the log is empty)"]
        lines += [f"{name}: {e['reason']} (end of {e['log']}):", "", "```", *tail, "```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    escaped = [[cell.replace("|", "\\|") for cell in row] for row in rows]
    return import_benchmark("common").markdown_table(header, escaped)


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
        rows.append([f"MFU {size} >= {goal:.0%}", got, met(best and best["mfu_6n"] >= goal)])
    trains = [f for n in BY_NAME if n.startswith("train-") and (f := figures(stages, n))]
    waits = [f["end_to_end_data_wait"] for f in trains if f["end_to_end_data_wait"] is not None]
    got = f"at most {max(waits):.2%}" if waits else "not measured"
    rows.append(["data_wait < 1%", got, met(waits and max(waits) < 0.01)])
    ratio = nmt_against_ct2(figures(stages, "decode"))
    got = f"{ratio[1]:.2f} x {ratio[0]}" if ratio else "not measured"
    rows.append(["nmt bf16 >= 0.7 x CTranslate2 float16", got, met(ratio and ratio[1] >= 0.7)])
    rows = [[a, b, "n/a (--tiny)" if tiny else c] for a, b, c in rows]
    return ["", "## Targets", "", *table(["target (H100)", "measured", "met"], rows)]


def met(ok) -> str:
    return "n/a" if ok is None or ok == [] else ("yes" if ok else "no")


def nmt_against_ct2(f: dict | None) -> tuple[str, float] | None:
    """(the CTranslate2 row, nmt's speed as a multiple of it): float16 on a GPU, float32 on a CPU."""
    ct2 = [r for r in (f or {}).get("rows", []) if r["name"].startswith("CTranslate2")]
    if not ct2:
        return None
    ref = next((r for r in ct2 if r["name"].endswith((" float16", " float32"))), ct2[0])
    return ref["name"], 1 / statistics.median(ref["ratios"])


if __name__ == "__main__":
    sys.exit(main())
