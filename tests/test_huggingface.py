"""MarianMT folders in and out (`nmt import`, `nmt export --format huggingface`), with transformers as
the oracle: its own classes build and train the tiny models imported here, and load what nmt exports.

Parity is asserted on what the two implementations must share: teacher-forced logits (fp32, tight
tolerance) and greedy translations token for token.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from typer.testing import CliRunner

from nmt.checkpoint import load_checkpoint, load_model
from nmt.cli import app
from nmt.formats.huggingface import ABSENT_LOGIT
from nmt.tokens import BOS, EOS, PAD
from nmt.translate import Translator

# numerics: trains or compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = pytest.mark.numerics

transformers = pytest.importorskip(
    "transformers", reason="transformers is the oracle: pip install -e '.[dev]'"
)
runner = CliRunner()

SRC_WORDS = "abcdefgh"


def source_sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(SRC_WORDS) + rng.choice(SRC_WORDS) for _ in range(rng.randint(2, 7)))


def target_of(line: str) -> str:
    """The task: each word in the target alphabet (so source and target subwords differ)."""
    return line.upper()


def train_spm(lines: list[str], prefix: Path, vocab_size: int) -> Path:
    text = prefix.with_suffix(".txt")
    text.write_text("\n".join(lines) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(prefix), vocab_size=vocab_size, model_type="unigram", minloglevel=2
    )
    return Path(f"{prefix}.model")


def marian_folder(
    directory: Path,
    activation: str,
    seed: int,
    weights: str = "safetensors",
    corpus: tuple[list[str], list[str]] | None = None,
    steps: int = 400,
) -> Path:
    """An OPUS-MT-shaped folder made by transformers itself: </s> 0, <unk> 1, pieces, <pad> last (also
    the decoder's start token), separate source and target SentencePiece models over one vocab.json, a
    non-zero final_logits_bias, trained a few dozen steps on the task so that outputs vary and end."""
    from transformers import MarianConfig, MarianMTModel

    rng = random.Random(seed)
    src = [source_sentence(rng) for _ in range(3000)]
    src, tgt = corpus or (src, [target_of(s) for s in src])
    folder = directory / f"marian-{activation}"
    folder.mkdir(parents=True)
    size = 76 if corpus is None else 400
    source_spm = train_spm(src, directory / f"src-{activation}", size)
    target_spm = train_spm(tgt, directory / f"tgt-{activation}", size)
    pieces = ["</s>", "<unk>"]
    for path in (source_spm, target_spm):
        sp = spm.SentencePieceProcessor(model_file=str(path))
        pieces += [p for p in (sp.id_to_piece(i) for i in range(sp.get_piece_size())) if p not in pieces]
    pieces = [p for p in pieces if p not in ("<s>", "<pad>")] + ["<pad>"]
    vocab = {p: i for i, p in enumerate(pieces)}
    pad = vocab["<pad>"]
    config = MarianConfig(
        vocab_size=len(pieces),
        decoder_vocab_size=len(pieces),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        max_position_embeddings=256,
        activation_function=activation,
        dropout=0.0,
        scale_embedding=True,
        pad_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
        decoder_start_token_id=pad,
    )
    torch.manual_seed(seed)
    model = MarianMTModel(config)
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.5)

    def ids(line: str, sp: spm.SentencePieceProcessor) -> list[int]:
        return [vocab.get(p, 1) for p in sp.encode(line, out_type=str)] + [0]

    sps = [spm.SentencePieceProcessor(model_file=str(p)) for p in (source_spm, target_spm)]
    pairs = [(ids(s, sps[0]), ids(t, sps[1])) for s, t in zip(src, tgt, strict=True)]
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 40))
    model.train()
    for step in range(steps):
        batch = pairs[step * 32 % (len(pairs) - 32) :][:32]
        x = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s, _ in batch], True, pad)
        y = torch.nn.utils.rnn.pad_sequence([torch.tensor(t) for _, t in batch], True, -100)
        loss = model(input_ids=x, attention_mask=(x != pad).long(), labels=y).loss
        loss.backward()
        optimizer.step()
        warmup.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(folder)
    if weights == "bin":  # the older uploads' layout, read weights-only
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "source.spm").write_bytes(source_spm.read_bytes())
    (folder / "target.spm").write_bytes(target_spm.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"source_lang": "xx", "target_lang": "yy"}))
    return folder


# slow: each builds a MarianMT model with transformers and imports it (about 11 s)
@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("swish", "safetensors"), id="swish", marks=pytest.mark.slow),
        pytest.param(("relu", "bin"), id="relu", marks=pytest.mark.slow),
    ],
)
def imported(request, tmp_path_factory, one_torch_thread):
    """(MarianMT folder, its nmt checkpoint made by `nmt import`, source lines)."""
    activation, weights = request.param
    directory = tmp_path_factory.mktemp(f"hf-{activation}")
    folder = marian_folder(directory, activation, seed=len(activation), weights=weights)
    out = directory / "imported.pt"
    result = runner.invoke(app, ["import", str(folder), "-o", str(out)])
    assert result.exit_code == 0, result.output
    rng = random.Random(99)
    return folder, out, [source_sentence(rng) for _ in range(40)]


def hf_model(folder: Path):
    from transformers import MarianMTModel

    model, info = MarianMTModel.from_pretrained(folder, output_loading_info=True)
    return model.eval(), info


def test_import_keeps_the_model_and_maps_the_vocabulary(imported):
    folder, path, _ = imported
    ckpt = load_checkpoint(path)
    hf = json.loads((folder / "config.json").read_text())
    m = ckpt.config.model
    assert (m.d_model, m.encoder_layers, m.d_ff, m.heads, m.norm) == (32, 2, 64, 4, "post")
    assert m.activation == hf["activation_function"] and m.output_bias
    assert ckpt.vocab_size == hf["vocab_size"] + 1  # the start token kept, padding a row of its own
    assert ckpt.model_state["output_bias"][PAD] == ABSENT_LOGIT
    assert ckpt.model_state["embed.weight"][PAD].abs().max() == 0
    assert (ckpt.config.data.src_lang, ckpt.config.data.tgt_lang) == ("xx", "yy")


def test_import_refuses_an_existing_output_unless_forced(imported):
    folder, out, _ = imported
    before, first = out.read_bytes(), load_checkpoint(out).model_state
    refused = runner.invoke(app, ["import", str(folder), "-o", str(out)])
    assert refused.exit_code == 2 and out.read_bytes() == before
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0] and "--force" in lines[0], refused.stderr
    forced = runner.invoke(app, ["import", str(folder), "-o", str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    again = load_checkpoint(out).model_state
    assert again.keys() == first.keys() and all(torch.equal(v, again[k]) for k, v in first.items())


def test_imported_logits_equal_transformers(imported):
    folder, path, lines = imported
    theirs, _ = hf_model(folder)
    ours, subword, _ = load_model(path)
    vocab = json.loads((folder / "vocab.json").read_text())
    pieces = subword.pieces()
    # nmt id -> MarianMT id of the same token (BOS is MarianMT's start token, its <pad>)
    to_hf = torch.tensor([vocab.get(p, vocab["<pad>"]) for p in pieces])
    to_hf[BOS] = theirs.config.decoder_start_token_id
    src = [ids + [EOS] for ids in subword.encode(lines[:8])]
    tgt = [[BOS] + ids for ids in subword.encode_target([target_of(s) for s in lines[:8]])]
    width_s, width_t = max(map(len, src)), max(map(len, tgt))
    x = torch.tensor([s + [PAD] * (width_s - len(s)) for s in src])
    y = torch.tensor([t + [PAD] * (width_t - len(t)) for t in tgt])
    with torch.no_grad():
        got = ours(x, y)[:, :, PAD + 1 :]  # (B, T, V) without the new padding column
        want = theirs(
            input_ids=to_hf[x], attention_mask=(x != PAD).long(), decoder_input_ids=to_hf[y]
        ).logits[:, :, to_hf[PAD + 1 :]]
    real = (y != PAD)[:, :, None].expand_as(got)
    diff = (got - want).abs()[real].max().item()
    # Two fp32 implementations summing in their own orders: the logits agree to a few hundred units of
    # fp32 rounding at their own magnitude (4 layers of width 32, and swish's exp on some CPUs' kernels)
    bound = 256 * torch.finfo(torch.float32).eps * max(1.0, want.abs().max().item())
    assert diff < bound, (diff, bound)
    # the new padding column takes no probability: log-softmax is unchanged too
    lp_ours = torch.log_softmax(ours(x, y), -1)[:, :, PAD + 1 :]
    lp_theirs = torch.log_softmax(want, -1)
    assert (lp_ours - lp_theirs).abs()[real].max().item() < 2 * bound


def test_imported_greedy_translations_equal_transformers(imported):
    folder, path, lines = imported
    theirs, _ = hf_model(folder)
    model, subword, cfg = load_model(path)
    decode = dataclasses.replace(cfg.decode, beam=1, max_len_a=0.0, max_len_b=30, min_len=1)
    ours = Translator(model, subword, decode, torch.device("cpu")).engine.search(subword.encode(lines))
    vocab = json.loads((folder / "vocab.json").read_text())
    hf_ids = [
        [vocab.get(p, vocab["<unk>"]) for p in spm_pieces] for spm_pieces in _source_pieces(folder, lines)
    ]
    pieces = subword.pieces()
    same = 0
    ended = 0
    for line_ids, hyp in zip(hf_ids, ours, strict=True):
        x = torch.tensor([line_ids + [theirs.config.eos_token_id]])
        out = theirs.generate(
            x, num_beams=1, do_sample=False, max_new_tokens=31, min_new_tokens=1,
            bad_words_ids=[[theirs.config.pad_token_id]],
        )[0, 1:].tolist()  # fmt: skip
        ended += out[-1] == theirs.config.eos_token_id and len(out) < 31  # ended before the limit
        text = [list(vocab)[i] for i in out if i != theirs.config.eos_token_id]
        same += text == [pieces[i] for i in hyp[0].tokens]
    assert same == len(lines), f"{same} of {len(lines)} greedy translations identical"
    assert ended >= len(lines) * 3 // 4  # most end by themselves, before the length limit
    assert len({tuple(h[0].tokens) for h in ours}) > len(lines) // 2  # outputs vary with the input


def _source_pieces(folder: Path, lines: list[str]) -> list[list[str]]:
    sp = spm.SentencePieceProcessor(model_file=str(folder / "source.spm"))
    return [sp.encode(line, out_type=str) for line in lines]


def test_imported_tokenization_equals_marian_tokenizer(imported):
    from transformers import MarianTokenizer

    folder, path, lines = imported
    tok = MarianTokenizer.from_pretrained(folder)
    _, subword, _ = load_model(path)
    pieces = subword.pieces()
    vocab = json.loads((folder / "vocab.json").read_text())
    inverse = {i: p for p, i in vocab.items()}
    for line in lines[:10] + ["zz unknown ☃ chars"]:
        theirs = [inverse[i] for i in tok(line)["input_ids"]]
        assert [pieces[i] for i in subword.encode([line])[0]] + ["</s>"] == theirs


# ---- nmt -> MarianMT ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(synthetic_run: Path, tmp_path_factory) -> Path:
    """The shared fixture's reversal model (post-norm, trained), exported through the command line."""
    out = tmp_path_factory.mktemp("hf-export") / "marian"
    model = synthetic_run / "checkpoints" / "best.pt"
    result = runner.invoke(app, ["export", "-m", str(model), "--format", "huggingface", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_export_loads_in_transformers_without_missing_or_unexpected_weights(exported: Path):
    from transformers import MarianTokenizer

    model, info = hf_model(exported)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    last = model.config.vocab_size - 1  # OPUS-MT's layout: </s> 0, the start token pads, last
    assert model.config.decoder_start_token_id == model.config.pad_token_id == last
    gen = json.loads((exported / "generation_config.json").read_text())
    assert gen["num_beams"] == 4 and "length_penalty" not in gen  # GNMT's is not transformers' formula
    tok = MarianTokenizer.from_pretrained(exported)
    assert tok.eos_token_id == 0 and tok.pad_token_id == last
    assert (exported / "model.safetensors").is_file()


def test_exported_logits_and_greedy_translations_equal_nmt(exported: Path, synthetic_run: Path):
    from nmt.formats.huggingface import marian_order

    theirs, _ = hf_model(exported)
    model, subword, cfg = load_model(synthetic_run / "checkpoints" / "best.pt")
    order = marian_order(subword.vocab_size)  # exported id j is nmt's order[j]; PAD has none
    to_hf = torch.empty(subword.vocab_size, dtype=torch.long)
    to_hf[order] = torch.arange(len(order))
    to_hf[PAD] = theirs.config.pad_token_id  # where both mask it
    lines = (synthetic_run / "data" / "valid.xx").read_text().splitlines()[:40]
    src = [ids + [EOS] for ids in subword.encode(lines)]
    width = max(map(len, src))
    x = torch.tensor([s + [PAD] * (width - len(s)) for s in src])
    tgt = [[BOS] + ids for ids in subword.encode_target([" ".join(reversed(s.split())) for s in lines])]
    y = torch.tensor([t + [PAD] * (max(map(len, tgt)) - len(t)) for t in tgt])
    with torch.no_grad():
        got = model(x, y)[:, :, order]  # (B, T, V - 1) in the exported order
        want = theirs(input_ids=to_hf[x], attention_mask=(x != PAD).long(), decoder_input_ids=to_hf[y]).logits
    assert (got - want).abs()[(y != PAD)].max().item() < 1e-4

    decode = dataclasses.replace(cfg.decode, beam=1, max_len_a=0.0, max_len_b=50)
    ours = Translator(model, subword, decode, torch.device("cpu")).engine.search(subword.encode(lines))
    with torch.no_grad():
        out = theirs.generate(to_hf[x], attention_mask=(x != PAD).long(), num_beams=1, max_new_tokens=51)
    hf = [[order[t] for t in row[1:] if t not in (theirs.config.pad_token_id, 0)] for row in out.tolist()]
    assert [h[0].tokens for h in ours] == hf
    assert len({tuple(t) for t in hf}) > len(lines) // 2


def test_export_import_round_trip_keeps_weights_and_translations(exported: Path, synthetic_run, tmp_path):
    original = synthetic_run / "checkpoints" / "best.pt"
    back = tmp_path / "back.pt"
    result = runner.invoke(app, ["import", str(exported), "-o", str(back)])
    assert result.exit_code == 0, result.output
    a, b = load_checkpoint(original), load_checkpoint(back)
    assert b.vocab_size == a.vocab_size  # OPUS-MT's layout has no PAD row: it is a new (zero) row again
    for name, weight in a.model_state.items():
        got = b.model_state[name]
        if name == "embed.weight":
            weight, got = weight[PAD + 1 :], got[PAD + 1 :]
        assert torch.equal(weight, got), name
    assert "output_bias" not in b.model_state and not b.config.model.output_bias  # as it was exported
    assert (b.config.decode, b.config.data.src_lang) == (a.config.decode, a.config.data.src_lang)
    lines = (synthetic_run / "data" / "valid.xx").read_text().splitlines()[:30]
    translations = []
    for path in (original, back):
        model, subword, cfg = load_model(path)
        translations.append(Translator(model, subword, cfg.decode, torch.device("cpu")).translate(lines))
    assert translations[0] == translations[1]


# ---- an imported model is an ordinary checkpoint --------------------------------------------------------


def test_imported_model_translates_averages_and_exports_to_ctranslate2(imported, tmp_path):
    folder, path, lines = imported
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines[:10]) + "\n")
    # fp32, as CTranslate2 runs the export below: `--dtype auto` is bf16 on a CPU with AVX512-BF16 or AMX
    # (nmt.device), and a bf16 translation is not a float32 one (on an AMD EPYC with avx512_bf16 and no
    # AMX the two engines' greedy translations of these lines differed)
    greedy = ["-i", str(source), "--beam", "1", "--dtype", "fp32"]
    result = runner.invoke(app, ["translate", "-m", str(path), *greedy])
    assert result.exit_code == 0, result.output
    translated = result.stdout.splitlines()
    assert len(translated) == 10 and any(translated)

    averaged = tmp_path / "avg.pt"
    assert runner.invoke(app, ["average", str(path), str(path), "-o", str(averaged)]).exit_code == 0
    again = runner.invoke(app, ["translate", "-m", str(averaged), *greedy])
    assert again.stdout.splitlines() == translated

    # back to the MarianMT format: transformers loads it, and importing it again changes nothing
    hf = tmp_path / "hf"
    assert (
        runner.invoke(app, ["export", "-m", str(path), "--format", "huggingface", "-o", str(hf)]).exit_code
        == 0
    )
    _, info = hf_model(hf)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    again = tmp_path / "again.pt"
    assert runner.invoke(app, ["import", str(hf), "-o", str(again)]).exit_code == 0
    first, second = load_checkpoint(path), load_checkpoint(again)
    assert first.subword_proto == second.subword_proto
    assert all(torch.equal(v, second.model_state[k]) for k, v in first.model_state.items())

    pytest.importorskip("ctranslate2")
    ct2 = tmp_path / "ct2"
    result = runner.invoke(app, ["export", "-m", str(path), "--format", "ctranslate2", "-o", str(ct2)])
    assert result.exit_code == 0, result.output
    args = ["translate", "--engine", "ctranslate2", "-m", str(ct2), "-i", str(source), "--beam", "1"]
    assert runner.invoke(app, args).stdout.splitlines() == translated


def test_import_refuses_what_nmt_cannot_represent(imported, tmp_path):
    import shutil

    folder, _, _ = imported
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    config = json.loads((broken / "config.json").read_text())
    config["activation_function"] = "gelu_new"
    (broken / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["import", str(broken), "-o", str(tmp_path / "x.pt")])
    assert result.exit_code == 2 and "activation_function" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "x.pt").exists()


