"""`nmt export --format huggingface` in OPUS-MT's layout, read by the tools written for OPUS-MT folders:
transformers, optimum's ONNX export run by onnxruntime, and CTranslate2's ct2-transformers-converter.

Both kinds of model.decoder_start are exported from the shared trained fixture: `bos` as trained, and
`zero` the same weights with the decoder starting from a zero vector (Marian's convention). Each tool's
greedy translations of the 100 validation lines must equal `nmt translate --beam 1`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from nmt.checkpoint import load_checkpoint, load_model, save_checkpoint
from nmt.cli import app
from nmt.formats.huggingface import marian_order
from nmt.tokens import BOS, PAD, UNK

# numerics: compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = pytest.mark.numerics

pytest.importorskip("transformers", reason="transformers is the oracle: pip install -e '.[dev]'")
runner = CliRunner()
KINDS = ("bos", "zero")


@dataclasses.dataclass(frozen=True)
class Export:
    kind: str  # model.decoder_start
    model: Path  # the nmt checkpoint
    folder: Path  # its MarianMT folder
    output: str  # what `nmt export` printed
    lines: list[str]  # the 100 validation lines
    greedy: list[str]  # `nmt translate --beam 1` of them


@pytest.fixture(scope="module")
def exports(synthetic_run: Path, tmp_path_factory) -> dict[str, Export]:
    """The trained fixture as a bos model, and as a zero one (same weights, model.decoder_start zero),
    each exported through the command line and translated greedily by nmt."""
    directory = tmp_path_factory.mktemp("marian-export")
    trained = synthetic_run / "checkpoints" / "best.pt"
    source = synthetic_run / "data" / "valid.xx"
    lines = source.read_text().splitlines()
    out = {}
    for kind in KINDS:
        model = directory / f"{kind}.pt"
        if kind == "bos":
            shutil.copy(trained, model)
        else:
            ckpt = load_checkpoint(trained)
            m = dataclasses.replace(ckpt.config.model, decoder_start=kind)
            save_checkpoint(
                model,
                model_state=ckpt.model_state,
                config=dataclasses.replace(ckpt.config, model=m),
                subword_proto=ckpt.subword_proto,
                vocab_size=ckpt.vocab_size,
            )
        folder = directory / f"hf-{kind}"
        result = runner.invoke(
            app, ["export", "-m", str(model), "--format", "huggingface", "-o", str(folder)]
        )
        assert result.exit_code == 0, result.output
        # fp32, as the other tools run the export (auto is bf16 on a CPU with AVX512-BF16 or AMX: nmt.device)
        fp32 = ["--dtype", "fp32"]
        translated = runner.invoke(
            app, ["translate", "-m", str(model), "-i", str(source), "--beam", "1", *fp32]
        )
        assert translated.exit_code == 0, translated.output
        greedy = translated.stdout.splitlines()
        assert len(greedy) == len(lines) == 100
        out[kind] = Export(kind, model, folder, result.output, lines, greedy)
    # the two kinds are different models: their translations differ somewhere
    assert out["bos"].greedy != out["zero"].greedy
    return out


@pytest.fixture(params=KINDS)
def exported(request, exports) -> Export:
    return exports[request.param]


def hf_greedy(model, tokenizer, lines: list[str]) -> list[str]:
    """Greedy translations by `generate` with the folder's own generation config, bar the beam."""
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, num_beams=1, do_sample=False)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def test_the_folder_has_opus_mt_layout(exported: Export):
    from transformers import MarianMTModel, MarianTokenizer

    ckpt = load_checkpoint(exported.model)
    size = ckpt.vocab_size - 1  # nmt's PAD row is left out
    model, info = MarianMTModel.from_pretrained(exported.folder, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    c = model.config
    assert (c.vocab_size, c.eos_token_id, c.pad_token_id, c.decoder_start_token_id) == (
        size,
        0,
        size - 1,
        size - 1,
    )
    vocab = json.loads((exported.folder / "vocab.json").read_text())
    pieces = load_model(exported.model).subword.pieces()
    assert sorted(vocab.values()) == list(range(size))
    assert vocab["</s>"] == 0 and vocab[pieces[UNK]] == 1 and vocab["<pad>"] == size - 1
    assert all(vocab[pieces[i]] == j for j, i in enumerate(marian_order(ckpt.vocab_size)[:-1]))
    tok = MarianTokenizer.from_pretrained(exported.folder)
    assert (tok.eos_token_id, tok.pad_token_id) == (0, size - 1)

    # the start row holds what nmt's decoder starts from; every other row (and bias) is nmt's own
    embed = ckpt.model_state["embed.weight"]
    shared = model.model.shared.weight.detach()
    start = embed[BOS] if exported.kind == "bos" else torch.zeros_like(embed[BOS])
    rows = torch.tensor(marian_order(ckpt.vocab_size))
    # the residual stream's coordinates are permuted alike in every row: compare sorted rows
    assert torch.equal(shared[-1].sort().values, start.sort().values)
    assert torch.equal(shared[:-1].sort(-1).values, embed[rows[:-1]].sort(-1).values)
    assert model.final_logits_bias.abs().max() == 0  # nmt's model has no output bias


def test_transformers_greedy_equals_nmt_without_generation_warnings(exported: Export, caplog):
    from transformers import GenerationConfig, MarianMTModel, MarianTokenizer

    GenerationConfig.from_pretrained(exported.folder).validate(strict=True)  # no flag its mode ignores
    # nor one that a greedy call ignores: generate() validates the folder's config merged with its
    # arguments, and strict turns transformers' "flags are not valid and may be ignored" into an error
    greedy_config = GenerationConfig.from_pretrained(exported.folder)
    greedy_config.update(num_beams=1, do_sample=False)
    greedy_config.validate(strict=True)
    ckpt = load_checkpoint(exported.model)
    d = ckpt.config.decode
    rule = math.floor(d.max_len_a * ckpt.config.data.max_subwords + d.max_len_b)  # nmt's, longest source
    assert greedy_config.max_length == min(rule, ckpt.config.model.max_positions - 1) + 2 < 400
    model = MarianMTModel.from_pretrained(exported.folder).eval()
    tokenizer = MarianTokenizer.from_pretrained(exported.folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = tokenizer(exported.lines[:4], return_tensors="pt", padding=True)
        with torch.no_grad():
            model.generate(**batch)  # the folder's default generation: its beam, its penalty
    assert not [str(w.message) for w in caught if "generat" in str(w.message).lower()]
    assert "length_penalty" not in caplog.text

    greedy = hf_greedy(model, tokenizer, exported.lines)
    same = sum(a == b for a, b in zip(greedy, exported.greedy, strict=True))
    assert same == len(exported.lines), f"{same} of {len(exported.lines)} greedy translations equal"
    assert len(set(greedy)) > len(greedy) // 2  # outputs vary with the input


def test_onnxruntime_greedy_equals_nmt(exported: Export):
    pytest.importorskip("onnxruntime", reason="the ONNX check needs onnxruntime: pip install -e '.[dev]'")
    optimum = pytest.importorskip("optimum.onnxruntime", reason="the ONNX export needs optimum[onnxruntime]")
    from transformers import MarianTokenizer

    model = optimum.ORTModelForSeq2SeqLM.from_pretrained(exported.folder, export=True)
    tokenizer = MarianTokenizer.from_pretrained(exported.folder)
    greedy = hf_greedy(model, tokenizer, exported.lines)
    same = sum(a == b for a, b in zip(greedy, exported.greedy, strict=True))
    assert same == len(exported.lines), f"{same} of {len(exported.lines)} greedy translations equal"


def ct2_transformers_converter(folder: Path, output: Path) -> None:
    """CTranslate2's own command-line converter, as a user runs it."""
    args = ["--model", str(folder), "--output_dir", str(output)]
    result = subprocess.run(
        [sys.executable, "-m", "ctranslate2.converters.transformers", *args], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow  # 4 s: CTranslate2's converter on an export
def test_ct2_transformers_converter_is_exact_for_a_zero_model(exports, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2", reason="pip install -e '.[dev]'")
    from transformers import MarianTokenizer

    exported = exports["zero"]
    ct2_transformers_converter(exported.folder, tmp_path / "ct2")
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    tokenizer = MarianTokenizer.from_pretrained(exported.folder)
    source = [tokenizer.convert_ids_to_tokens(tokenizer.encode(line)) for line in exported.lines]
    results = translator.translate_batch(source, beam_size=1)
    greedy = [tokenizer.convert_tokens_to_string(r.hypotheses[0]) for r in results]
    same = sum(a == b for a, b in zip(greedy, exported.greedy, strict=True))
    assert same == len(exported.lines), f"{same} of {len(exported.lines)} greedy translations equal"


def test_nmt_ctranslate2_export_of_a_zero_model_starts_from_zero(exports, tmp_path):
    pytest.importorskip("ctranslate2", reason="pip install -e '.[dev]'")
    exported = exports["zero"]
    out = tmp_path / "ct2"
    args = ["export", "-m", str(exported.model), "--format", "ctranslate2", "-o", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    source = tmp_path / "in.txt"
    source.write_text("\n".join(exported.lines) + "\n")
    args = ["translate", "--engine", "ctranslate2", "-m", str(out), "-i", str(source), "--beam", "1"]
    assert runner.invoke(app, args).stdout.splitlines() == exported.greedy


def test_a_bos_export_says_how_to_get_an_exact_ctranslate2_model(exports):
    bos, zero = exports["bos"].output, exports["zero"].output
    assert "ct2-transformers-converter" in bos and "--format ctranslate2" in bos
    assert "ct2-transformers-converter" not in zero


def test_import_reads_the_export_back_with_the_same_translations(exported: Export, tmp_path):
    back = tmp_path / "back.pt"
    result = runner.invoke(app, ["import", str(exported.folder), "-o", str(back)])
    assert result.exit_code == 0, result.output
    a, b = load_checkpoint(exported.model), load_checkpoint(back)
    assert b.vocab_size == a.vocab_size and b.config.model == a.config.model
    assert b.config.decode == a.config.decode
    # every weight comes back but the rows the export cannot hold: nmt's PAD row (OPUS-MT has no such
    # token; it is never emitted), and for a zero model BOS's, whose place holds the zero vector the
    # decoder starts from
    lost = [PAD] if exported.kind == "bos" else [PAD, BOS]
    kept = torch.tensor([i for i in range(a.vocab_size) if i not in lost])
    for name, weight in a.model_state.items():
        if name == "embed.weight":
            weight, got = weight[kept], b.model_state[name][kept]
            assert b.model_state[name][lost].abs().max() == 0
        else:
            got = b.model_state[name]
        assert torch.equal(weight, got), name
    source = tmp_path / "in.txt"
    source.write_text("\n".join(exported.lines[:30]) + "\n")
    # Beam search ranks whole hypotheses, whose scores carry the lost rows' share of each softmax: a few
    # hundredths here, where brief training leaves them more than a real model's, enough to reorder close
    # hypotheses (in bf16, `--dtype auto` on a CPU with AVX512-BF16 or AMX, 1 line of 30 changed). So the
    # beam is compared with the original holding in those rows what the export holds, where every byte
    # must come out the same, in the precision users get.
    held = tmp_path / "held.pt"
    state = {k: v.clone() for k, v in a.model_state.items()}
    state["embed.weight"][lost] = 0
    save_checkpoint(
        held, model_state=state, config=a.config, subword_proto=a.subword_proto, vocab_size=a.vocab_size
    )
    beam = [runner.invoke(app, ["translate", "-m", str(p), "-i", str(source)]) for p in (held, back)]
    assert beam[0].exit_code == 0 and beam[0].stdout == beam[1].stdout
    # Greedy search takes each step's best token, which a row's softmax sum does not move: the fixture's
    # translations of the original, in fp32 as they were made.
    greedy = runner.invoke(
        app, ["translate", "-m", str(back), "-i", str(source), "--beam", "1", "--dtype", "fp32"]
    )
    assert greedy.stdout.splitlines() == exported.greedy[:30]


# ---- the model card ------------------------------------------------------------------------------------


def card_front_matter(folder: Path) -> tuple[dict, str]:
    text = (folder / "README.md").read_text(encoding="utf-8")
    _, front, body = text.split("---\n", 2)
    return yaml.safe_load(front), body


def test_model_card_names_languages_placeholder_licence_and_recipe(exports):
    front, body = card_front_matter(exports["bos"].folder)
    assert front["language"] == ["xx", "yy"] and front["pipeline_tag"] == "translation"
    assert front["license"] == "unknown" and "--license" in body
    assert "None recorded" in body  # the fixture's run has no results.json
    recipe = yaml.safe_load(body.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert recipe["model"]["d_model"] == 64 and recipe["decode"]["beam"] == 4


def test_model_card_takes_the_licence_and_the_test_scores(exports, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    model = run / "checkpoints" / "average.pt"
    shutil.copy(exports["zero"].model, model)
    signature = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"
    results = {
        "model": "runs/x/checkpoints/average.pt",
        "decode": {"beam": 4, "lenpen": 0.6},
        "tests": {
            "test_2016_flickr": {"bleu": {"score": 35.03, "signature": signature}, "chrf": {"score": 58.49}}
        },
    }
    (run / "results.json").write_text(json.dumps(results))
    folder = tmp_path / "hf"
    args = [
        "export",
        "-m",
        str(model),
        "--format",
        "huggingface",
        "--license",
        "apache-2.0",
        "-o",
        str(folder),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    front, body = card_front_matter(folder)
    assert front["license"] == "apache-2.0" and "not set" not in body.lower()
    assert "zero vector" in body
    # GFM splits a table row at every unescaped |, inside a code span too: rendered by a GFM table parser
    # (markdown-it, which rich brings), the signature is one whole cell
    from markdown_it import MarkdownIt

    html = MarkdownIt("commonmark").enable("table").render(body)
    row = next(r for r in html.split("<tr>") if "test_2016_flickr" in r).split("</tr>")[0]
    cells = [c.split("</td>")[0] for c in row.split("<td>")[1:]]
    assert cells == ["test_2016_flickr", "35.03", "58.49", f"<code>{signature}</code>"], row
    (result,) = front["model-index"][0]["results"]
    assert front["model-index"][0]["name"] == "run" and result["dataset"]["name"] == "test_2016_flickr"
    assert {m["type"]: m["value"] for m in result["metrics"]} == {"bleu": 35.03, "chrf": 58.49}
    assert front["datasets"] and body.lstrip().startswith("# run: xx to yy translation")
    assert "## Limitations" in body


def test_model_card_says_what_the_training_data_limits(exports):
    from nmt.config import CorpusSpec, FileSpec
    from nmt.formats.model_card import model_card

    cfg = load_checkpoint(exports["bos"].model).config
    url = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/train.en.gz"
    captions = CorpusSpec("train", FileSpec(url, "0" * 64), FileSpec(url, "0" * 64))
    data = dataclasses.replace(cfg.data, train=(captions,))
    card = model_card(dataclasses.replace(cfg, data=data), Path("runs/captions/checkpoints/average.pt"))
    _, front, body = card.split("---\n", 2)
    assert yaml.safe_load(front)["datasets"] == ["train"] and "# captions: xx to yy" in body
    limits = body.split("## Limitations", 1)[1].split("##", 1)[0]
    assert "image captions" in limits and "one sentence at a time" in limits
    assert "image captions" not in model_card(cfg, exports["bos"].model)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--format", "huggingface", "--license", "Apache 2.0"], ["--license", "apache-2.0"]),
        (["--format", "ctranslate2", "--license", "mit"], ["--license", "huggingface"]),
    ],
)
def test_bad_license_is_a_one_line_error(exports, tmp_path, args, words):
    out = tmp_path / "o"
    result = runner.invoke(app, ["export", "-m", str(exports["bos"].model), *args, "-o", str(out)])
    assert result.exit_code == 2
    assert all(w in result.output for w in words) and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_decoder_start_is_bos_or_zero():
    from nmt.config import config_from_dict, config_to_dict
    from nmt.errors import NmtError

    from .synthetic import make_config

    sections = config_to_dict(make_config())
    assert sections["model"]["decoder_start"] == "bos"  # the default: checkpoints keep their meaning
    sections["model"]["decoder_start"] = "middle"
    with pytest.raises(NmtError, match="model.decoder_start: 'middle' is not one of 'bos', 'zero'"):
        config_from_dict(sections)
