"""A model of several targets through every export and import: MarianMT (post-norm) and Pegasus (pre-norm)
folders read by transformers, CTranslate2 (nmt's export and ct2-transformers-converter's), and `nmt import`
of such a folder. Each translates the same lines greedily as `nmt translate --target fr --beam 1` does.

The models are trained here for a few hundred steps on a synthetic task of two directions chosen by the
OPUS-MT tag (`>>fra<<`: the words reversed; `>>deu<<`: copied), so that their outputs vary with the line
and with the tag, and equal outputs mean that the tag reached the model where nmt puts it: first.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nmt.checkpoint import load_checkpoint
from nmt.config import Config, config_from_dict
from nmt.data.binarized import write_split
from nmt.languages import target_tag

from .conftest import cli, one_error_line
from .synthetic import LETTERS, reverse, sentence

# numerics: trains and compares numbers, so `make test` runs it again with the AVX2 kernels forced
# slow: two models trained in its fixture (about 12 s each)
pytestmark = [pytest.mark.numerics, pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

pytest.importorskip("transformers", reason="transformers is the oracle: pip install -e '.[dev]'")
TARGETS = {"fr": reverse, "de": lambda line: line}  # a target's task, by its ISO 639-1 code
TAGS = [">>fra<<", ">>deu<<"]
NORMS = ("post", "pre")  # MarianMT, Pegasus
LIMIT = 40  # output tokens before the EOS, for every line


def multi_config(norm: str) -> Config:
    """Two directions, en->fr and en->de, each corpus naming its own target (so the vocabulary reserves
    their tags); `post` starts the decoder from a zero vector, Marian's convention, so that CTranslate2's
    own converter is exact for the MarianMT folder too."""
    dummy = {"url": "http://127.0.0.1/none", "sha256": "0" * 64}
    corpora = [{"name": "synthetic", "tgt_lang": t, "src": dummy, "tgt": dummy} for t in TARGETS]
    return config_from_dict(
        {
            "data": {
                "src_lang": "en",
                "tgt_lang": "fr",
                "train": corpora,
                "valid": corpora,
                "vocab_size": len(LETTERS) + 4 + len(TAGS),
            },
            "model": {
                "encoder_layers": 1,
                "decoder_layers": 1,
                "d_model": 64,
                "d_ff": 128,
                "heads": 4,
                "dropout": 0.0,
                "max_positions": 64,
                "norm": norm,
                "decoder_start": "zero" if norm == "post" else "bos",
            },
            "train": {
                "batch_tokens": 1024,
                "update_tokens": 1024,
                "warmup": 50,
                "peak_lr": 0.003,
                "max_steps": 300,
                "cooldown": 0.3,
                "clip_norm": 1.0,
                "log_every": 50,
                "validate_every": 1000,
                "save_every": 1000,
                "valid_bleu": False,
                "threads": 1,
                "precision": "fp32",
            },
            # One absolute length limit (transformers' and CTranslate2's kind): where a model this
            # briefly trained repeats itself, every engine stops it at the same token.
            "decode": {"beam": 4, "lenpen": 0.6, "max_len_a": 0.0, "max_len_b": LIMIT},
        }
    )


def make_multi_workdir(workdir: Path, cfg: Config, n_train: int = 3000, n_valid: int = 50) -> None:
    """What `nmt preprocess` writes for the two directions: one joint word-level vocabulary whose control
    symbols are the target tags, each source after its direction's tag, the text per direction."""
    from nmt.subword import train_sentencepiece

    data = workdir / "data"
    rng = random.Random(0)
    lines = [sentence(rng) for _ in range(2000)]
    tags = ",".join(cfg.data.reserved_tags)
    assert tags == ",".join(TAGS)
    subword = train_sentencepiece(
        lines, data / "spm", cfg.data.vocab_size, model_type="word", control_symbols=tags
    )
    rng = random.Random(1)
    for split, n in (("train", n_train), ("valid", n_valid)):
        src_ids, tgt_ids = [], []
        for target, task in TARGETS.items():
            src = [sentence(rng) for _ in range(n)]
            tgt = [task(s) for s in src]
            src_ids += subword.encode(src, tag=target_tag(target))
            tgt_ids += subword.encode_target(tgt)
            if split == "valid":
                (data / f"valid.en-{target}.en").write_text("\n".join(src) + "\n")
                (data / f"valid.en-{target}.{target}").write_text("\n".join(tgt) + "\n")
        write_split(data / split, src_ids, tgt_ids, vocab_size=subword.vocab_size)


