"""Constrained beam search (nmt.translate.constraints): its pure parts, and the search on a real random
model, where every term must be placed exactly as often as required and avoided phrases never appear."""

import math

import pytest
import torch

from nmt.tokens import EOS
from nmt.translate.constraints import (
    Constraint,
    advance,
    allocate,
    block_phrases,
    constrained_beam_search,
    constraint_batch,
    constraint_tokens,
    phrase_groups,
)
from nmt.translate.search import beam_search

from .test_search import VOCAB, pad, random_model, random_sources, watch_logits

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_torch_thread")]


def occurrences(tokens: list[int], term: tuple[int, ...]) -> int:
    n = len(term)
    return sum(tuple(tokens[i : i + n]) == term for i in range(len(tokens) - n + 1))


def placed(tokens: list[int], constraint: Constraint) -> int:
    """How often the term appears: occurrences of any alternative that do not overlap, each ending as
    early as it can (which finds the most there are)."""
    count, free = 0, 0  # free: the first position an occurrence may start at
    for end in range(1, len(tokens) + 1):
        if any(
            end - len(a) >= free and tuple(tokens[end - len(a) : end]) == a for a in constraint.alternatives
        ):
            count, free = count + 1, end
    return count


def test_advance_places_a_term_once_and_starts_its_paths_over():
    cons = constraint_batch([[Constraint(((7, 8), (9,)))]], torch.device("cpu"))
    pos = torch.zeros(1, 2, dtype=torch.long)
    done = torch.zeros(1, 2, dtype=torch.long)
    for token, want_pos, want_placed in [(7, [1, 0], 0), (5, [0, 0], 0), (7, [1, 0], 0), (8, [0, 0], 1)]:
        pos, done = advance(pos, done, torch.tensor([token]), cons.paths, cons.path_len, cons.owner)
        assert pos.tolist() == [want_pos] and done[0, 0].item() == want_placed
    pos, done = advance(pos, done, torch.tensor([9]), cons.paths, cons.path_len, cons.owner)
    assert done[0, 0].item() == 2  # the other alternative places it again: the search forbids that token


def test_constraint_tokens_are_every_id_a_term_may_use():
    assert constraint_tokens([Constraint(((7, 8), (9, 8))), Constraint(((5,),), 2)]) == [5, 7, 8, 9]
    assert constraint_tokens([]) == []


def test_allocate_takes_the_best_of_each_bank_in_turn_most_advanced_first():
    scores = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0, -math.inf]])
    bank = torch.tensor([[0, 0, 0, 2, 1, 2]])
    assert allocate(scores, bank, 5, 2).tolist() == [[3, 4, 0, 1, 2]]


def test_block_phrases_forbids_the_token_that_would_complete_one():
    lprobs = torch.zeros(2, 10)
    history = torch.tensor([[4, 5], [5, 4]])
    out = block_phrases(lprobs, history, phrase_groups([[5, 6], [4, 5, 7], [3]], torch.device("cpu")))
    assert torch.isinf(out[0]).nonzero().squeeze(1).tolist() == [3, 6, 7]
    assert torch.isinf(out[1]).nonzero().squeeze(1).tolist() == [3]


def test_without_constraints_it_is_beam_search():
    model, sources = random_model(5), random_sources(5, 6)
    want = beam_search(model, pad(sources), 4, 0.6, 1.0, 6, nbest=2)
    got = constrained_beam_search(model, pad(sources), [[] for _ in sources], 4, 0.6, 1.0, 6, nbest=2)
    assert [[h.tokens for h in hs] for hs in got] == [[h.tokens for h in hs] for hs in want]
    # Beam search's step 0 runs one row per sentence, whose products sum in another order than the K equal
    # rows here: the scores (sums of at most 7 fp32 log-probabilities) agree to fp32 rounding
    scores = [h.score for hs in got for h in hs]
    assert scores == pytest.approx([h.score for hs in want for h in hs], rel=1e-6, abs=1e-5)


