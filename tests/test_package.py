"""A real package: the wheel that `pip install .` builds runs on its own, shipped recipes included."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_installed_wheel_finds_its_recipes_by_name_and_by_path(tmp_path):
    wheels = tmp_path / "wheels"
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(wheels),
    ]
    subprocess.run([*build, str(ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("nmt-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=300, capture_output=True)
    # torch and the other dependencies come from this environment; nmt only from the wheel
    (lib,) = (venv / "lib").glob("python3*/site-packages")
    (lib / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def nmt(*args: str) -> subprocess.CompletedProcess:
        cmd = [str(venv / "bin" / "nmt"), *args]
        return subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)

    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import nmt; print(nmt.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    by_name = nmt("train", "wmt14-en-de-base", "--dry-run")
    assert by_name.returncode == 0, by_name.stderr
    assert "parameters: 63,082,496" in by_name.stderr
    (elsewhere / "mine.yaml").write_text((ROOT / "recipes" / "multi30k-en-de.yaml").read_text())
    by_path = nmt("train", "mine.yaml", "--dry-run")
    assert by_path.returncode == 0, by_path.stderr