# ---- fine-tuning an imported model ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multi30k
def test_init_from_an_imported_model_fine_tunes_stops_and_resumes(
    multi30k_mirror, tmp_path, one_torch_thread
):
    """Preprocess with the imported model's subwords, train from its weights: the loss falls from where
    it starts, a stopped run resumes to the same weights as one that ran through, and a recipe that
    contradicts the model is refused in one line."""
    import gzip

    import yaml

    from nmt.config import resolve_recipe

    read = lambda name: gzip.open(multi30k_mirror / name, "rt", encoding="utf-8").read().splitlines()[:3000]  # noqa: E731
    folder = marian_folder(tmp_path, "swish", 7, corpus=(read("train.en.gz"), read("train.de.gz")), steps=40)
    pretrained = tmp_path / "opus-tiny.pt"
    assert runner.invoke(app, ["import", str(folder), "-o", str(pretrained)]).exit_code == 0

    shipped = yaml.safe_load(resolve_recipe("multi30k-en-de").read_text())
    # the shipped corpora as written: augmented pairs (upper-cased, typos) in 12 steps of a model that
    # never saw them would decide whether the loss falls, and this is about fine-tuning, not them
    data = {k: v for k, v in shipped["data"].items() if k not in ("vocab_size", "augment")}
    recipe = tmp_path / "finetune.yaml"
    train = {"batch_tokens": 1024, "update_tokens": 1024, "warmup": 4, "peak_lr": 0.001, "log_every": 1}
    train.update(
        save_every=6, validate_every=1000, valid_bleu=False, max_steps=12, threads=1, precision="fp32"
    )
    recipe.write_text(yaml.safe_dump({"data": data, "train": train}))
    run, straight = tmp_path / "run", tmp_path / "straight"
    common = ["--init-from", str(pretrained), "--mirror", str(multi30k_mirror)]
    result = runner.invoke(app, ["preprocess", str(recipe), "-w", str(run), *common])
    assert result.exit_code == 0, result.output
    assert (run / "data" / "spm.model").read_bytes() == load_checkpoint(pretrained).subword_proto

    # stopped at step 6, then resumed to 12; and the same 12 steps without a stop
    init = ["--init-from", str(pretrained)]
    stopped = runner.invoke(app, ["train", str(recipe), "-w", str(run), *init, "--set", "train.max_steps=6"])
    assert stopped.exit_code == 0, stopped.output
    assert "starting from the weights of" in stopped.output
    resumed = runner.invoke(app, ["train", str(recipe), "-w", str(run), *init])
    assert resumed.exit_code == 0 and "resuming from" in resumed.output, resumed.output
    import shutil

    shutil.copytree(run / "data", straight / "data")
    through = runner.invoke(app, ["train", str(recipe), "-w", str(straight), *init])
    assert through.exit_code == 0, through.output
    a = load_checkpoint(run / "checkpoints" / "last.pt").model_state
    b = load_checkpoint(straight / "checkpoints" / "last.pt").model_state
    assert all(torch.equal(a[k], b[k]) for k in a)

    losses = [r["loss"] for r in map(json.loads, (straight / "metrics.jsonl").read_text().splitlines())
              if r.get("kind") == "train"]  # fmt: skip
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])

    # the shipped recipe's model (3 layers, d_model 256) is not this checkpoint's
    refused = runner.invoke(app, ["train", "multi30k-en-de", "-w", str(tmp_path / "x"), *init, "--dry-run"])
    assert refused.exit_code == 2
    assert "model.encoder_layers is 3" in refused.output and len(refused.output.strip().splitlines()) == 1