def random_constraints(seed: int, n: int) -> list[list[Constraint]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        terms = []
        for _ in range(i % 3):  # 0, 1 or 2 terms
            length = int(torch.randint(1, 4, (1,), generator=g))
            # distinct tokens: the search follows a term token by token and, on a mismatch, starts it over
            # at its first token only, which misses a term whose beginning repeats inside it
            alt = tuple((torch.randperm(VOCAB - 4, generator=g)[:length] + 4).tolist())
            # a second way to write it: another first token, as a term without its word-start marker
            other = (next(w for w in range(4, VOCAB) if w not in alt), *alt[1:])
            terms.append(Constraint((alt, other), count=1 + (i % 2)))
        out.append(terms)
    return out


def test_a_steps_logits_are_freed_before_the_next_step_projects():
    """As in beam search (tests/test_search.py): no step's (rows, V) numbers are held through the next."""
    model, sources = random_model(6), random_sources(6, 8)
    held = watch_logits(model)
    with torch.inference_mode():
        constrained_beam_search(model, pad(sources), random_constraints(6, 8), 4, 0.6, 1.0, 3)
    assert len(held) > 2


@pytest.mark.parametrize("beam", [1, 4])
def test_every_term_is_placed_exactly_as_often_as_required(beam):
    model, sources = random_model(6), random_sources(6, 8)
    constraints = random_constraints(6, 8)
    got = constrained_beam_search(model, pad(sources), constraints, beam, 0.6, 1.0, 3, nbest=1)
    for hyps, terms in zip(got, constraints, strict=True):
        assert hyps, "every term fits: the limit grows by their length"
        tokens = hyps[0].tokens
        for c in terms:
            assert placed(tokens, c) == c.count, (tokens, c)
        assert EOS not in tokens


def test_a_sentence_translates_alike_alone_and_in_a_batch():
    model, sources = random_model(8), random_sources(8, 6)
    constraints = random_constraints(8, 6)
    batched = constrained_beam_search(model, pad(sources), constraints, 3, 0.6, 1.0, 4, nbest=3)
    for src, terms, hyps in zip(sources, constraints, batched, strict=True):
        (alone,) = constrained_beam_search(model, pad([src]), [terms], 3, 0.6, 1.0, 4, nbest=3)
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], rel=1e-9)


def test_avoided_phrases_never_appear():
    model, sources = random_model(5), random_sources(5, 6)
    plain = beam_search(model, pad(sources), 4, 0.6, 1.0, 6)
    # ban the commonest bigram and unigram of the unconstrained output
    tokens = [w for hs in plain for w in hs[0].tokens]
    bigrams = [tuple(tokens[i : i + 2]) for i in range(len(tokens) - 1)]
    bigram = max(set(bigrams), key=bigrams.count)
    unigram = max(set(tokens) - set(bigram), key=tokens.count)
    avoid = [list(bigram), [unigram]]
    got = constrained_beam_search(model, pad(sources), [[] for _ in sources], 4, 0.6, 1.0, 6, avoid=avoid)
    assert any(occurrences(hs[0].tokens, bigram) for hs in plain)
    for hs in got:
        assert occurrences(hs[0].tokens, bigram) == 0 and unigram not in hs[0].tokens


def test_no_glue_token_follows_a_term():
    model, sources = random_model(6), random_sources(6, 8)
    constraints = random_constraints(6, 8)
    glue = torch.zeros(VOCAB, dtype=torch.bool)
    glue[4:14] = True  # tokens that would continue the term's last word
    got = constrained_beam_search(model, pad(sources), constraints, 4, 0.6, 1.0, 3, glue=glue)
    followed = 0
    for hyps, terms in zip(got, constraints, strict=True):
        tokens = hyps[0].tokens
        for c in terms:
            assert placed(tokens, c) == c.count
            for alt in c.alternatives:
                n = len(alt)
                for i in range(len(tokens) - n):
                    if tuple(tokens[i : i + n]) == alt:
                        followed += 1
                        assert not glue[tokens[i + n]], (tokens, alt)
    assert followed > 0


