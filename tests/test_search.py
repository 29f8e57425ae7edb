"""Greedy and beam search: scripted-probability fakes for exact hypotheses, and a real random model
checked against a naive reference that recomputes the whole prefix at every step."""

import functools
import math
import weakref
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt.config import ModelConfig
from nmt.model import CACHE_BLOCK, Transformer
from nmt.translate.search import (
    BOS,
    EOS,
    PAD,
    TOP_K_BLOCK,
    Sampler,
    beam_search,
    best_possible,
    greedy_search,
    length_penalty,
    max_output_lengths,
    select_live,
    step_log_probs,
    token_masks,
    top_k,
)

UNK, A, B = 1, 4, 5


# numerics: trains or compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_torch_thread")]


# ---- a decoder whose next-token probabilities are a script keyed by the prefix ----------------------


@dataclass
class FakeState:
    sentence: torch.Tensor  # (N,) which sentence each row belongs to
    prefix: torch.Tensor  # (N, t) tokens fed so far, BOS first
    max_len: int
    beam: int


class ScriptedModel:
    """Implements the incremental contract; p(w | prefix) comes from `script`, else from `default`."""

    def __init__(self, script: dict, default: dict, vocab: int = 6, max_positions: int = 64):
        self.script, self.default = script, default
        self.vocab_size, self.max_positions = vocab, max_positions
        self.steps = 0

    def encode(self, src):
        return src.double()[:, :, None], (src != PAD)[:, None, None, :]

    def init_state(self, memory, src_keep, max_len, beam=1):
        n = memory.shape[0] * beam
        return FakeState(torch.arange(n) // beam, torch.zeros(n, 0, dtype=torch.long), max_len, beam)

    def step(self, tokens, state):
        assert state.prefix.shape[1] < state.max_len, "stepped past the positions init_state allocated"
        self.steps += 1
        state.prefix = torch.cat([state.prefix, tokens[:, None]], 1)
        logits = torch.full((len(tokens), self.vocab_size), -math.inf, dtype=torch.float64)
        for row, prefix in enumerate(state.prefix.tolist()):
            assert prefix[0] == BOS
            for w, p in self.script.get(tuple(prefix[1:]), self.default).items():
                logits[row, w] = math.log(p)
        return logits, state

    def reorder_beams(self, state, rows):
        assert torch.equal(state.sentence[rows], state.sentence), "beams moved across sentences"
        state.prefix = state.prefix[rows]
        return state

    def select_rows(self, state, rows):
        sentence = state.sentence[rows].view(-1, state.beam)
        assert (sentence == sentence[:, :1]).all(), "rows of a sentence must stay together"
        return FakeState(state.sentence[rows], state.prefix[rows], state.max_len, state.beam)

    def expand_beams(self, state, beam):
        assert state.beam == 1 and state.prefix.shape[1] == 1, "widened after the first step only"
        sentence, prefix = state.sentence.repeat_interleave(beam), state.prefix.repeat_interleave(beam, 0)
        return FakeState(sentence, prefix, state.max_len, beam)


# Two ways to end: "a" (short, raw log-prob -1.0217) and "b b" (long, raw -1.0510). Without a length
# penalty the short one wins; with alpha = 1 the long one does.
FLIP = {
    (): {A: 0.45, B: 0.40, EOS: 0.05, UNK: 0.10},
    (A,): {EOS: 0.80, UNK: 0.10, A: 0.05, B: 0.05},
    (B,): {B: 0.92, EOS: 0.02, UNK: 0.03, A: 0.03},
    (B, B): {EOS: 0.95, UNK: 0.05},
}
SHORT = math.log(0.45) + math.log(0.80)
LONG = math.log(0.40) + math.log(0.92) + math.log(0.95)
OTHERWISE = {EOS: 0.6, UNK: 0.4}
SRC = torch.tensor([[7, EOS]])


def test_scripted_beam_finds_exact_hypotheses_and_scores():
    model = ScriptedModel(FLIP, OTHERWISE)
    (hyps,) = beam_search(model, SRC, beam=2, lenpen=0.0, max_len_a=1.0, max_len_b=10, nbest=2)
    assert [h.tokens for h in hyps] == [[A], [B, B]]
    assert [h.score for h in hyps] == pytest.approx([SHORT, LONG], abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(0, 3),
    blocks=st.integers(0, 40),
    tail=st.integers(0, TOP_K_BLOCK - 1),
    n=st.integers(1, 8),
    levels=st.sampled_from([2, 5, 1000, 0]),  # few distinct values: ties everywhere; 0: continuous
    seed=st.integers(0, 2**31 - 1),
)
def test_top_k_takes_exactly_torchs_top_values(rows, blocks, tail, n, levels, seed):
    """The blockwise top-k against torch.topk: the same values best first, at distinct indices that hold
    them, whatever the width (ragged tails, too few blocks), ties and -inf (masked tokens)."""
    width = max(blocks * TOP_K_BLOCK + tail, n)
    gen = torch.Generator().manual_seed(seed)
    if levels:
        x = torch.randint(0, levels, (rows, width), generator=gen).float().neg()
    else:
        x = torch.randn(rows, width, generator=gen)
    x[torch.rand(rows, width, generator=gen) < 0.3] = -math.inf
    values, indices = top_k(x, n)
    expected = x.topk(n, dim=1).values
    assert torch.equal(values, expected)
    assert torch.equal(x.gather(1, indices), values)
    for row in indices.tolist():
        assert len(set(row)) == n


def test_top_k_is_the_same_row_alone_and_in_a_batch():
    x = torch.randn(9, 4 * 8000, generator=torch.Generator().manual_seed(1)).log_softmax(1)
    values, indices = top_k(x, 8)
    for i in range(len(x)):
        one = top_k(x[i : i + 1], 8)
        assert torch.equal(one[0], values[i : i + 1]) and torch.equal(one[1], indices[i : i + 1])


@functools.cache
def scripted_step_log_probs():
    return torch.jit.script(step_log_probs)


@given(
    rows=st.integers(1, 6),
    vocab=st.integers(4, 300),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    before_min=st.booleans(),
    limits=st.sampled_from(["none", "some", "all"]),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=60, deadline=None)
def test_step_log_probs_are_log_softmax_plus_the_masks_to_the_bit(
    rows, vocab, dtype, before_min, limits, seed
):
    """A usual step sets the forbidden ids to -inf where it once added a mask of 0s and -infs: the very
    same numbers, in eager mode and in TorchScript (the scripted loops call this function), whatever
    the logits (huge, tiny, -inf, ties) and the rows at their length limit."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 30
    logits[torch.rand(rows, vocab, generator=gen) < 0.2] = -math.inf
    logits[:, 0] = 1e4  # PAD dominating: its mass still counts in the normalizer
    logits = logits.to(dtype)
    masks = token_masks(vocab, dtype, torch.device("cpu"))
    at_limit = {
        "none": None,
        "some": torch.rand(rows, generator=gen) < 0.5,
        "all": torch.ones(rows, dtype=torch.bool),
    }[limits]
    mask = masks.no_eos if before_min else masks.free
    if at_limit is not None:
        mask = torch.where(at_limit[:, None], masks.eos_only, mask)
    reference = torch.log_softmax(logits, dim=-1) + mask
    for run in (step_log_probs, scripted_step_log_probs()):
        got = run(logits.clone(), at_limit, masks, before_min)
        assert got.dtype == dtype and torch.equal(got, reference)
    assert torch.isneginf(reference[:, [PAD, BOS] + ([EOS] if before_min and at_limit is None else [])]).all()


def test_length_penalty_flips_the_ranking():
    model = ScriptedModel(FLIP, OTHERWISE)
    (hyps,) = beam_search(model, SRC, beam=2, lenpen=1.0, max_len_a=1.0, max_len_b=10, nbest=2)
    assert [h.tokens for h in hyps] == [[B, B], [A]]
    assert [h.score for h in hyps] == pytest.approx([LONG / (8 / 6), SHORT / (7 / 6)], abs=1e-12)
    # greedy commits to "a" at the first step and cannot see the better long hypothesis
    (greedy,) = greedy_search(model, SRC, 1.0, 10, lenpen=1.0)
    assert greedy.tokens == [A] and greedy.score == pytest.approx(SHORT / (7 / 6), abs=1e-12)


def test_pad_and_bos_are_never_emitted_but_unk_is():
    script = {(): {PAD: 0.5, BOS: 0.3, UNK: 0.15, EOS: 0.05}}
    model = ScriptedModel(script, {EOS: 0.6, A: 0.4})
    (greedy,) = greedy_search(model, SRC, 1.0, 10)
    assert greedy.tokens == [UNK]
    assert greedy.score == pytest.approx(math.log(0.15) + math.log(0.6))
    for beam in (1, 3):
        (hyps,) = beam_search(model, SRC, beam=beam, lenpen=0.6, max_len_a=1.0, max_len_b=10)
        assert hyps[0].tokens == [UNK]


@pytest.mark.parametrize("beam", [1, 3])
def test_max_length_is_a_times_source_length_plus_b_and_the_models_positions(beam):
    never_stop = {A: 0.5, B: 0.3, UNK: 0.2 - 1e-9, EOS: 1e-9}  # EOS never among the K best
    src = torch.tensor([[7, 7, 7, EOS], [7, EOS, PAD, PAD]])  # source lengths 3 and 1, EOS excluded
    hyps = beam_search(ScriptedModel({}, never_stop), src, beam, 0.0, max_len_a=2.0, max_len_b=1)
    assert [len(h[0].tokens) for h in hyps] == [7, 3]
    assert [len(h.tokens) for h in greedy_search(ScriptedModel({}, never_stop), src, 2.0, 1)] == [7, 3]
    # the model's positions cap it: BOS + tokens <= max_positions
    capped = ScriptedModel({}, never_stop, max_positions=5)
    assert [len(h[0].tokens) for h in beam_search(capped, src, beam, 0.0, 1.0, 50)] == [4, 4]
    assert capped.steps <= 5


def test_a_sentence_stops_once_no_live_hypothesis_can_beat_its_finished_ones():
    model = ScriptedModel({(): {EOS: 0.9, A: 0.05, B: 0.05}}, {A: 0.99, EOS: 0.01})
    (hyps,) = beam_search(model, SRC, beam=2, lenpen=0.0, max_len_a=1.0, max_len_b=10, min_len=0)
    assert hyps[0].tokens == [] and hyps[0].score == pytest.approx(math.log(0.9))
    assert model.steps == 1  # "a" or "b" start at log 0.05 and can only fall


# EOS first is by far the likeliest sequence (lp(1) = 1), as a trained model's empty translations are.
EOS_FIRST = {(): {EOS: 0.7, A: 0.2, B: 0.1}, (A,): {EOS: 0.95, A: 0.05}, (B,): {EOS: 0.95, A: 0.05}}


@pytest.mark.parametrize("beam", [1, 2, 4])
def test_min_len_forbids_an_empty_translation(beam):
    model = ScriptedModel(EOS_FIRST, {EOS: 0.5, A: 0.5})
    (empty,) = beam_search(model, SRC, beam, 0.6, 1.0, 10, min_len=0)
    assert empty[0].tokens == []  # what min_len 0 (and the old default) gives
    (hyps,) = beam_search(model, SRC, beam, 0.6, 1.0, 10, nbest=min(beam, 2))
    assert all(len(h.tokens) >= 1 for h in hyps)
    # the best non-empty hypothesis, scored as any other
    assert hyps[0].tokens == [A]
    assert hyps[0].score == pytest.approx((math.log(0.2) + math.log(0.95)) / length_penalty(2, 0.6))
    if beam > 1:
        assert hyps[1].tokens == [B]
    (greedy,) = greedy_search(model, SRC, 1.0, 10, lenpen=0.6)
    assert greedy.tokens == [A]  # greedy takes the likeliest non-EOS first token, then ends
    (longer,) = beam_search(model, SRC, beam, 0.6, 1.0, 10, min_len=3)
    assert len(longer[0].tokens) >= 3
    assert len(greedy_search(model, SRC, 1.0, 10, min_len=3)[0].tokens) >= 3


def test_the_length_limit_wins_over_min_len():
    model = ScriptedModel(EOS_FIRST, {EOS: 0.9, A: 0.1})
    src = torch.tensor([[7, EOS]])  # limit: 0 * 1 + 2 = 2 tokens
    (hyps,) = beam_search(model, src, 2, 0.6, max_len_a=0.0, max_len_b=2, min_len=5)
    assert len(hyps[0].tokens) == 2
    assert len(greedy_search(model, src, 0.0, 2, min_len=5)[0].tokens) == 2


def test_length_penalty_and_bound_formulas():
    assert length_penalty(1, 0.6) == pytest.approx((6 / 6) ** 0.6)
    assert length_penalty(10, 0.6) == pytest.approx((15 / 6) ** 0.6)
    assert length_penalty(10, 0.0) == 1.0
    max_lens = torch.tensor([9, 0])
    bound = best_possible(torch.tensor([-2.0, -2.0]), 3, max_lens, 1.0)
    assert bound.tolist() == pytest.approx([-2.0 / (15 / 6), -2.0 / (10 / 6)])  # lp(10), lp(t + 2 = 5)
    src = torch.tensor([[5, 6, 7, EOS], [5, EOS, PAD, PAD]])
    assert max_output_lengths(src, 1.5, 2, 1024).tolist() == [6, 3]
    assert max_output_lengths(src, 1.0, 50, 8).tolist() == [7, 7]


def test_select_live_skips_eos_and_keeps_order():
    scores = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    beams = torch.tensor([[0, 1, 0, 1]])
    tokens = torch.tensor([[EOS, 9, EOS, 8]])
    s, b, t = select_live(scores, beams, tokens, 2)
    assert s.tolist() == [[-2.0, -4.0]] and b.tolist() == [[1, 1]] and t.tolist() == [[9, 8]]


# ---- a real (random) model against a reference that recomputes everything -----------------------------

VOCAB = 24


def random_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64, heads=4, dropout=0.0, max_positions=40
    )
    model = Transformer(cfg, VOCAB).double().eval()
    with torch.no_grad():  # sharper distributions, and an EOS likely enough to end hypotheses early
        model.embed.weight.mul_(3.0)
        model.embed.weight[EOS] *= 1.6
    return model


def random_sources(seed: int, n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g).tolist()
    return [torch.randint(4, VOCAB, (m,), generator=g).tolist() + [EOS] for m in lengths]


def pad(rows: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), PAD)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def reference_beam(model, src: list[int], beam, alpha, a, b, nbest) -> list[tuple[list[int], float]]:
    """The same rules, one sentence, plain Python lists, `model.decode` over the whole prefix each step."""
    memory, keep = model.encode(torch.tensor([src]))
    max_len = min(math.floor(a * (len(src) - 1) + b), model.cfg.max_positions - 1)
    live, finished = [([], 0.0)], []
    for t in range(max_len + 1):
        tgt = torch.tensor([[BOS] + toks for toks, _ in live])
        n = len(live)
        logits = model.decode(tgt, memory.expand(n, -1, -1), keep.expand(n, -1, -1, -1))[:, -1]
        lprobs = torch.log_softmax(logits, -1).tolist()
        cands = []
        for i, (_, s) in enumerate(live):
            for w in range(model.vocab_size):
                if w not in (PAD, BOS) and (t < max_len or w == EOS):
                    cands.append((s + lprobs[i][w], i, w))
        cands = sorted(cands, key=lambda c: -c[0])[: 2 * beam]
        for s, i, w in cands[:beam]:
            if w == EOS:
                finished.append((live[i][0], s / length_penalty(t + 1, alpha)))
        finished = sorted(finished, key=lambda f: -f[1])[:beam]
        live = [(live[i][0] + [w], s) for s, i, w in cands if w != EOS][:beam]
        if t == max_len or len(finished) >= beam:
            break
        bound = live[0][1] / max(length_penalty(max_len + 1, alpha), length_penalty(t + 2, alpha))
        if len(finished) >= nbest and finished[nbest - 1][1] >= bound:
            break
    return finished[:nbest]


def watch_logits(model) -> list[weakref.ref]:
    """model.step made to check, at every step, that no earlier step's logits are still held, nor the
    encoder's output (the state has its keys and values); the list of those logits' references, one a
    step."""
    held: list[weakref.ref] = []
    encoded: list[weakref.ref] = []
    step, encode = model.step, model.encode

    def encode_watched(src):
        memory, src_keep = encode(src)
        encoded.append(weakref.ref(memory))
        return memory, src_keep

    def watched(tokens, state):
        assert all(ref() is None for ref in held), "the last step's logits outlived it"
        assert all(ref() is None for ref in encoded), "the encoder's output is held through the steps"
        logits, state = step(tokens, state)
        held.append(weakref.ref(logits))
        return logits, state

    model.step, model.encode = watched, encode_watched
    return held


@pytest.mark.parametrize("search", ["beam", "greedy", "sampling"])
def test_a_steps_logits_are_freed_before_the_next_step_projects(search):
    """Each step's (rows, V) logits, the largest buffer a step makes, are no longer held when the next
    step runs: its output projection is where a batch's memory peaks. Nor is the encoder's output."""
    model, src = random_model(), pad(random_sources(3))
    held = watch_logits(model)
    with torch.inference_mode():
        if search == "beam":
            beam_search(model, src, 4, 0.6, 1.0, 6)
        else:
            sampler = Sampler(generator=torch.Generator().manual_seed(0)) if search == "sampling" else None
            greedy_search(model, src, 1.0, 6, sampler=sampler)
    assert len(held) > 2


@pytest.mark.parametrize("beam, alpha", [(1, 0.6), (4, 0.6), (4, 0.0), (3, 1.5)])
def test_cached_beam_search_equals_recomputing_the_prefix(beam, alpha):
    model, sources = random_model(), random_sources(1)
    nbest = min(beam, 2)
    got = beam_search(model, pad(sources), beam, alpha, 1.0, 6, nbest=nbest)
    lengths = set()
    for src, hyps in zip(sources, got, strict=True):
        want = reference_beam(model, src, beam, alpha, 1.0, 6, nbest)
        assert [h.tokens for h in hyps] == [toks for toks, _ in want]
        assert [h.score for h in hyps] == pytest.approx([s for _, s in want], rel=1e-9)
        lengths |= {len(h.tokens) for h in hyps}
    assert len(lengths) > 1  # hypotheses ended at different steps, so sentences left the batch


def test_cached_beam_search_equals_recomputing_past_the_cache_blocks():
    """Outputs of two and more cache blocks: the cache grows while beams reorder and sentences leave."""
    model, sources = random_model(7), random_sources(7, 4)
    got = beam_search(model, pad(sources), 3, 0.6, 1.0, 2 * CACHE_BLOCK, nbest=2, min_len=0)
    for src, hyps in zip(sources, got, strict=True):
        want = reference_beam(model, src, 3, 0.6, 1.0, 2 * CACHE_BLOCK, 2)
        assert [h.tokens for h in hyps] == [toks for toks, _ in want]
        assert [h.score for h in hyps] == pytest.approx([s for _, s in want], rel=1e-9)
    assert max(len(h.tokens) for hs in got for h in hs) > 2 * CACHE_BLOCK
    assert greedy_search(model, pad(sources), 1.0, 2 * CACHE_BLOCK) == [
        h[0] for h in beam_search(model, pad(sources), 1, 0.0, 1.0, 2 * CACHE_BLOCK)
    ]


def test_beam_one_equals_greedy_exactly():
    model, src = random_model(2), pad(random_sources(2, 8))
    for alpha in (0.0, 0.6):
        greedy = greedy_search(model, src, 1.0, 8, lenpen=alpha)
        beam = [h[0] for h in beam_search(model, src, 1, alpha, 1.0, 8)]
        assert greedy == beam  # same tokens, bit-identical scores
    fp32 = random_model(2).float()
    assert greedy_search(fp32, src, 1.0, 8) == [h[0] for h in beam_search(fp32, src, 1, 0.0, 1.0, 8)]


@pytest.mark.parametrize("beam", [1, 4])
def test_a_batch_translates_like_one_sentence_at_a_time(beam):
    model, sources = random_model(3), random_sources(3, 7)
    batched = beam_search(model, pad(sources), beam, 0.6, 1.0, 6, nbest=beam)
    for src, hyps in zip(sources, batched, strict=True):
        (alone,) = beam_search(model, pad([src]), beam, 0.6, 1.0, 6, nbest=beam)
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], rel=1e-9)


@pytest.mark.parametrize("beam", [1, 4])
def test_bf16_on_the_cpu_translates_a_batch_like_one_sentence_at_a_time(beam):
    """`--dtype bf16` on the CPU: its step attention runs torch's fused kernel (nmt.model.attention), its
    products oneDNN's bf16 ones; a sentence's hypotheses and scores must be the same bits in any batch."""
    model, sources = random_model(3).to(torch.bfloat16), random_sources(3, 7)
    batched = beam_search(model, pad(sources), beam, 0.6, 1.0, 6, nbest=beam)
    assert any(len(h.tokens) > 1 for hyps in batched for h in hyps)  # searched, not ended at once
    for src, hyps in zip(sources, batched, strict=True):
        (alone,) = beam_search(model, pad([src]), beam, 0.6, 1.0, 6, nbest=beam)
        assert [(h.tokens, h.score) for h in hyps] == [(h.tokens, h.score) for h in alone]


def test_nbest_are_distinct_and_best_first():
    model, sources = random_model(4), random_sources(4, 5)
    for hyps in beam_search(model, pad(sources), 4, 0.6, 1.0, 6, nbest=4):
        assert len(hyps) == 4
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 4
        assert all(w not in (PAD, BOS, EOS) for h in hyps for w in h.tokens)
    with pytest.raises(ValueError):
        beam_search(model, pad(sources), 2, 0.6, 1.0, 6, nbest=3)


# ---- options that reshape each step: n-gram blocking, prefixes, sampling ------------------------------


def ngrams(tokens: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("beam", [1, 3])
def test_no_repeat_ngram_never_repeats_an_ngram(n, beam):
    repeats = {A: 0.55, B: 0.3, UNK: 0.1, EOS: 0.05}  # without blocking: a a a a ...
    src = torch.tensor([[7, 7, 7, 7, 7, 7, EOS]])
    (plain,) = beam_search(ScriptedModel({}, repeats), src, beam, 0.0, 1.0, 4)
    assert len(set(ngrams(plain[0].tokens, n))) < len(ngrams(plain[0].tokens, n))  # it would repeat
    (hyps,) = beam_search(ScriptedModel({}, repeats), src, beam, 0.0, 1.0, 4, nbest=beam, no_repeat_ngram=n)
    (greedy,) = greedy_search(ScriptedModel({}, repeats), src, 1.0, 4, no_repeat_ngram=n)
    for tokens in [h.tokens for h in hyps] + [greedy.tokens]:
        assert len(set(ngrams(tokens, n))) == len(ngrams(tokens, n)), tokens


@pytest.mark.parametrize("beam", [1, 4])
def test_a_prefix_is_continued_exactly_and_scored(beam):
    model = ScriptedModel({}, {A: 0.7, EOS: 0.2, B: 0.1})
    src = torch.tensor([[7, 7, EOS], [7, EOS, PAD]])
    prefix = torch.tensor([[B, B, A], [B, PAD, PAD]])  # the second sentence's prefix is shorter
    hyps = beam_search(model, src, beam, 0.0, 0.0, 1, prefix=prefix)  # limit 1 < prefix: the prefix wins
    assert hyps[0][0].tokens[:3] == [B, B, A] and hyps[1][0].tokens[:1] == [B]
    greedy = greedy_search(ScriptedModel({}, {A: 0.7, EOS: 0.2, B: 0.1}), src, 0.0, 1, prefix=prefix)
    assert greedy[0].tokens == [B, B, A] and greedy[1].tokens == [B]  # forced, then the limit's EOS
    p = {A: 0.7, EOS: 0.2, B: 0.1}
    assert greedy[1].score == pytest.approx(math.log(p[B]) + math.log(p[EOS]))


def sample_all(model, src, n, **kw):
    from nmt.translate.search import Sampler

    g = torch.Generator().manual_seed(kw.pop("seed", 0))
    return greedy_search(model, src.repeat(n, 1), 1.0, 6, sampler=Sampler(generator=g, **kw))


def test_sampling_repeats_with_a_seed_and_varies_without():
    model = ScriptedModel({}, {A: 0.4, B: 0.3, UNK: 0.2, EOS: 0.1})
    first = [h.tokens for h in sample_all(model, SRC, 30, seed=5)]
    assert first == [h.tokens for h in sample_all(model, SRC, 30, seed=5)]
    assert first != [h.tokens for h in sample_all(model, SRC, 30, seed=6)]
    assert len({tuple(t) for t in first}) > 5


def test_sampling_top_k_one_is_greedy_and_never_leaves_the_top_k():
    model, src = random_model(5), pad(random_sources(5, 6))
    assert [h.tokens for h in sample_all(model, src, 1, topk=1)] == [
        h.tokens for h in greedy_search(model, src, 1.0, 6)
    ]
    dist = {A: 0.35, B: 0.3, UNK: 0.25, EOS: 0.1}  # top-2: a, b
    for h in sample_all(ScriptedModel({}, dist), SRC, 40, topk=2, temperature=3.0):
        assert set(h.tokens) <= {A, B}
    for h in sample_all(ScriptedModel({}, dist), SRC, 40, topp=0.6):  # a + b hold 0.65 >= 0.6
        assert set(h.tokens) <= {A, B}


# ---- ensembles ------------------------------------------------------------------------------------


def test_an_ensemble_of_one_model_is_that_model():
    from nmt.translate.ensemble import Ensemble

    model, src = random_model(6), pad(random_sources(6, 5))
    alone = beam_search(model, src, 4, 0.6, 1.0, 6, nbest=2)
    together = beam_search(Ensemble([model]), src, 4, 0.6, 1.0, 6, nbest=2)
    assert [[h.tokens for h in hs] for hs in together] == [[h.tokens for h in hs] for hs in alone]
    assert [h.score for hs in together for h in hs] == pytest.approx([h.score for hs in alone for h in hs])
    assert greedy_search(Ensemble([model]), src, 1.0, 6) == greedy_search(model, src, 1.0, 6)


def test_an_ensemble_picks_what_the_averaged_distribution_says():
    from nmt.translate.ensemble import Ensemble

    # one model is sure of "a", the other mildly prefers "b": the average, 0.5 * (0.9 + 0.05) = 0.475 for
    # "a" against 0.5 * (0.05 + 0.6) = 0.325 for "b", picks "a"; the second model alone picks "b".
    first = {(): {A: 0.9, B: 0.05, EOS: 0.05}}
    second = {(): {A: 0.05, B: 0.6, EOS: 0.35}}
    then = {EOS: 0.9, UNK: 0.1}
    (alone,) = greedy_search(ScriptedModel(second, then), SRC, 1.0, 5)
    assert alone.tokens == [B]
    ensemble = Ensemble([ScriptedModel(first, then), ScriptedModel(second, then)])
    (greedy,) = greedy_search(ensemble, SRC, 1.0, 5)
    assert greedy.tokens == [A]
    assert greedy.score == pytest.approx(math.log(0.475) + math.log(0.9))
    (hyps,) = beam_search(
        Ensemble([ScriptedModel(first, then), ScriptedModel(second, then)]), SRC, 2, 0.0, 1.0, 5, 2
    )
    assert [h.tokens for h in hyps] == [[A], [B]]
    assert hyps[1].score == pytest.approx(math.log(0.325) + math.log(0.9))
