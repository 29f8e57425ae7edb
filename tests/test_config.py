"""Recipe validation: one clear line naming the file and the dotted key, exit status 2."""

import io
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nmt.cli import app
from nmt.config import RECIPES_DIR, Precision, config_from_dict, config_to_dict, load_config
from nmt.errors import ConfigError

RECIPE = RECIPES_DIR / "multi30k-en-de.yaml"


def write_recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.read_text() + text)
    return path


def test_every_shipped_recipe_loads():
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    assert "multi30k-en-de" in names
    for name in names:
        cfg = load_config(name)
        assert cfg.model.d_model % cfg.model.heads == 0


def test_a_misspelt_key_is_named_with_a_suggestion(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.read_text().replace("warmup:", "warmpu:"))
    with pytest.raises(
        ConfigError, match=r"r\.yaml: unknown key train\.warmpu \(did you mean train\.warmup\?\)"
    ):
        load_config(path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_steps=abc", "train.max_steps: expected int, got str 'abc'"),
        ("model.heads=3", "model.heads: d_model 256 is not divisible by 3 heads"),
        ("train.precision=fp8", "train.precision: 'fp8' is not one of"),
        ("model.dropout=1.5", "model.dropout: must be in [0, 1)"),
        ("train.cooldown=1.5", "train.cooldown: must be in [0, 1]"),
        ("decode.nbest=9", "decode.nbest: must be between 1 and decode.beam"),
        # the bounds nmt.limits states for the options of the same names (nmt translate --beam, --seed)
        ("decode.beam=5000", "decode.beam: must be at most 1,024"),
        ("decode.seed=-1", "decode.seed: must be at least 0, got -1"),
        ("decode.max_len_b=100000000000000000000", "decode.max_len_b: must be at most 65,536"),
        ("decode.temperature=0.001", "decode.temperature: must be at least 0.01"),
        ("train=3", "train: expected a mapping"),
        ("nosuch.key=1", "unknown key nosuch"),
        ("train.max_steps", "expected KEY=VALUE"),
    ],
)
def test_overrides_are_validated_like_the_file(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, [override])
    assert message in str(e.value)


def test_train_precision_is_a_precision_stored_by_its_name():
    """One list of precision names (the Precision enum); a recipe and a checkpoint hold plain strings, so a
    checkpoint's config loads with torch.load(weights_only=True) and a model card's YAML is safe_dump's."""
    import torch
    import yaml

    cfg = load_config(RECIPE, ["train.precision=bf16"])
    assert cfg.train.precision is Precision.BF16 and load_config(RECIPE).train.precision is Precision.AUTO
    raw = config_to_dict(cfg)
    assert type(raw["train"]["precision"]) is str and raw["train"]["precision"] == "bf16"
    assert yaml.safe_load(yaml.safe_dump(raw)) == raw
    buffer = io.BytesIO()
    torch.save({"config": raw}, buffer)
    buffer.seek(0)
    assert config_from_dict(torch.load(buffer, weights_only=True)["config"]) == cfg


def test_overrides_set_values_with_yaml_types():
    cfg = load_config(RECIPE, ["train.max_steps=200", "train.max_minutes=1.5", "model.norm=pre"])
    assert cfg.train.max_steps == 200 and cfg.train.max_minutes == 1.5 and cfg.model.norm == "pre"


def test_missing_required_key(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("data:\n  src_lang: en\n")
    with pytest.raises(ConfigError, match="missing required key data.tgt_lang"):
        load_config(path)


def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("data:\n  src_lang: [en\n")
    with pytest.raises(ConfigError, match=r"r\.yaml: line \d+ not valid YAML"):
        load_config(path)


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
def test_cli_reports_one_line_and_exit_status_2(tmp_path):
    path = write_recipe(tmp_path, "")
    result = CliRunner().invoke(app, ["train", str(path), "--set", "train.lr=1", "--dry-run"])
    assert result.exit_code == 2
    assert "unknown key train.lr" in result.output
    # through the real console script: no traceback, one line on stderr
    proc = subprocess.run(
        [sys.executable, "-m", "nmt", "train", str(path), "--set", "train.lr=1", "--dry-run"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown key train.lr" in lines[0] and "r.yaml" in lines[0]


def test_dry_run_prints_the_exact_parameter_count():
    result = CliRunner().invoke(app, ["train", "wmt14-en-de-base", "--dry-run"])
    if result.exit_code != 0 and "no such recipe" in result.stderr:
        pytest.skip("WMT14 recipes not present")
    assert result.exit_code == 0, result.output
    assert "parameters: 63,082,496" in result.stderr


def test_every_command_has_help_with_examples():
    runner = CliRunner()
    top = runner.invoke(app, ["--help"])
    assert top.exit_code == 0
    for command in ("preprocess", "train", "translate", "score", "average", "run", "plot", "export"):
        assert command in top.output
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0, command
        assert "Examples" in result.output, command