def test_a_term_without_its_word_start_never_follows_a_word():
    """A term has a form with the word-start marker ("▁V el o") and one without it, for after a hyphen or a
    quote ("V el o"). Right after a piece that ends a word, only the first may begin: the other glued
    the term to the word ("auf einemVelo"). Here every token the model writes ends a word, so the bare
    form may only open a translation; without the rule the search took it in the middle as well."""
    glued = 0
    for seed in (5, 7, 11):
        model, sources = random_model(seed), random_sources(seed, 8)
        plain = beam_search(model, pad(sources), 4, 0.6, 1.0, 3)
        for source, hyps in zip(sources, plain, strict=True):
            spare = [w for w in range(4, VOCAB) if w not in hyps[0].tokens]
            spaced, bare, rest = spare[:3]  # "▁V", "V", "el o"
            term = Constraint(((spaced, rest), (bare, rest)))
            glue = torch.zeros(VOCAB, dtype=torch.bool)
            glue[bare] = glue[rest] = True
            word_ends = torch.ones(VOCAB, dtype=torch.bool)
            word_ends[:4] = False  # PAD, UNK, BOS, EOS end nothing
            for rule in (None, word_ends):
                (got,) = constrained_beam_search(
                    model, pad([source]), [[term]], 4, 0.6, 1.0, 3, glue=glue, word_ends=rule
                )
                tokens = got[0].tokens
                assert placed(tokens, term) == 1
                inside = any(tokens[i : i + 2] == [bare, rest] for i in range(1, len(tokens) - 1))
                if rule is None:
                    glued += inside
                else:
                    assert not inside, (tokens, term)
    assert glued >= 4  # without the rule: 20 of 24 (AVX2 and AVX-512 kernels alike)


def terms_before_last_end(tokens: list[int], terms: list[Constraint], ends: torch.Tensor, limit: int) -> bool:
    """Whether every term is placed by the translation's `limit`-th sentence end (true where it has
    fewer): no term appended after the sentence ("Ein Mann fährt ein Fahrrad. Velo.")."""
    at = [i for i, w in enumerate(tokens) if ends[w]]
    if limit == 0 or len(at) < limit:
        return True
    return all(placed(tokens[: at[limit - 1] + 1], c) == c.count for c in terms)


def test_the_last_sentence_end_waits_for_the_terms():
    """A term the model would not write (a token its plain translation lacks) is placed before the
    sentence's end, not after it: with the rule no translation holds a sentence end before its term, where
    without it most of them did."""
    one = torch.tensor([1])  # each source has one sentence end
    appended = 0
    for seed in (5, 7):
        model, sources = random_model(seed), random_sources(seed, 8)
        plain = beam_search(model, pad(sources), 4, 0.6, 1.0, 3)
        union = torch.zeros(VOCAB, dtype=torch.bool)
        for source, hyps in zip(sources, plain, strict=True):
            term = next(w for w in range(4, VOCAB) if w not in hyps[0].tokens)
            terms = [Constraint(((term,),))]
            (free,) = constrained_beam_search(model, pad([source]), [terms], 4, 0.6, 1.0, 3)
            ends = torch.zeros(VOCAB, dtype=torch.bool)
            ends[sorted(set(free[0].tokens) - {term})] = True  # every other token it wrote ends a sentence
            appended += not terms_before_last_end(free[0].tokens, terms, ends, 1)
            (ruled,) = constrained_beam_search(
                model, pad([source]), [terms], 4, 0.6, 1.0, 3, ends=ends, source_ends=one
            )
            assert placed(ruled[0].tokens, terms[0]) == 1
            assert terms_before_last_end(ruled[0].tokens, terms, ends, 1), (ruled[0].tokens, term)
            union |= ends
        # batch-invariant as the search without the rule: a sentence alone and in its batch alike
        constraints = random_constraints(seed, len(sources))
        counts = torch.ones(len(sources), dtype=torch.long)
        batched = constrained_beam_search(
            model, pad(sources), constraints, 4, 0.6, 1.0, 3, ends=union, source_ends=counts
        )
        for k, (source, terms) in enumerate(zip(sources, constraints, strict=True)):
            (alone,) = constrained_beam_search(
                model, pad([source]), [terms], 4, 0.6, 1.0, 3, ends=union, source_ends=counts[:1]
            )
            assert [h.tokens for h in alone] == [h.tokens for h in batched[k]]
    assert appended >= 4  # without the rule: 13 of the 16 (AVX2 and the default kernels alike)
