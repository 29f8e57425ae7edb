"""Foreign files are checked before they allocate: a MarianMT folder's config.json, weights, vocab.json
and SentencePiece models (`nmt import`), and the recipe's values before any arithmetic with them. Each
failure is one line naming the file and the field, exit status 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nmt.cli import app
from nmt.config import load_config
from nmt.errors import ConfigError
from nmt.untrained import save_random_model

from .synthetic import make_config, make_subword

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def marian(tmp_path_factory) -> Path:
    """A tiny random model as a MarianMT folder, written by `nmt export --format huggingface`."""
    d = tmp_path_factory.mktemp("foreign")
    model = save_random_model(d / "model.pt", make_config(), make_subword(d / "spm"))
    result = CliRunner().invoke(
        app, ["export", "-m", str(model), "--format", "huggingface", "-o", str(d / "hf")]
    )
    assert result.exit_code == 0, result.output
    return d / "hf"


def copy_of(marian: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(marian, folder)
    return folder


def import_error(folder: Path, *names: str) -> str:
    out = folder.parent / "imported.pt"
    result = CliRunner().invoke(app, ["import", str(folder), "-o", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.output and len(lines) == 1, result.output
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert not out.exists()
    return lines[0]


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    "key, value",
    [
        ("vocab_size", 1e10),
        ("vocab_size", 10**10),
        ("d_model", 10**9),
        ("max_position_embeddings", 10**9),
        ("encoder_attention_heads", 0),
        ("encoder_attention_heads", 3),  # does not divide d_model 64
        ("decoder_layers", -1),
        ("dropout", "lots"),
        ("encoder_ffn_dim", True),
    ],
)
def test_config_json_sizes_are_bounded_before_anything_is_built(marian, tmp_path, key, value):
    folder = copy_of(marian, tmp_path)
    edit_config(folder, **{key: value})
    import_error(folder, "config.json", key)


def test_deeply_nested_config_json_is_one_line(marian, tmp_path):
    folder = copy_of(marian, tmp_path)
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    import_error(folder, "config.json")


def weights_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def save_weights(folder: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "name, change",
    [
        ("fc1.weight", lambda w: w[:, :-1].contiguous()),  # wrong shape
        ("self_attn.k_proj.weight", lambda w: w[:-2].contiguous()),
        ("self_attn_layer_norm.weight", lambda w: torch.ones(3)),
        ("fc1.weight", lambda w: torch.full_like(w, float("nan"))),  # not finite
    ],
)
def test_weights_are_checked_for_shape_and_finiteness_at_import(marian, tmp_path, name, change):
    folder = copy_of(marian, tmp_path)
    weights = weights_of(folder)
    key = next(k for k in weights if k.startswith("model.encoder.layers.0.") and k.endswith(name))
    weights[key] = change(weights[key])
    save_weights(folder, weights)
    import_error(folder, "model.safetensors", key)


def test_a_vocabulary_of_other_pieces_is_refused(marian, tmp_path):
    folder = copy_of(marian, tmp_path)
    vocab = json.loads((folder / "vocab.json").read_text())
    other = {(f"x{i}x" if not piece.startswith("<") else piece): i for piece, i in vocab.items()}
    (folder / "vocab.json").write_text(json.dumps(other))
    import_error(folder, "vocab.json", "SentencePiece")


def test_a_random_sentencepiece_file_names_the_file(marian, tmp_path):
    folder = copy_of(marian, tmp_path)
    (folder / "source.spm").write_bytes(bytes(range(256)) * 8)
    import_error(folder, "source.spm", "SentencePiece")


# ---- the recipe -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.heads=0", "model.heads"),
        ("model.heads=-4", "model.heads"),
        ("model.d_model=0", "model.d_model"),
        ("model.max_positions=1000000000", "model.max_positions"),
        ("data.vocab_size=10000000000", "data.vocab_size"),
        ("train.peak_lr=.inf", "train.peak_lr"),
    ],
)
def test_recipe_values_are_checked_before_arithmetic(tmp_path, override, key):
    recipe = tmp_path / "r.yaml"
    import yaml

    from nmt.config import config_to_dict

    recipe.write_text(yaml.safe_dump(config_to_dict(make_config())))
    with pytest.raises(ConfigError, match=key):
        load_config(recipe, [override])
