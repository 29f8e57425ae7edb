"""Lexically constrained beam search: terms a translation must contain, phrases it must not; torch only.

A constraint is one term that must appear `count` times, written any of several ways (its alternatives:
token sequences, e.g. a SentencePiece segmentation with and without the word-start marker). The search is
beam search (nmt.translate.search, whose pure parts it uses) with dynamic beam allocation (Post & Vilar,
2018) vectorized over the batch (Hu et al., 2019; fairseq's `--constraints` is the reference):

- Each hypothesis carries its progress: `pos` (how far along each alternative it is) and `placed` (how
  often each constraint has been completed). A token that continues an alternative advances it; any other
  token starts it over (at 1 if the token begins it). Completing any alternative places its constraint
  once, and starts all of that constraint's alternatives over. As in fairseq, a mismatch does not fall
  back to a shorter partial match (no failure function): a term whose beginning repeats inside it
  ("a a b" after "a a a b") can be missed, and then placed a second time.
- Candidates of a step: the 2K best extensions (as in beam search), the next token of every unfinished
  alternative of every live hypothesis, and each hypothesis's best token; duplicates removed.
- Banks: a candidate's bank is the number of constraint tokens it has met (placed constraints count their
  shortest alternative, the one in progress its position). The 2K candidates kept are taken best-first
  from each bank in turn, the most advanced bank first, so hypotheses that have placed more of the terms
  keep a share of the beam however badly they score; then, as in beam search, EOS among the first K
  finishes a hypothesis and the first K others stay live.
- EOS is forbidden until every constraint is placed; a placed constraint may not be placed again (the
  token that would complete another copy is forbidden), so every term appears exactly as often as
  required. The output limit grows by the constraints' length (their longest alternatives).
- Avoided phrases (token sequences) are never produced: a token that would complete one is forbidden, as
  n-gram blocking forbids a repeat.

A sentence whose search ends without a finished hypothesis (every hypothesis met its limit with a term
still missing) gets none: the caller decides what to do with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from nmt.tokens import EOS, PAD
from nmt.translate.search import (
    Beams,
    Decoder,
    Hypothesis,
    block_repeated_ngrams,
    expand_scores,
    force_prefix,
    live_order,
    max_output_lengths,
    score_dtype,
    step_log_probs,
    token_masks,
    top_k,
)


@dataclass(frozen=True)
class Constraint:
    """A term a translation must contain `count` times, as any one of its `alternatives` (token ids)."""

    alternatives: tuple[tuple[int, ...], ...]
    count: int = 1  # 0: a phrase banned from the translation (nmt.translate.displace)
    # the positions, in its line's source ids, of the words it translates (nmt.translate.displace); ()
    # where unknown or none (a kept span's copy, an avoid list)
    source: tuple[int, ...] = ()

    @property
    def shortest(self) -> int:
        return min(map(len, self.alternatives))

    @property
    def longest(self) -> int:
        return max(map(len, self.alternatives))


@dataclass(frozen=True)
class Terms:
    """What a batch's search must obey (nmt.translate.torch_engine.TorchEngine.search): each sentence's
    constraints, the phrases no translation may produce (token ids), and `glue` (V,) bool, the tokens that
    may not follow a term (None: any may)."""

    sentences: list[list[Constraint]]
    avoid: list[list[int]]
    glue: Tensor | None = None
    ends: Tensor | None = None  # (V,) bool: the tokens that end a sentence (".", "!", "?")
    word_ends: Tensor | None = None  # (V,) bool: the tokens that end in a letter or digit
    tags: frozenset[int] = frozenset()  # the target tags a source may begin with (nmt.languages)


def beam_needed(sentences: list[list[Constraint]]) -> int:
    """The smallest beam that keeps a row for a hypothesis that has placed none of a sentence's terms
    beside rows that have placed some: its terms (counted with their repeats) + 1, the rule the README
    states. With one row (--beam 1) only the hypothesis furthest along a term was kept, so the term came
    out first and the words before it were dropped. Counting the terms' subwords instead (Post & Vilar's
    banks) widened the beam to 11 on a test line of two five-piece terms, where the toy model of
    tests/test_serve_terminology.py then placed neither: not taken until that is understood."""
    return 1 + max((sum(c.count for c in cons) for cons in sentences), default=0)


def constraint_tokens(constraints: list[Constraint]) -> list[int]:
    """Every token id a sentence's terms may be written with, sorted: what a per-sentence vocabulary
    (a shortlist) must keep for the search to be able to place them."""
    return sorted({w for c in constraints for alt in c.alternatives for w in alt})


def renumbered(
    constraints: list[list[Constraint]], avoid: list[list[int]], masks: list[Tensor | None], numbering: Tensor
) -> tuple[list[list[Constraint]], list[list[int]], list[Tensor | None]]:
    """The constraints, avoided phrases and token masks (V,) bool (glue, sentence and word ends) of a search
    over a part of the vocabulary whose token i is vocabulary id numbering[i] (U,): a shortlist's union
    (nmt.shortlist). Every constraint token is in the part (the engine adds constraint_tokens to each
    sentence's set); a phrase with a token outside it can never be produced, so it needs no ban."""
    index = {w: i for i, w in enumerate(numbering.tolist())}
    inside = [
        [Constraint(tuple(tuple(index[w] for w in alt) for alt in c.alternatives), c.count) for c in sentence]
        for sentence in constraints
    ]
    kept = [[index[w] for w in phrase] for phrase in avoid if all(w in index for w in phrase)]
    return inside, kept, [m[numbering.to(m.device)] if m is not None else None for m in masks]


@dataclass
class ConstraintBatch:
    """The constraints of B sentences as tensors; P alternatives (paths) and C constraints per sentence,
    padded. Column C of `need` and `placed` is a sink for padding paths (need 0)."""

    paths: Tensor  # (B, P, L) each alternative's tokens, PAD-filled
    path_len: Tensor  # (B, P) its length; 0 for padding
    owner: Tensor  # (B, P) its constraint; C for padding
    need: Tensor  # (B, C + 1) placements required
    weight: Tensor  # (B, C + 1) bank tokens one placement is worth: the shortest alternative
    extra: Tensor  # (B,) tokens the output limit grows by

    def select(self, rows: Tensor) -> ConstraintBatch:
        return ConstraintBatch(*(x[rows] for x in self.__dict__.values()))

    @property
    def total(self) -> Tensor:
        """(B,) the top bank: every constraint placed."""
        return (self.need * self.weight).sum(1)


def constraint_batch(sentences: list[list[Constraint]], device: torch.device) -> ConstraintBatch:
    """Pack each sentence's constraints (any number, none included) into padded tensors."""
    b = len(sentences)
    c = max((len(s) for s in sentences), default=0)
    p = max((sum(len(x.alternatives) for x in s) for s in sentences), default=0)
    length = max((x.longest for s in sentences for x in s), default=1)
    paths = torch.full((b, max(p, 1), length), PAD, dtype=torch.long)
    path_len = torch.zeros(b, max(p, 1), dtype=torch.long)
    owner = torch.full((b, max(p, 1)), c, dtype=torch.long)
    need = torch.zeros(b, c + 1, dtype=torch.long)
    weight = torch.zeros(b, c + 1, dtype=torch.long)
    extra = torch.zeros(b, dtype=torch.long)
    for i, sentence in enumerate(sentences):
        j = 0
        for k, constraint in enumerate(sentence):
            need[i, k], weight[i, k] = constraint.count, constraint.shortest
            extra[i] += constraint.count * constraint.longest
            for alt in constraint.alternatives:
                paths[i, j, : len(alt)] = torch.tensor(alt, dtype=torch.long)
                path_len[i, j], owner[i, j] = len(alt), k
                j += 1
    fields = (paths, path_len, owner, need, weight, extra)
    return ConstraintBatch(*(x.to(device, non_blocking=True) for x in fields))


# ---- the parts, as pure functions -------------------------------------------------------------------


def next_tokens(pos: Tensor, paths: Tensor) -> Tensor:
    """The token that continues each path: (..., P) positions, (..., P, L) paths -> (..., P)."""
    return paths.gather(-1, pos.clamp(max=paths.shape[-1] - 1)[..., None]).squeeze(-1)


def advance(
    pos: Tensor,
    placed: Tensor,
    tokens: Tensor,
    paths: Tensor,
    path_len: Tensor,
    owner: Tensor,
    no_start: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The progress after emitting `tokens`: (..., P), (..., C+1), (...,) with paths (..., P, L),
    path_len and owner (..., P) -> new pos and placed.

    A token that continues a path moves it on; any other starts it over (at 1 if the token begins it,
    unless `no_start` (..., P) says the path may not begin here). A complete path places its constraint
    once, and every path of that constraint starts over.
    """
    w = tokens[..., None]  # (..., 1)
    moves, begins = next_tokens(pos, paths) == w, paths[..., 0] == w  # (..., P)
    if no_start is not None:
        moves, begins = moves & ~(no_start & (pos == 0)), begins & ~no_start
    pos = torch.where(moves, pos + 1, begins.long())  # (..., P)
    complete = (pos == path_len) & (path_len > 0)  # (..., P)
    hit = torch.zeros_like(placed).scatter_add_(-1, owner, complete.long()) > 0  # (..., C+1)
    placed = placed + hit.long()
    return pos.masked_fill(hit.gather(-1, owner), 0), placed


def banks(pos: Tensor, placed: Tensor, cons: ConstraintBatch) -> Tensor:
    """Constraint tokens met: placements (at most the required ones) times their shortest alternative,
    plus the furthest position along an alternative of a constraint still missing. (B, M, P), (B, M, C+1)
    -> (B, M), at most the sentence's total."""
    need, weight = cons.need[:, None], cons.weight[:, None]  # (B, 1, C+1)
    met = (placed.minimum(need) * weight).sum(-1)  # (B, M)
    missing = (placed < need).gather(-1, cons.owner[:, None].expand_as(pos))  # (B, M, P)
    partial = (pos * missing).amax(-1)  # (B, M)
    return (met + partial).minimum(cons.total[:, None])


def forbid_unplaced(
    lprobs: Tensor, pos: Tensor, placed: Tensor, paths: Tensor, path_len: Tensor, owner: Tensor, need: Tensor
) -> Tensor:
    """No EOS while a constraint is missing; no token completing a constraint already placed as often as
    required. (N, V), pos (N, P), placed (N, C+1), paths (N, P, L), path_len/owner (N, P), need (N, C+1)."""
    done = placed >= need  # (N, C+1)
    lprobs[:, EOS].masked_fill_(~done.all(-1), -math.inf)
    again = done.gather(1, owner) & (pos == path_len - 1) & (path_len > 0)  # (N, P)
    # PAD is forbidden already, so the rows' other paths may point there
    return lprobs.scatter_(1, torch.where(again, next_tokens(pos, paths), PAD), -math.inf)


def forbid_early_end(
    lprobs: Tensor,
    ends: Tensor,
    stops: Tensor,
    limit: Tensor,
    wanted: Tensor,
    placed: Tensor,
    need: Tensor,
) -> Tensor:
    """No sentence end that would be the translation's last (its source's `limit`-th; a source with none
    sets no limit) while a term is missing, so that a term is written inside its sentence, not appended
    after it ("Ein Mann fährt ein Fahrrad. Velo."). A token that continues a term stays allowed (a term
    may end in a period). (N, V), ends (V,) bool, stops and limit (N,) sentence ends so far and in the
    source, wanted (N, P) the token that continues each path (next_tokens), placed (N, C+1), need (N, C+1)."""
    early = (stops + 1 >= limit) & (limit > 0) & (placed < need).any(-1)  # (N,)
    kept = lprobs.gather(1, wanted)
    return lprobs.masked_fill_(early[:, None] & ends, -math.inf).scatter_(1, wanted, kept)


def block_phrases(lprobs: Tensor, history: Tensor, phrases: list[Tensor]) -> Tensor:
    """Forbid every token that would complete an avoided phrase: (N, V), (N, t), phrases grouped by
    length, each (Q, n) -> (N, V). The n-gram ban of search.block_repeated_ngrams, with given n-grams."""
    t = history.shape[1]
    for group in phrases:
        n = group.shape[1]
        if t < n - 1:
            continue
        recent = history[:, t - n + 1 :]  # (N, n-1)
        match = (recent[:, None, :] == group[None, :, :-1]).all(-1)  # (N, Q)
        hits = torch.zeros(lprobs.shape, dtype=torch.int32, device=lprobs.device)
        hits.scatter_add_(1, group[:, -1].expand(len(lprobs), -1), match.int())  # (N, V)
        lprobs = lprobs.masked_fill(hits > 0, -math.inf)
    return lprobs


def phrase_groups(phrases: list[list[int]], device: torch.device) -> list[Tensor]:
    """Avoided phrases as tensors of one length each (block_phrases' input)."""
    by_len: dict[int, list[list[int]]] = {}
    for p in phrases:
        if p:
            by_len.setdefault(len(p), []).append(p)
    return [torch.tensor(g, dtype=torch.long, device=device) for _, g in sorted(by_len.items())]


def unique(flat: Tensor, scores: Tensor) -> Tensor:
    """Scores with every repeat of a candidate (same beam and token) after its first set to -inf:
    (B, M) flat indices, (B, M) scores -> (B, M)."""
    order = flat.sort(dim=1, stable=True)
    repeat = torch.zeros_like(flat, dtype=torch.bool)
    repeat[:, 1:] = order.values[:, 1:] == order.values[:, :-1]  # (B, M) in sorted order
    return scores.masked_fill(torch.zeros_like(repeat).scatter_(1, order.indices, repeat), -math.inf)


def allocate(scores: Tensor, bank: Tensor, n: int, top: int) -> Tensor:
    """Dynamic beam allocation: indices of the n candidates kept, in the order kept: the best of each
    bank in turn, the most advanced bank first, then the second best of each, and so on. (B, M) scores
    and banks (0..top) -> (B, n). Candidates at -inf come last."""
    by_score = scores.argsort(dim=1, descending=True, stable=True)  # (B, M)
    bank = bank.gather(1, by_score)
    ranks = torch.nn.functional.one_hot(bank, top + 1).cumsum(1)  # (B, M, top+1)
    rank = ranks.gather(2, bank[..., None]).squeeze(-1) - 1  # (B, M) place within its bank
    key = rank * (top + 1) + (top - bank)  # (B, M)
    key = key.masked_fill(~torch.isfinite(scores.gather(1, by_score)), torch.iinfo(key.dtype).max)
    return by_score.gather(1, key.argsort(dim=1, stable=True)[:, :n])


# ---- the search -------------------------------------------------------------------------------------


@torch.no_grad()
def constrained_beam_search(
    model: Decoder,
    src: Tensor,
    constraints: list[list[Constraint]],
    beam: int,
    lenpen: float,
    max_len_a: float,
    max_len_b: int,
    nbest: int = 1,
    min_len: int = 1,
    no_repeat_ngram: int = 0,
    prefix: Tensor | None = None,
    avoid: list[list[int]] | None = None,
    glue: Tensor | None = None,
    ends: Tensor | None = None,
    source_ends: Tensor | None = None,
    word_ends: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Beam search (nmt.translate.search.beam_search) whose hypotheses must place each sentence's
    `constraints` and never produce an `avoid` phrase -> the `nbest` best of each sentence, best first,
    or none where no hypothesis could place them all within the limit.

    glue: (V,) bool, the tokens that continue a word (subwords without a word-start marker), forbidden
    right after a term so that a term ends a word ("Balkon", not "Balkonenen"); None: no such rule.
    ends: (V,) bool, the tokens that end a sentence, and source_ends (B,) how many each source has: the
    translation's last sentence end waits for its terms (forbid_early_end); None: no such rule.
    word_ends: (V,) bool, the tokens that end in a letter or digit: with `glue`, a term written without its
    word-start marker (a form for after a hyphen or a quote) does not begin right after one, so a term is
    never glued to the word before it ("auf einemVelo"); None: no such rule.

    src: (B, S) right-padded ids ending in EOS; prefix (B, P) forced first tokens or None. Rows of the
    state are sentence-major, as beam search's (nmt.translate.search.Beams).
    """
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest {nbest} must be between 1 and the beam size {beam}")
    k, dev, vocab = beam, src.device, model.vocab_size
    cons = constraint_batch(constraints, dev)
    blocked = phrase_groups(avoid or [], dev)
    max_lens = max_output_lengths(src, max_len_a, max_len_b, model.max_positions, prefix)  # (B,)
    max_lens = (max_lens + cons.extra).clamp(max=model.max_positions - 1)  # room for the terms
    steps = int(max_lens.max()) + 1
    memory, src_keep = model.encode(src)
    masks = token_masks(vocab, score_dtype(memory), dev)
    beams = Beams(src.shape[0], k, vocab, steps, max_lens, prefix, masks.free.dtype)
    state = model.init_state(memory, src_keep, steps, beams.width)
    del memory  # the state holds what the steps need of it (the encoder's keys and values)
    rows_of = beams.width * src.shape[0]
    n_paths = cons.paths.shape[1]
    pos = torch.zeros(rows_of, n_paths, dtype=torch.long, device=dev)  # (rows, P) progress along each path
    placed = torch.zeros(rows_of, cons.need.shape[1], dtype=torch.long, device=dev)  # (rows, C+1)
    ended = torch.zeros(rows_of, dtype=torch.bool, device=dev)  # (rows,) the last token completed a term
    bare = None  # (rows, P): the paths that begin without a word-start marker
    if glue is not None and word_ends is not None:
        bare = (glue[cons.paths[..., 0]] & (cons.path_len > 0)).repeat_interleave(beams.width, 0)
    if ends is not None:  # (rows,) each: the sentence ends written so far, and the source's
        stops = torch.zeros(rows_of, dtype=torch.long, device=dev)
        limit = source_ends.repeat_interleave(beams.width, 0)
    per_row = [
        x.repeat_interleave(beams.width, 0) for x in (cons.paths, cons.path_len, cons.owner, cons.need)
    ]
    for t in range(steps):
        # 1. one decoder step; the step's distribution masked as beam search masks it, and by the terms
        logits, state = model.step(beams.last, state)
        lprobs = step_log_probs(logits, beams.at_limit(t), masks, t < min_len)  # (rows, V)
        history = beams.seqs[:, :t]
        lprobs = block_phrases(block_repeated_ngrams(lprobs, history, no_repeat_ngram), history, blocked)
        ahead = next_tokens(pos, per_row[0])  # (rows, P): the token that continues each path
        no_start = None
        if bare is not None:  # after a word's last piece a bare path neither begins nor is offered
            no_start = bare & word_ends[beams.last][:, None]  # (rows, P)
            ahead = ahead.masked_fill(no_start & (pos == 0), PAD)
        if ends is not None:
            lprobs = forbid_early_end(lprobs, ends, stops, limit, ahead, placed, per_row[3])
        lprobs = forbid_unplaced(force_prefix(lprobs, beams.row_prefix, t), pos, placed, *per_row)
        if glue is not None:
            lprobs.masked_fill_(ended[:, None] & glue, -math.inf)
        # 2. candidates: the 2K best, every hypothesis's best, and every token that advances a term
        b, width = len(beams.alive), beams.width
        best_tokens = lprobs.argmax(1).view(b, width)  # (B, width)
        wanted = ahead.view(b, width * n_paths)  # (B, width*P)
        cand = expand_scores(beams.scores, lprobs)  # (B, width*V)
        beam_of = torch.arange(width, device=dev)
        flat = torch.cat(
            [
                top_k(cand, 2 * k)[1],
                beam_of * vocab + best_tokens,
                beam_of.repeat_interleave(n_paths) * vocab + wanted,
            ],
            1,
        )  # (B, M)
        cand_scores = unique(flat, cand.gather(1, flat))  # (B, M)
        del logits, lprobs, cand  # (rows, V) each, not held through the next step's output projection
        # 3. each candidate's progress, its bank, and the 2K kept by dynamic beam allocation
        m = flat.shape[1]
        parent = beams.rows(flat // vocab)  # (B*M,)
        cand_pos, cand_placed = advance(
            pos[parent].view(b, m, -1),
            placed[parent].view(b, m, -1),
            flat % vocab,
            cons.paths[:, None].expand(-1, m, -1, -1),
            cons.path_len[:, None].expand(-1, m, -1),
            cons.owner[:, None].expand(-1, m, -1),
            no_start[parent].view(b, m, -1) if no_start is not None else None,
        )  # (B, M, P), (B, M, C+1)
        kept = allocate(cand_scores, banks(cand_pos, cand_placed, cons), 2 * k, int(cons.total.max()))
        cand_scores, flat = cand_scores.gather(1, kept), flat.gather(1, kept)  # (B, 2K)
        # 4. EOS among the first K finishes (only hypotheses with every term placed may emit it)
        beams.finish(cand_scores, flat // vocab, flat % vocab, t, lenpen)
        # 5. the first K others stay live, with their progress
        live = live_order(flat % vocab, k)  # (B, K)
        pick = kept.gather(1, live)[..., None]  # (B, K, 1) index among the M candidates
        flat = flat.gather(1, live)
        rows = beams.extend(cand_scores.gather(1, live), flat // vocab, flat % vocab, t)
        pos = cand_pos.gather(1, pick.expand(-1, -1, cand_pos.shape[2])).view(b * k, -1)
        now_placed = cand_placed.gather(1, pick.expand(-1, -1, cand_placed.shape[2])).view(b * k, -1)
        ended = now_placed.sum(1) > placed.index_select(0, rows).sum(1)
        placed = now_placed
        if ends is not None:
            stops = stops.index_select(0, rows) + ends[(flat % vocab).view(-1)]
        if beams.widen():  # after step 0: the K beams copy their sentence's row, no reordering
            state, rows = model.expand_beams(state, k), None
            per_row = [x.repeat_interleave(k, 0) for x in per_row]
            bare = bare.repeat_interleave(k, 0) if bare is not None else None
            limit = limit.repeat_interleave(k, 0) if ends is not None else None
        # 6. finished sentences are recorded (the live bound uses the best live score: not the first)
        beams.record(beams.done(t, lenpen, nbest, beams.scores.max(1, keepdim=True).values))
        if beams.over:
            break
        # 7. the decoder state follows the beams; finished sentences leave once they are 1/COMPACT_EVERY
        if not beams.crowded:
            state = model.reorder_beams(state, rows) if rows is not None else state
            continue
        keep = beams.survivors()
        keep_rows = beams.compact(keep)
        pos, placed, ended = pos[keep_rows], placed[keep_rows], ended[keep_rows]
        if ends is not None:
            stops, limit = stops[keep_rows], limit[keep_rows]
        cons, per_row = cons.select(keep), [x[keep_rows] for x in per_row]
        bare = bare[keep_rows] if bare is not None else None
        state = model.select_rows(state, rows[keep_rows] if rows is not None else keep_rows)
    return beams.hypotheses(nbest)