@dataclasses.dataclass(frozen=True)
class Multi:
    norm: str
    model: Path  # the trained checkpoint
    folder: Path  # its Hugging Face export (MarianMT or Pegasus)
    lines: list[str]  # English lines of the task
    greedy: dict[str, list[str]]  # `nmt translate --target T --beam 1` of them, by target


@pytest.fixture(scope="module", params=NORMS)
def multi(request, tmp_path_factory) -> Multi:
    """A model of each layout trained here (about 15 s each), its greedy translations into each target
    by the command line, and its export."""
    from nmt.train import train

    norm = request.param
    workdir = tmp_path_factory.mktemp(f"multi-{norm}")
    cfg = multi_config(norm)
    make_multi_workdir(workdir, cfg)
    model = train(cfg, workdir)
    rng = random.Random(9)
    lines = [sentence(rng) for _ in range(100)]
    source = workdir / "lines.en"
    source.write_text("\n".join(lines) + "\n")
    greedy = {}
    for target in TARGETS:
        # fp32, as the other tools run the export (auto is bf16 on a CPU with AMX: nmt.device)
        result = cli(
            "translate", "-m", model, "-i", source, "--target", target, "--beam", "1", "--dtype", "fp32"
        )
        assert result.returncode == 0, result.stderr
        greedy[target] = result.stdout.decode().splitlines()
        assert len(greedy[target]) == len(lines)
    # the tag chooses the task: the two targets' translations differ, and each varies with the line
    assert sum(a != b for a, b in zip(greedy["fr"], greedy["de"], strict=True)) > len(lines) // 2
    assert all(len(set(out)) > len(lines) // 2 for out in greedy.values())
    folder = workdir / "hf"
    result = cli("export", "-m", model, "--format", "huggingface", "-o", folder)
    assert result.returncode == 0, result.stderr
    assert "each line starts with its tag" in result.stderr.decode()  # the export says what it needs
    return Multi(norm, model, folder, lines, greedy)


def test_the_folder_carries_the_tags_as_opus_mt_multi_target_models_do(multi: Multi):
    from transformers import AutoTokenizer

    from nmt.checkpoint import load_model
    from nmt.tokens import EOS

    vocab = json.loads((multi.folder / "vocab.json").read_text())
    assert all(tag in vocab for tag in TAGS)
    tokenizer = AutoTokenizer.from_pretrained(multi.folder)
    assert tokenizer.supported_language_codes == TAGS  # MarianTokenizer's list: the codes of its vocab
    config = json.loads((multi.folder / "tokenizer_config.json").read_text())
    assert config["additional_special_tokens"] == TAGS == tokenizer.additional_special_tokens

    # `>>fra<< text` is nmt's ids: the tag, then the text's pieces, then the EOS; so is a line with space
    # before its tag, which nmt also reads as the leading tag (MarianTokenizer's own rule does not)
    _, subword, _ = load_model(multi.model)
    pieces = subword.pieces()
    for line in multi.lines[:20]:
        for target in TARGETS:
            ids = subword.encode([line], tag=target_tag(target))[0] + [EOS]
            expected = [vocab[pieces[i]] for i in ids]
            for typed in (f"{target_tag(target)} {line}", f"  {target_tag(target)}  {line}"):
                assert tokenizer(typed).input_ids == expected, typed
    assert tokenizer.decode(tokenizer(f">>fra<< {line}").input_ids, skip_special_tokens=True) == line


def test_the_model_card_lists_the_targets_and_their_tags(multi: Multi):
    text = (multi.folder / "README.md").read_text(encoding="utf-8")
    _, front, body = text.split("---\n", 2)
    assert yaml.safe_load(front)["language"] == ["en", *TARGETS]
    assert "en to fr, de translation" in body and "translating en into fr and de" in body
    section = body.split("## Target languages", 1)[1].split("##", 1)[0]
    assert "| fr | `>>fra<<` |" in section and "| de | `>>deu<<` |" in section
    assert 'tokenizer([">>fra<< A sentence to translate."]' in body


def test_transformers_greedy_equals_nmt_for_each_target(multi: Multi):
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(multi.folder).eval()
    assert type(model).__name__ == (
        "MarianMTModel" if multi.norm == "post" else "PegasusForConditionalGeneration"
    )
    tokenizer = AutoTokenizer.from_pretrained(multi.folder)
    for target in TARGETS:
        batch = tokenizer(
            [f"{target_tag(target)} {line}" for line in multi.lines], return_tensors="pt", padding=True
        )
        with torch.no_grad():
            out = model.generate(**batch, num_beams=1, do_sample=False)
        greedy = tokenizer.batch_decode(out, skip_special_tokens=True)
        same = sum(a == b for a, b in zip(greedy, multi.greedy[target], strict=True))
        assert same == len(multi.lines), f"--target {target}: {same} of {len(multi.lines)} equal"


def translate(model: Path, source: Path, *args: str) -> subprocess.CompletedProcess:
    """Greedy, in fp32 (float32 for CTranslate2): the precision `multi.greedy` and the other tools have."""
    return cli("translate", "-m", model, "-i", source, "--beam", "1", "--dtype", "fp32", *args)


def test_ctranslate2_export_translates_each_target_as_the_torch_engine(multi: Multi, tmp_path):
    pytest.importorskip("ctranslate2", reason="pip install -e '.[dev]'")
    out = tmp_path / "ct2"
    assert cli("export", "-m", multi.model, "--format", "ctranslate2", "-o", out).returncode == 0
    assert json.loads((out / "nmt.json").read_text())["sources"] == ["en"]
    source = tmp_path / "in.en"
    source.write_text("\n".join(multi.lines) + "\n")
    for target in TARGETS:
        result = translate(out, source, "--engine", "ctranslate2", "--target", target)
        assert result.returncode == 0, result.stderr
        assert result.stdout.decode().splitlines() == multi.greedy[target]
    result = translate(out, source, "--engine", "ctranslate2", "--target", "cs")
    assert result.returncode == 2
    one_error_line(result.stderr, "--target cs", "fr, de")
    meta = json.loads((out / "nmt.json").read_text())
    (out / "nmt.json").write_text(json.dumps(meta | {"sources": "en"}))  # a hand-edited record
    result = translate(out, source, "--engine", "ctranslate2", "--target", "fr")
    assert result.returncode == 2
    one_error_line(result.stderr, "nmt.json", "sources")


@pytest.mark.slow  # CTranslate2's own converter in a subprocess
def test_ct2_transformers_converter_translates_each_target_as_nmt(multi: Multi, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2", reason="pip install -e '.[dev]'")
    from transformers import AutoTokenizer

    args = ["--model", str(multi.folder), "--output_dir", str(tmp_path / "ct2")]
    result = subprocess.run(
        [sys.executable, "-m", "ctranslate2.converters.transformers", *args], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    tokenizer = AutoTokenizer.from_pretrained(multi.folder)
    for target in TARGETS:
        lines = [f"{target_tag(target)} {line}" for line in multi.lines]
        source = [tokenizer.convert_ids_to_tokens(tokenizer.encode(line)) for line in lines]
        assert all(tokens[0] == target_tag(target) for tokens in source)
        results = translator.translate_batch(source, beam_size=1, max_decoding_length=LIMIT)
        greedy = [tokenizer.convert_tokens_to_string(r.hypotheses[0]) for r in results]
        same = sum(a == b for a, b in zip(greedy, multi.greedy[target], strict=True))
        assert same == len(multi.lines), f"--target {target}: {same} of {len(multi.lines)} equal"


def test_import_of_the_folder_keeps_its_targets(multi: Multi, tmp_path):
    """As an OPUS-MT folder: without the record nmt's export adds, only the files transformers reads."""
    folder = tmp_path / "opus-mt"
    folder.mkdir()
    for path in multi.folder.iterdir():
        if path.name != "nmt.json":
            (folder / path.name).write_bytes(path.read_bytes())
    back = tmp_path / "back.pt"
    result = cli("import", folder, "-o", back)
    assert result.returncode == 0, result.stderr
    assert load_checkpoint(back).config.data.train == ()
    limit = ("--max-len-a", "0", "--max-len-b", str(LIMIT))  # an OPUS-MT folder records none of nmt's
    source = tmp_path / "in.en"
    source.write_text("\n".join(multi.lines) + "\n")
    for target in TARGETS:
        result = translate(back, source, "--target", target, *limit)
        assert result.returncode == 0, result.stderr
        assert result.stdout.decode().splitlines() == multi.greedy[target]
    tagged = tmp_path / "tagged.en"  # a leading tag, as OPUS-MT clients send, instead of --target
    chosen = [list(TARGETS)[i % len(TARGETS)] for i in range(len(multi.lines))]  # fr, de, fr, ...
    tagged.write_text(
        "".join(f"{target_tag(t)} {line}\n" for line, t in zip(multi.lines, chosen, strict=True))
    )
    result = translate(back, tagged, *limit)
    expected = [multi.greedy[t][i] for i, t in enumerate(chosen)]
    assert result.returncode == 0 and result.stdout.decode().splitlines() == expected
    result = translate(back, source, "--target", "cs")
    assert result.returncode == 2
    one_error_line(result.stderr, "--target cs", "fr, de")


hypothesis = pytest.importorskip(
    "hypothesis", reason="hypothesis is a dev dependency: pip install -e '.[dev]'"
)
st = hypothesis.strategies


@hypothesis.given(
    text=st.text(alphabet=st.sampled_from(LETTERS + "xyz AÉé.,!?-'<>0123"), max_size=40),
    spaces=st.sampled_from(["", " ", "  "]),
)
def test_a_tagged_line_of_any_text_has_nmt_ids(multi: Multi, text: str, spaces: str):
    """Whatever the text after the tag (typed `>`, `<`, spaces, letters the vocabulary lacks), the
    exported tokenizer gives the ids nmt translates."""
    from nmt.tokens import EOS

    hypothesis.assume(not any(tag in text for tag in TAGS))  # mid-line: text to nmt, a tag to transformers
    tokenizer, vocab, subword = exported_tokenizer(multi)
    pieces = subword.pieces()
    ids = subword.encode([f"{spaces}>>fra<< {text}"])[0] + [EOS]
    assert tokenizer(f"{spaces}>>fra<< {text}").input_ids == [vocab[pieces[i]] for i in ids]


_tokenizers: dict[Path, tuple] = {}


def exported_tokenizer(multi: Multi) -> tuple:
    """(the folder's tokenizer, its vocab.json, nmt's subword model), loaded once per folder."""
    if multi.folder not in _tokenizers:
        from transformers import AutoTokenizer

        from nmt.checkpoint import load_model

        vocab = json.loads((multi.folder / "vocab.json").read_text())
        _tokenizers[multi.folder] = (
            AutoTokenizer.from_pretrained(multi.folder),
            vocab,
            load_model(multi.model)[1],
        )
    return _tokenizers[multi.folder]


def test_model_index_names_each_direction_of_the_results():
    from nmt.formats.model_card import model_index

    score = {"bleu": {"score": 30.0}, "chrf": {"score": 55.0}}
    tests = {"test_2016_flickr en-fr": score | {"direction": "en-fr"}, "test_2016_flickr": score}
    entries = model_index("run", "en", "de", {"tests": tests})[0]["results"]
    assert [e["task"]["name"] for e in entries] == ["Translation en-fr", "Translation en-de"]
