"""`nmt export --format huggingface` of a pre-norm model: a Pegasus folder (PegasusForConditionalGeneration
with MarianMT's tokenizer), read by transformers' own classes and by `nmt import`.

The model is a tiny random pre-norm one whose every weight (LayerNorm gains and biases, the two final
norms, an output bias) is moved off its initial value, so that a weight mapped to the wrong place shows in
the logits; only PAD's row stays as training leaves it (zero). Random weights never learned to stop, so
greedy outputs are compared under one length limit, at which both engines force EOS.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nmt.checkpoint import load_checkpoint, load_model, save_checkpoint
from nmt.cli import app
from nmt.formats.huggingface import ABSENT_LOGIT, marian_order
from nmt.tokens import BOS, EOS, PAD
from nmt.translate import Translator
from nmt.untrained import save_random_model

from .synthetic import make_config, make_subword, sentence

# numerics: compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_torch_thread")]

pytest.importorskip("transformers", reason="transformers is the oracle: pip install -e '.[dev]'")
runner = CliRunner()
LIMIT = 12  # greedy output tokens before the forced EOS


@dataclasses.dataclass(frozen=True)
class Export:
    model: Path  # the nmt checkpoint (norm: pre)
    folder: Path  # its Pegasus folder
    output: str  # what `nmt export` printed
    lines: list[str]  # source sentences


@pytest.fixture(scope="module")
def pegasus(tmp_path_factory) -> Export:
    directory = tmp_path_factory.mktemp("pegasus-export")
    cfg = make_config()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, norm="pre", output_bias=True))
    path = save_random_model(directory / "pre.pt", cfg, make_subword(directory / "spm"))
    ckpt = load_checkpoint(path)
    g = torch.Generator().manual_seed(7)
    state = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in ckpt.model_state.items()}
    state["embed.weight"][PAD], state["output_bias"][PAD] = 0.0, 0.0  # as training leaves PAD's logit
    save_checkpoint(
        path,
        model_state=state,
        config=ckpt.config,
        subword_proto=ckpt.subword_proto,
        vocab_size=ckpt.vocab_size,
    )
    folder = directory / "hf"
    result = runner.invoke(app, ["export", "-m", str(path), "--format", "huggingface", "-o", str(folder)])
    assert result.exit_code == 0, result.output
    rng = random.Random(5)
    return Export(path, folder, result.output, [sentence(rng) for _ in range(24)])


def to_hf_ids(vocab_size: int, pad: int) -> torch.Tensor:
    """nmt id -> exported id of the same token (marian_order); nmt's PAD is the folder's padding."""
    order = marian_order(vocab_size)
    to_hf = torch.empty(vocab_size, dtype=torch.long)
    to_hf[order] = torch.arange(len(order))
    to_hf[PAD] = pad
    return to_hf


def test_transformers_own_classes_load_the_folder_as_pegasus(pegasus: Export):
    from transformers import (
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
        MarianTokenizer,
        PegasusForConditionalGeneration,
    )

    model, info = PegasusForConditionalGeneration.from_pretrained(pegasus.folder, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    auto = AutoModelForSeq2SeqLM.from_pretrained(pegasus.folder)
    assert type(auto) is PegasusForConditionalGeneration
    config = json.loads((pegasus.folder / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("pegasus", ["PegasusForConditionalGeneration"])
    size = load_checkpoint(pegasus.model).vocab_size - 1  # nmt's PAD row is left out
    c = model.config
    assert (c.vocab_size, c.eos_token_id, c.pad_token_id, c.decoder_start_token_id) == (
        size,
        0,
        size - 1,
        size - 1,
    )
    tokenizer = AutoTokenizer.from_pretrained(pegasus.folder)
    assert isinstance(tokenizer, MarianTokenizer) and (tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        0,
        size - 1,
    )
    # the position tables are nmt's sinusoid in transformers' layout, as Pegasus would compute it
    positions = model.model.encoder.embed_positions
    fresh = type(positions)(*positions.weight.shape)
    fresh._init_weight()
    assert torch.allclose(positions.weight, fresh.weight, atol=1e-6)

    card = (pegasus.folder / "README.md").read_text()
    assert "Pegasus" in card and "pre-LayerNorm" in card and "AutoModelForSeq2SeqLM" in card
    assert "MarianMTModel.from_pretrained" not in card and "ct2-transformers-converter" not in pegasus.output


def test_marian_mt_model_refuses_the_pegasus_folder(pegasus: Export):
    """What OPUS-MT users type by habit fails to load, rather than loading post-norm layers without the
    final norms (a model that answers ",,,,")."""
    from transformers import GenerationConfig, MarianMTModel

    with pytest.raises(RuntimeError, match="size mismatch for final_logits_bias"):
        MarianMTModel.from_pretrained(pegasus.folder)
    greedy = GenerationConfig.from_pretrained(pegasus.folder)
    greedy.update(num_beams=1, do_sample=False)
    greedy.validate(strict=True)  # no flag a greedy call ignores


def test_logits_equal_nmt(pegasus: Export):
    from transformers import PegasusForConditionalGeneration

    theirs = PegasusForConditionalGeneration.from_pretrained(pegasus.folder).eval()
    model, subword, _ = load_model(pegasus.model)
    to_hf = to_hf_ids(subword.vocab_size, theirs.config.pad_token_id)
    order = marian_order(subword.vocab_size)
    src = [ids + [EOS] for ids in subword.encode(pegasus.lines)]
    g = torch.Generator().manual_seed(1)
    tgt = [[BOS] + torch.randint(PAD + 4, subword.vocab_size, (len(s),), generator=g).tolist() for s in src]
    x = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in src], True, PAD)  # (B, S)
    y = torch.nn.utils.rnn.pad_sequence([torch.tensor(t) for t in tgt], True, PAD)  # (B, T)
    with torch.no_grad():
        got = model(x, y)[:, :, order]  # (B, T, V - 1) in the exported order
        want = theirs(input_ids=to_hf[x], attention_mask=(x != PAD).long(), decoder_input_ids=to_hf[y]).logits
    real = y != PAD
    diff = (got - want).abs()[real].max().item()
    # Two fp32 implementations of the same sums in their own orders (4 layers of width 64): a few hundred
    # units of fp32 rounding at the logits' magnitude; a misplaced weight moves them by O(1)
    bound = 256 * torch.finfo(torch.float32).eps * max(1.0, want.abs().max().item())
    assert diff < bound, (diff, bound)


def test_greedy_generate_equals_nmt_greedy_translation(pegasus: Export):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    theirs = AutoModelForSeq2SeqLM.from_pretrained(pegasus.folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(pegasus.folder)
    model, subword, cfg = load_model(pegasus.model)
    to_hf = to_hf_ids(subword.vocab_size, theirs.config.pad_token_id)
    batch = tokenizer(pegasus.lines, return_tensors="pt", padding=True)
    # the tokenizer's ids are nmt's subwords and EOS, in the exported order
    ids = [to_hf[torch.tensor(s + [EOS])].tolist() for s in subword.encode(pegasus.lines)]
    assert [row[: len(s)].tolist() for row, s in zip(batch["input_ids"], ids, strict=True)] == ids

    decode = dataclasses.replace(cfg.decode, beam=1, max_len_a=0.0, max_len_b=LIMIT)
    translator = Translator(model, subword, decode, torch.device("cpu"))
    ours = translator.translate(pegasus.lines)
    # the folder's generation config: its start token, EOS forced at the limit, the start token banned
    with torch.no_grad():
        out = theirs.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=LIMIT + 1)
    assert tokenizer.batch_decode(out, skip_special_tokens=True) == ours
    assert len(set(ours)) > len(ours) // 4  # outputs vary with the input (random weights: a few)


def test_import_reads_the_export_back_with_the_same_translations(pegasus: Export, tmp_path):
    back = tmp_path / "back.pt"
    result = runner.invoke(app, ["import", str(pegasus.folder), "-o", str(back)])
    assert result.exit_code == 0, result.output
    a, b = load_checkpoint(pegasus.model), load_checkpoint(back)
    assert b.vocab_size == a.vocab_size and b.config.model == a.config.model  # norm pre, the output bias
    assert b.config.decode == a.config.decode
    # every weight; nmt's PAD row, which the export has no place for, comes back zero with an output bias
    # of ABSENT_LOGIT, as for any imported model with an output bias
    assert a.model_state.keys() == b.model_state.keys()
    for name, weight in a.model_state.items():
        got = b.model_state[name]
        if name == "output_bias":
            assert got[PAD] == ABSENT_LOGIT
            weight, got = weight[PAD + 1 :], got[PAD + 1 :]
        assert torch.equal(weight, got), name
    translations = []
    for path in (pegasus.model, back):
        model, subword, cfg = load_model(path)
        for beam in (1, 4):
            decode = dataclasses.replace(cfg.decode, beam=beam, max_len_a=0.0, max_len_b=LIMIT)
            translations.append(
                Translator(model, subword, decode, torch.device("cpu")).translate(pegasus.lines)
            )
    assert translations[:2] == translations[2:]


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"model_type": "bart"}, ["model_type", "not a MarianMT or Pegasus model"]),
        ({"d_model": 10**9}, ["d_model"]),
        ({"activation_function": "gelu"}, ["activation_function"]),
        ({"scale_embedding": False}, ["scale_embedding"]),
    ],
)
def test_a_bad_pegasus_config_json_is_one_line(pegasus: Export, tmp_path, changes, words):
    folder = tmp_path / "hf"
    shutil.copytree(pegasus.folder, folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    result = runner.invoke(app, ["import", str(folder), "-o", str(tmp_path / "x.pt")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "config.json" in lines[0] and "Traceback" not in result.output, result.output
    assert all(word in lines[0] for word in words), lines[0]
    assert not (tmp_path / "x.pt").exists()


def test_a_pegasus_folder_without_its_final_norm_is_one_line(pegasus: Export, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf"
    shutil.copytree(pegasus.folder, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.decoder.layer_norm.weight"] = torch.ones(3)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    result = runner.invoke(app, ["import", str(folder), "-o", str(tmp_path / "x.pt")])
    assert result.exit_code == 2 and "model.decoder.layer_norm.weight" in result.stderr, result.output
    weights.pop("model.decoder.layer_norm.weight")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    result = runner.invoke(app, ["import", str(folder), "-o", str(tmp_path / "x.pt")])
    assert result.exit_code == 2 and "decoder.layer_norm.weight" in result.stderr, result.output


@pytest.mark.slow  # 4 s: CTranslate2's converter on an export
def test_ct2_transformers_converter_reads_the_pegasus_folder_exactly(pegasus: Export, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2", reason="pip install -e '.[dev]'")
    from transformers import AutoTokenizer

    from .test_marian_export import ct2_transformers_converter

    ct2_transformers_converter(pegasus.folder, tmp_path / "ct2")
    tokenizer = AutoTokenizer.from_pretrained(pegasus.folder)
    source = [tokenizer.convert_ids_to_tokens(tokenizer(line)["input_ids"]) for line in pegasus.lines]
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    results = translator.translate_batch(source, beam_size=1, max_decoding_length=LIMIT + 1)
    theirs = [tokenizer.convert_tokens_to_string(r.hypotheses[0]) for r in results]
    model, subword, cfg = load_model(pegasus.model)
    decode = dataclasses.replace(cfg.decode, beam=1, max_len_a=0.0, max_len_b=LIMIT + 1)
    assert theirs == Translator(model, subword, decode, torch.device("cpu")).translate(pegasus.lines)


def test_onnxruntime_greedy_equals_nmt(pegasus: Export):
    pytest.importorskip("onnxruntime", reason="the ONNX check needs onnxruntime: pip install -e '.[dev]'")
    optimum = pytest.importorskip("optimum.onnxruntime", reason="the ONNX export needs optimum[onnxruntime]")
    from transformers import AutoTokenizer

    model = optimum.ORTModelForSeq2SeqLM.from_pretrained(pegasus.folder, export=True)
    tokenizer = AutoTokenizer.from_pretrained(pegasus.folder)
    batch = tokenizer(pegasus.lines, return_tensors="pt", padding=True)
    out = model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=LIMIT + 1)
    ours, subword, cfg = load_model(pegasus.model)
    decode = dataclasses.replace(cfg.decode, beam=1, max_len_a=0.0, max_len_b=LIMIT)
    greedy = Translator(ours, subword, decode, torch.device("cpu")).translate(pegasus.lines)
    assert tokenizer.batch_decode(out, skip_special_tokens=True) == greedy


def test_a_shortlist_the_folder_cannot_carry_is_named(pegasus: Export, tmp_path):
    ckpt = load_checkpoint(pegasus.model)
    shortlist = {"frequent": torch.arange(4), "table": torch.zeros(ckpt.vocab_size, 2, dtype=torch.long)}
    path = tmp_path / "listed.pt"
    save_checkpoint(
        path,
        model_state=ckpt.model_state,
        config=ckpt.config,
        subword_proto=ckpt.subword_proto,
        vocab_size=ckpt.vocab_size,
        shortlist=shortlist,
    )
    out = tmp_path / "hf"
    result = runner.invoke(app, ["export", "-m", str(path), "--format", "huggingface", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "lexical shortlist" in result.output and "shortlist" not in pegasus.output
    assert (out / "model.safetensors").read_bytes() == (pegasus.folder / "model.safetensors").read_bytes()
