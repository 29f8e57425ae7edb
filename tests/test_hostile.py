"""Hostile inputs, generated: any recipe text or --set override, any damage to a checkpoint file, any
shortlist inside one, any config.json value and any weight in a MarianMT or Pegasus folder gives a result
or nmt's own error (NmtError), never another exception. Example counts are bounded (the `nmt` profile in
tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip(
    "hypothesis", reason="hypothesis generates the inputs: pip install -e '.[dev]'"
)
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nmt.checkpoint import load_checkpoint  # noqa: E402
from nmt.config import config_to_dict, load_config  # noqa: E402
from nmt.errors import NmtError  # noqa: E402
from nmt.formats.huggingface import import_huggingface  # noqa: E402
from nmt.untrained import save_random_model  # noqa: E402

from .synthetic import make_config, make_subword  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FIXTURES = [HealthCheck.function_scoped_fixture]

# JSON values of every kind and size: nested, huge and non-finite numbers, wrong types
NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2, 3, 7, 64, 10**9, 1e10, 0.5, -0.0]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=20))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    """A valid recipe, checkpoint, MarianMT folder and Pegasus folder (a pre-norm model) to mutate."""
    from typer.testing import CliRunner

    from nmt.cli import app

    d = tmp_path_factory.mktemp("hostile")
    cfg = make_config()
    subword = make_subword(d / "spm")
    model = save_random_model(d / "model.pt", cfg, subword)
    pre = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, norm="pre"))
    pre_model = save_random_model(d / "pre.pt", pre, subword)
    for path, folder in ((model, d / "hf"), (pre_model, d / "pegasus")):
        args = ["export", "-m", str(path), "--format", "huggingface", "-o", str(folder)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    return {"dict": config_to_dict(cfg), "model": model, "marian": d / "hf", "pegasus": d / "pegasus"}


def either_result_or_nmt_error(call) -> None:
    try:
        call()
    except NmtError:
        pass


# ---- the recipe -------------------------------------------------------------------------------------

KEYS = [
    "model.heads",
    "model.d_model",
    "model.max_positions",
    "train.peak_lr",
    "data.vocab_size",
    "decode.beam",
]


@settings(suppress_health_check=FIXTURES)
@given(text=st.text(max_size=200) | VALUES.map(json.dumps))
def test_any_recipe_text_loads_or_is_a_config_error(base, tmp_path, text):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text, encoding="utf-8")
    either_result_or_nmt_error(lambda: load_config(recipe))


@settings(suppress_health_check=FIXTURES)
@given(
    section=st.sampled_from(["data", "model", "train", "decode"]),
    key=st.sampled_from(["heads", "d_model", "vocab_size", "peak_lr", "beam", "train", "x"]),
    value=VALUES,
)
def test_any_recipe_value_loads_or_is_a_config_error(base, tmp_path, section, key, value):
    import yaml

    doc = json.loads(json.dumps(base["dict"]))
    doc.setdefault(section, {})[key] = value
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(doc), encoding="utf-8")
    either_result_or_nmt_error(lambda: load_config(recipe))


@settings(suppress_health_check=FIXTURES)
@given(
    overrides=st.lists(st.sampled_from(KEYS).map(lambda k: k + "=") | st.just(""), max_size=3),
    tail=st.text(max_size=30),
)
def test_any_set_override_loads_or_is_a_config_error(base, tmp_path, overrides, tail):
    import yaml

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(base["dict"]), encoding="utf-8")
    either_result_or_nmt_error(lambda: load_config(recipe, [o + tail for o in overrides] + [tail]))


# ---- the checkpoint ---------------------------------------------------------------------------------


@settings(suppress_health_check=FIXTURES, max_examples=30)
@given(data=st.data())
def test_any_damaged_checkpoint_loads_or_is_a_checkpoint_error(base, tmp_path, data):
    raw = bytearray(base["model"].read_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.none() | st.integers(0, len(raw)))
    path = tmp_path / "damaged.pt"
    path.write_bytes(bytes(raw[:cut]))
    either_result_or_nmt_error(lambda: load_checkpoint(path))


# ---- a shortlist inside a checkpoint ------------------------------------------------------------------

ID_DTYPES = [torch.int32, torch.int64, torch.int16, torch.uint8, torch.float32, torch.bool]


@st.composite
def id_tensors(draw, vocab: int, dims: int) -> torch.Tensor:
    """A tensor a shortlist might hold: ids in and just outside the vocabulary, of any dtype and of a rank
    near `dims`, empty ones included."""
    shape = draw(st.lists(st.integers(0, 5), min_size=max(dims - 1, 0), max_size=dims + 1))
    n = math.prod(shape)
    ids = draw(st.lists(st.integers(-2, vocab + 1), min_size=n, max_size=n))
    return torch.tensor(ids, dtype=torch.int64).reshape(shape).to(draw(st.sampled_from(ID_DTYPES)))


@st.composite
def valid_table(draw, vocab: int, bad: bool = False) -> torch.Tensor:
    """(vocab, K) int32 ids in the vocabulary, K in 0..4; `bad`: one id just outside it, where K > 0."""
    seed, k = draw(st.integers(0, 2**16)), draw(st.integers(0, 4))
    table = torch.randint(0, vocab, (vocab, k), generator=torch.Generator().manual_seed(seed)).int()
    if bad and k:
        table[draw(st.integers(0, vocab - 1)), draw(st.integers(0, k - 1))] = draw(
            st.sampled_from([-1, vocab])
        )
    return table


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
@settings(suppress_health_check=FIXTURES, max_examples=30)
@given(data=st.data())
def test_any_shortlist_translates_or_is_one_error(base, tmp_path, data):
    """A checkpoint's shortlist entry of any type, rank, dtype and ids: `nmt translate --shortlist` either
    translates over it or stops with one line and status 2 (a tensor that passes the checkpoint's checks
    must decode: empty sets, a table without columns)."""
    from typer.testing import CliRunner

    from nmt.cli import app

    payload = torch.load(base["model"], weights_only=True)
    vocab = payload["vocab_size"]

    def frequent(low: int, high: int):
        return st.lists(st.integers(low, high), max_size=6).map(lambda v: torch.tensor(v, dtype=torch.int64))

    # valid more often than not (one_of would pick among all of SCALARS' branches), so both outcomes occur
    pick = lambda good, bad: data.draw(good if data.draw(st.integers(0, 4)) else bad)  # noqa: E731
    outside = st.tuples(frequent(0, vocab - 1), st.sampled_from([-2, -1, vocab, vocab + 1]))
    outside = outside.map(lambda t: torch.cat([t[0], torch.tensor([t[1]])]))
    bad = {1: outside, 2: valid_table(vocab, bad=True)}  # the right shape, an id outside the vocabulary
    hostile = lambda dims: bad[dims] if data.draw(st.booleans()) else id_tensors(vocab, dims) | SCALARS  # noqa: E731
    entry = {
        "frequent": pick(frequent(0, vocab - 1), hostile(1)),
        "table": pick(valid_table(vocab), hostile(2)),
    }
    payload["shortlist"] = pick(st.just(entry), SCALARS | st.just({"table": entry["table"]}))
    path = tmp_path / "shortlisted.pt"
    torch.save(payload, path)
    (tmp_path / "in.txt").write_text("a b c\n\nd e\n")
    args = ["translate", "-m", str(path), "-i", str(tmp_path / "in.txt"), "--shortlist", "--workers", "1"]
    result = CliRunner().invoke(app, args)
    event(f"exit status {result.exit_code}")  # --hypothesis-show-statistics: both outcomes occur
    if result.exit_code == 0:
        assert result.stdout.count("\n") == 3, result.stdout
    else:
        assert result.exit_code == 2, (result.output, result.exception)
        assert result.output.startswith("error: ") and result.output.strip().count("\n") == 0, result.output


# ---- a MarianMT or Pegasus folder -------------------------------------------------------------------


def fresh(base: dict, tmp_path: Path, layout: str) -> Path:
    folder = tmp_path / "hf"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(base[layout], folder)
    (tmp_path / "out.pt").unlink(missing_ok=True)
    return folder


CONFIG_KEYS = [
    "vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_ffn_dim", "decoder_ffn_dim",
    "encoder_attention_heads", "decoder_attention_heads", "max_position_embeddings", "dropout",
    "activation_function", "pad_token_id", "eos_token_id", "decoder_start_token_id", "scale_embedding",
    "normalize_before", "model_type", "share_encoder_decoder_embeddings", "add_final_layer_norm",
]  # fmt: skip
LAYOUTS = pytest.mark.parametrize("layout", ["marian", "pegasus"])


@LAYOUTS
@settings(suppress_health_check=FIXTURES, max_examples=40)
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), VALUES, min_size=1, max_size=3))
def test_any_config_json_imports_or_is_one_error(base, tmp_path, layout, changes):
    folder = fresh(base, tmp_path, layout)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, allow_nan=True))
    either_result_or_nmt_error(lambda: import_huggingface(folder, tmp_path / "out.pt"))


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int8, torch.float64]


@LAYOUTS
@settings(suppress_health_check=FIXTURES, max_examples=30)
@given(data=st.data())
def test_any_weights_import_or_are_one_error(base, tmp_path, layout, data):
    from safetensors.torch import load_file, save_file

    folder = fresh(base, tmp_path, layout)
    weights = load_file(folder / "model.safetensors")
    names = sorted(weights)
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(names))
        how = data.draw(st.sampled_from(["shape", "dtype", "value", "drop"]))
        w = weights.get(name)
        if w is None:  # dropped by an earlier draw
            continue
        if how == "shape":
            shape = data.draw(st.lists(st.integers(0, 70), min_size=0, max_size=3))
            weights[name] = torch.zeros(shape)
        elif how == "dtype":
            weights[name] = w.to(data.draw(st.sampled_from(DTYPES)))
        elif how == "value" and w.numel():
            w = w.clone().reshape(-1)
            w[data.draw(st.integers(0, w.numel() - 1))] = data.draw(
                st.sampled_from([math.nan, math.inf, 1e30])
            )
            weights[name] = w.reshape(weights[name].shape)
        else:
            weights.pop(name)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    either_result_or_nmt_error(lambda: import_huggingface(folder, tmp_path / "out.pt"))
