"""Lexical shortlists: IBM Model 1 learns the word pairs, `nmt shortlist` stores them in the checkpoint,
and decoding over each sentence's own set changes nothing it should not (nmt.shortlist, and its decoding in
nmt.translate.shortlist)."""

from __future__ import annotations

import dataclasses
import random
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nmt.checkpoint import load_checkpoint, load_model
from nmt.cli import app
from nmt.config import Precision
from nmt.shortlist import Shortlist, build_shortlist, load_shortlist
from nmt.tokens import BOS, EOS, PAD, UNK
from nmt.translate import Translator, ctranslate2_translator
from nmt.translate.search import length_penalty

# numerics: trains or compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_torch_thread")]
runner = CliRunner()


def cipher_pairs(
    vocab: int, n: int, seed: int = 0
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """A word-substitution cipher: each target sentence is its source's words replaced through a fixed
    permutation and shuffled, so only co-occurrence statistics say which word is which. Word 4 is in
    every sentence twice: counting co-occurrences alone pairs every word
    with the cipher of word 4, EM does not."""
    rng = random.Random(seed)
    words = list(range(4, vocab))
    image = words[:]
    rng.shuffle(image)
    perm = list(range(4)) + image  # perm[e] = f
    pairs = []
    for _ in range(n):
        src = [4, 4] + [rng.choice(words[1:]) for _ in range(rng.randint(2, 6))]
        tgt = [perm[e] for e in src]
        rng.shuffle(tgt)
        pairs.append((torch.tensor(src), torch.tensor(tgt)))
    return pairs, perm


def test_ibm_model1_learns_a_substitution_cipher():
    pairs, perm = cipher_pairs(vocab=40, n=600)
    built = build_shortlist(pairs, 40, frequent=5, per_source=2, iterations=5)
    assert built.table.shape == (40, 2)
    assert built.table[4:, 0].tolist() == perm[4:]  # every word's likeliest translation is its cipher
    assert len(built.frequent) == 5 and not set(built.frequent.tolist()) & {PAD, BOS, EOS, UNK}
    once = build_shortlist(pairs, 40, frequent=5, per_source=2, iterations=1)  # plain co-occurrence
    assert (once.table[5:, 0] == perm[4]).all(), "counting pairs every word with the frequent one"


def test_a_sentence_set_holds_its_sources_pieces_eos_unk_and_the_added_ids():
    table = torch.full((12, 2), PAD)
    table[5] = torch.tensor([7, 8])
    table[6] = torch.tensor([9, PAD])
    shortlist = Shortlist(frequent=torch.tensor([10]), table=table)
    src = torch.tensor([[5, 6, PAD], [6, PAD, PAD]])  # (B, S)
    extra = torch.tensor([[PAD], [11]])  # a prefix token for the second sentence only
    ids = shortlist.sentence_ids(src, extra)
    assert ids.tolist() == [sorted([EOS, UNK, 7, 8, 9, 10]), [*sorted([EOS, UNK, 9, 10, 11]), PAD]]


def forced_score(model, subword, line: str, text: str, lenpen: float) -> float:
    """`text`'s score as the search reports it, teacher-forced over the whole vocabulary: the sum of
    log p(y_t | y_<t, x) over its pieces and EOS, over the GNMT length penalty. The tolerance above is
    fp32's: a dozen log-probabilities summed, incremental against all positions at once."""
    src = torch.tensor([[*subword.encode([line])[0], EOS]])
    tgt = [*subword.encode_target([text])[0], EOS]
    with torch.inference_mode():
        lprobs = model.eval()(src, torch.tensor([[BOS, *tgt[:-1]]])).float().log_softmax(-1)[0]
    raw = lprobs[torch.arange(len(tgt)), torch.tensor(tgt)].sum()
    return float(raw / length_penalty(len(tgt), lenpen))


@pytest.fixture(scope="module")
def shortlisted(synthetic_run: Path, tmp_path_factory) -> dict[str, Path]:
    """The reversal model with two shortlists built by `nmt shortlist`: one holding every subword, and
    the tightest one (no frequent pieces, one per source piece: each sentence's own words)."""
    out = tmp_path_factory.mktemp("shortlist")
    model = synthetic_run / "checkpoints" / "best.pt"
    paths = {}
    for name, options in (
        ("whole", ["--frequent", "100"]),
        ("tight", ["--frequent", "0", "--per-source", "1"]),
    ):
        paths[name] = out / f"{name}.pt"
        args = ["shortlist", "-m", str(model), "--data", str(synthetic_run), "-o", str(paths[name]), *options]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    return paths


def translate(model: Path, source: Path, *options: str) -> list[str]:
    result = runner.invoke(
        app, ["translate", "-m", str(model), "-i", str(source), "--device", "cpu", *options]
    )
    assert result.exit_code == 0, result.output
    return result.stdout.split("\n")[:-1]


def test_the_shortlist_travels_in_the_checkpoint_and_loads_safely(shortlisted: dict[str, Path]):
    payload = torch.load(shortlisted["tight"], weights_only=True)["shortlist"]
    assert payload["table"].dtype == torch.int32 and payload["table"].shape[1] == 1
    tight = load_shortlist(shortlisted["tight"])
    letters = range(4, tight.vocab_size)
    assert tight.table[list(letters), 0].tolist() == list(letters)  # reversal: every word is its own pair
    assert len(load_shortlist(shortlisted["whole"]).frequent) == tight.vocab_size - 4


def test_a_shortlist_of_the_whole_vocabulary_changes_no_byte(
    shortlisted: dict[str, Path], synthetic_run: Path
):
    source = synthetic_run / "data" / "valid.xx"
    model = synthetic_run / "checkpoints" / "best.pt"
    for beam in ("1", "4"):
        assert translate(shortlisted["whole"], source, "--beam", beam, "--shortlist") == translate(
            model, source, "--beam", beam
        )


def test_greedy_output_is_unchanged_where_every_token_lies_in_the_set(
    shortlisted: dict[str, Path], synthetic_run: Path
):
    source = synthetic_run / "data" / "valid.xx"
    lines = source.read_text().splitlines()
    full = translate(synthetic_run / "checkpoints" / "best.pt", source, "--beam", "1")
    tight = translate(shortlisted["tight"], source, "--beam", "1", "--shortlist")
    inside = [
        i
        for i, (src, out) in enumerate(zip(lines, full, strict=True))
        if set(out.split()) <= set(src.split())
    ]
    assert len(inside) >= 90  # the model reverses: its words are the source's
    assert [tight[i] for i in inside] == [full[i] for i in inside]
    assert all(set(out.split()) <= set(src.split()) for src, out in zip(lines, tight, strict=True))


def test_a_sentence_decodes_the_same_alone_and_in_any_batch(
    shortlisted: dict[str, Path], synthetic_run: Path
):
    model, subword, cfg = load_model(shortlisted["tight"])
    shortlist = load_shortlist(shortlisted["tight"])
    lines = (synthetic_run / "data" / "valid.xx").read_text().splitlines()[:12]
    lines[3] = "a b c d e f g h i j k l m n o p"  # a long set beside short ones pads them
    for beam in (1, 3):
        d = dataclasses.replace(cfg.decode, beam=beam, nbest=beam, shortlist=True)
        translator = Translator(model, subword, d, torch.device("cpu"), shortlist=shortlist)
        together = translator.translate_nbest(lines)
        alone = [translator.translate_nbest([line])[0] for line in lines]
        reversed_batch = translator.translate_nbest(lines[::-1])[::-1]
        texts = [[[text for text, _ in nbest] for nbest in run] for run in (together, alone, reversed_batch)]
        assert texts[0] == texts[1] == texts[2]
        # the scores only as closely as float32 products of other shapes round alike
        scores = [torch.tensor([score for nbest in run for _, score in nbest]) for run in (together, alone)]
        torch.testing.assert_close(scores[0], scores[1], rtol=1e-5, atol=1e-5)


def test_shortlist_without_one_in_the_checkpoint_is_one_line(synthetic_run: Path):
    source = synthetic_run / "data" / "valid.xx"
    model = synthetic_run / "checkpoints" / "best.pt"
    result = runner.invoke(app, ["translate", "-m", str(model), "-i", str(source), "--shortlist"])
    assert result.exit_code == 2
    assert "carries no shortlist" in result.output and "Traceback" not in result.output


def test_serve_with_shortlist_refuses_a_checkpoint_without_one_before_listening(synthetic_run: Path):
    model = synthetic_run / "checkpoints" / "best.pt"
    result = runner.invoke(app, ["serve", "-m", str(model), "--shortlist", "--port", "0", "--device", "cpu"])
    assert result.exit_code == 2
    assert "carries no shortlist" in result.output and "Traceback" not in result.output


@pytest.mark.slow  # an nmt serve process of its own
def test_serve_with_shortlist_answers_over_each_sentences_set(shortlisted: dict[str, Path]):
    from .servers import Server, libre

    server = Server(shortlisted["tight"], "--shortlist", "--device", "cpu")
    try:
        assert server.request("/translate", libre(["a b c", "p o"])) == (
            200,
            {"translatedText": ["c b a", "o p"]},
        )
    finally:
        assert server.stop() == 0


def test_nbest_scores_say_they_are_over_the_shortlist(shortlisted: dict[str, Path], synthetic_run: Path):
    source = synthetic_run / "data" / "valid.xx"
    args = ["translate", "-m", str(shortlisted["tight"]), "-i", str(source), "--shortlist", "--nbest", "2"]
    result = runner.invoke(app, [*args, "--beam", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "over each sentence's shortlist" in result.stderr


@pytest.mark.skipif(find_spec("ctranslate2") is None, reason="ctranslate2 is not installed")
def test_the_ctranslate2_export_carries_the_shortlist_as_its_vocabulary_map(
    shortlisted: dict[str, Path], synthetic_run: Path, tmp_path: Path
):
    out = tmp_path / "ct2"
    result = runner.invoke(
        app, ["export", "-m", str(shortlisted["tight"]), "--format", "ctranslate2", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    vmap = (out / "vmap.txt").read_text(encoding="utf-8").splitlines()
    assert vmap[0] == "\t"  # no frequent pieces: the always-allowed line is empty
    assert all(source == target for source, target in (line.split("\t") for line in vmap[1:]))  # reversal
    model, subword, cfg = load_model(shortlisted["tight"])
    lines = (synthetic_run / "data" / "valid.xx").read_text().splitlines()[:20]
    d = dataclasses.replace(cfg.decode, beam=1, shortlist=True)
    ours = Translator(model, subword, d, torch.device("cpu"), shortlist=load_shortlist(shortlisted["tight"]))
    theirs = ctranslate2_translator(out, d, threads=1)
    # one sentence a call: CTranslate2 decodes a batch over the union of its sentences' sets
    assert [theirs.translate([line])[0] for line in lines] == ours.translate(lines)
    assert load_checkpoint(shortlisted["tight"]).shortlist is not None


def test_terms_decode_over_their_sentences_set_with_their_own_pieces_added(
    shortlisted: dict[str, Path], synthetic_run: Path
):
    from nmt.translate.terminology import Glossary, Terminology, entry

    model, subword, cfg = load_model(shortlisted["tight"])
    shortlist = load_shortlist(shortlisted["tight"])
    valid = (synthetic_run / "data" / "valid.xx").read_text().splitlines()
    letters = sorted({w for line in valid for w in line.split()})
    term = letters[-1]  # the target of the glossary's one entry, and in none of the lines below
    lines = [line for line in valid if term not in line.split()][:12]
    source = next(w for w in letters if sum(w in line.split() for line in lines) in range(3, 9))
    matched = [source in line.split() for line in lines]

    def translator(glossary: bool, tight: bool, beam: int = 3) -> Translator:
        d = dataclasses.replace(cfg.decode, beam=beam, nbest=1, shortlist=tight)
        terms = Terminology(subword, 64, Glossary([entry(source, term, "test[0]")])) if glossary else None
        tight_list = shortlist if tight else None
        return Translator(model, subword, d, torch.device("cpu"), shortlist=tight_list, terminology=terms)

    tight = translator(True, True).translate_nbest(lines)
    plain = translator(False, True).translate_nbest(lines)
    full = translator(True, False).translate_nbest(lines)
    for line, hit, (best,), (without,), (unlisted,) in zip(lines, matched, tight, plain, full, strict=True):
        words = best[0].split()
        if hit:  # the term, whose pieces lie outside the sentence's set, is placed; the rest keeps to the set
            assert words.count(term) == line.split().count(source) and set(words) <= {*line.split(), term}
            # over its set (with the term's pieces) each token's log-probability is at least what the whole
            # vocabulary gives it: the score the search reports is at least the same text's teacher-forced
            # score over every piece. Which text is best may differ from the unlisted search's (scores
            # renormalised over a set can rank two hypotheses either way, as the CPU's rounding trains
            # the model), so the property is asserted of the text found, not of one model's choice.
            whole = forced_score(model, subword, line, best[0], cfg.decode.lenpen)
            assert best[1] >= whole - 1e-4 * (1 + abs(whole))
            if best[0] == unlisted[0]:
                assert best[1] >= unlisted[1] - 1e-4 * (1 + abs(unlisted[1]))
        else:  # a line without the term decodes as it would without the glossary: within its set
            assert best[0] == without[0] and set(words) <= set(line.split())
    for beam in (1, 3):  # each sentence over its own set and its own terms: the same alone as in a batch
        glossed = translator(True, True, beam)
        together = [nbest[0][0] for nbest in glossed.translate_nbest(lines)]
        alone = [glossed.translate_nbest([line])[0][0][0] for line in lines]
        assert together == alone == [nbest[0][0] for nbest in glossed.translate_nbest(lines[::-1])][::-1]


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_the_cpu_kernels_project_the_union_as_they_project_the_whole_vocabulary(
    shortlisted: dict[str, Path], synthetic_run: Path, dtype: str
):
    from nmt.translate import inference_model

    model, subword, cfg = load_model(shortlisted["whole"])
    # int8, or fp32 prepacked for oneDNN
    model = inference_model(model, Precision(dtype), torch.device("cpu"))
    assert model.output_kernel is not None or dtype == "fp32"
    whole = load_shortlist(shortlisted["whole"])
    lines = (synthetic_run / "data" / "valid.xx").read_text().splitlines()[:40]
    for beam in (1, 3):
        runs = []
        for shortlist in (None, whole):
            d = dataclasses.replace(cfg.decode, beam=beam, shortlist=shortlist is not None)
            runs.append(
                Translator(model, subword, d, torch.device("cpu"), shortlist=shortlist).translate_nbest(lines)
            )
        texts = [[[text for text, _ in nbest] for nbest in run] for run in runs]
        assert texts[0] == texts[1]  # the union's rows through the model's own kernel
        # and the scores: PAD and BOS, never emitted, count in the log-softmax's normalisation with a
        # shortlist as without (a small model gives them real mass: -0.348 against -0.387 when they did
        # not); float32 sums over the same columns, so only rounding may differ
        scores = [torch.tensor([score for nbest in run for _, score in nbest]) for run in runs]
        torch.testing.assert_close(scores[1], scores[0], rtol=1e-5, atol=1e-5)


# ---- nmt shortlist's inputs checked, nmt average keeping the shortlist ----------------------------------


def one_line_error(result, *names: str) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert all(name in lines[0] for name in names), (names, lines[0])
    return lines[0]


def test_shortlist_refuses_data_of_another_subword_model_or_past_its_vocabulary(synthetic_run, tmp_path):
    import shutil

    from nmt.data.binarized import write_split

    model = synthetic_run / "checkpoints" / "best.pt"
    vocab = load_checkpoint(model).vocab_size
    other = tmp_path / "other"
    shutil.copytree(synthetic_run / "data", other / "data")
    (other / "data" / "spm.model").write_bytes(b"not the model's subwords")
    args = ["shortlist", "-m", str(model), "--data", str(other), "-o", str(tmp_path / "s.pt")]
    one_line_error(runner.invoke(app, args), "another SentencePiece model")
    # ids past the vocabulary after the first 1,000 pairs: the whole split is checked
    (other / "data" / "spm.model").write_bytes((synthetic_run / "data" / "spm.model").read_bytes())
    pairs = [[5, 6]] * 1500 + [[5, vocab]]
    write_split(other / "data" / "train", pairs, pairs, vocab)
    one_line_error(runner.invoke(app, args), "train.src.bin: ids beyond the", str(vocab))
    assert not (tmp_path / "s.pt").exists()
    idx = other / "data" / "train.src.idx"
    before = idx.read_bytes()
    one_line_error(runner.invoke(app, [*args[:-1], str(idx)]), "input")
    assert idx.read_bytes() == before


def test_shortlist_sizes_past_the_vocabulary_mean_all_of_it_and_allocate_no_more(synthetic_run, tmp_path):
    model = synthetic_run / "checkpoints" / "best.pt"
    vocab = load_checkpoint(model).vocab_size
    out = tmp_path / "s.pt"
    args = ["shortlist", "-m", str(model), "--data", str(synthetic_run), "-o", str(out)]
    result = runner.invoke(app, [*args, "--per-source", "1000000000", "--frequent", str(10**30)])
    assert result.exit_code == 0, result.output
    built = load_shortlist(out)
    assert built.table.shape[0] == vocab and built.table.shape[1] <= vocab and len(built.frequent) <= vocab
    one_line_error(runner.invoke(app, [*args, "--per-source", "0"]), "--per-source 0")
    one_line_error(runner.invoke(app, [*args, "--iterations", "100000"]), "--iterations 100000")


def test_average_keeps_a_shared_shortlist_and_says_when_it_drops_one(shortlisted, synthetic_run, tmp_path):
    plain = synthetic_run / "checkpoints" / "best.pt"
    tight, whole = shortlisted["tight"], shortlisted["whole"]
    out = tmp_path / "avg.pt"
    result = runner.invoke(app, ["average", str(tight), str(tight), "-o", str(out)])
    assert result.exit_code == 0 and "shortlist" not in result.output, result.output
    kept, want = load_shortlist(out), load_shortlist(tight)
    assert torch.equal(kept.table, want.table) and torch.equal(kept.frequent, want.frequent)
    for inputs, culprit in (([tight, whole], whole), ([tight, plain], plain), ([plain, tight], plain)):
        result = runner.invoke(app, ["average", *map(str, inputs), "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert f"dropped the shortlist: {culprit}" in result.output.replace("\n", "")
        assert load_checkpoint(out).shortlist is None
    result = runner.invoke(app, ["average", str(tight), str(tight), "--no-shortlist", "-o", str(out)])
    assert result.exit_code == 0 and "--no-shortlist" in result.output
    assert load_checkpoint(out).shortlist is None


def test_an_ensemble_hands_each_member_the_restricted_output():
    """Ensemble.init_state gives every member the shortlist's restricted output (its own projection onto
    the union, each sentence masked to its set): no member's distribution reaches outside a sentence's set."""
    from nmt.translate.ensemble import Ensemble
    from nmt.translate.search import beam_search
    from nmt.translate.shortlist import ShortlistDecoder

    from .test_search import VOCAB, pad, random_model, random_sources

    table = torch.full((VOCAB, 2), PAD)
    table[4:, 0] = torch.arange(4, VOCAB).roll(1)  # one target piece per source piece
    shortlist = Shortlist(frequent=torch.tensor([4]), table=table)
    src = pad(random_sources(3))
    decoder = ShortlistDecoder(Ensemble([random_model(0), random_model(1)]), shortlist, src)
    memory, keep = decoder.encode(src)
    assert all(state.output is not None for state in decoder.init_state(memory, keep, 8, 2))
    found = decoder.from_union(beam_search(decoder, src, 2, 0.6, 1.0, 6, nbest=2))
    for allowed, hyps in zip(shortlist.members(src), found, strict=True):
        assert hyps and all(allowed[t] for h in hyps for t in h.tokens)
