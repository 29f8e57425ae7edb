"""Greedy and beam search over the decoder's incremental contract; torch only, no files, no vocabulary.

The model is used through the `Decoder` contract below and nothing else: a Transformer (nmt.model) or an
ensemble of them (nmt.translate.ensemble) alike. Both searches are one batched loop over target
positions with numbered steps; the parts of a beam step are the small pure functions above them.

Conventions. A hypothesis's score is the sum of its token log-probabilities, EOS included, divided by the
GNMT length penalty lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al., 2016, eq. 14), |Y| counting the EOS; the
paper decodes with beam 4 and alpha 0.6 (section 6.1). A sentence may emit at most
floor(a * |x| + b) tokens before its EOS (|x| the source length without EOS; paper: a=1, b=50), and never
more than the model's positions allow; at that limit EOS is the only choice. Before `min_len` tokens EOS is
forbidden (fairseq's --min-len; default 1, so a real sentence never gets an empty translation: an EOS
first has lp = 1 and would otherwise beat every longer hypothesis); where the length limit is shorter,
the limit wins. PAD and BOS are never emitted; UNK is. Log-softmax runs in at least float32, whatever the
model's dtype.

Beam bookkeeping follows fairseq: each step takes the 2K best one-token extensions of a sentence's K live
hypotheses (2K, so K live ones remain even when K of them end in EOS); an EOS among the K best finishes a
hypothesis, the K best others stay live. A sentence stops, and leaves the batch, when
  (a) K hypotheses have finished (fairseq's rule; with K=1 this makes beam search exactly greedy search), or
  (b) its nbest-th finished score already beats the best score any live hypothesis could still reach
      (`best_possible`: with log-probs <= 0 a live raw score can only fall, so its normalized score is at
      most raw / lp at the length where lp is largest), which stops early without changing the n-best, or
  (c) it reaches its length limit, where every live hypothesis is forced to finish.
Rule (a) can stop while a live hypothesis could still, in principle, overtake the finished ones under a
positive alpha; Sockeye and fairseq accept this too, and it keeps beam 1 identical to greedy.

The parts a loop calls at every step (step_log_probs, top_k, finalize, select_live, sentence_done, ...)
are also TorchScript functions: a model's loops in TorchScript (nmt.translate.scripted) call the very same
code. So they take tensors, ints and floats, and reserved ids as arguments with defaults (TorchScript reads
no global number).

Options that reshape each step's distribution, the same in both searches (fairseq's names):
- `no_repeat_ngram`: a token that would complete an n-gram already in the hypothesis is forbidden.
- `prefix`: forced first tokens per sentence (B, P), PAD-filled; the translation continues them. Their
  log-probs count in the score (it is the probability of the whole output), and the length limit is at
  least the prefix's length.
- Sampling (greedy's loop with `sampler`): the next token is drawn from the step's distribution, sharpened
  or flattened by a temperature and cut to the top-k tokens or the smallest set holding top-p of the
  mass; the score is the model's own log-probability of what was drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from nmt.tokens import BOS, EOS, PAD

# Finished sentences stay in the batch, frozen, until they are 1/COMPACT_EVERY of it: dropping them copies the
# whole decoder state, which costs more than a few wasted rows per step.
COMPACT_EVERY = 4


class Memory(Protocol):
    """The encoder's output as search sees it: only its dtype, which the scores are computed in."""

    @property
    def dtype(self) -> torch.dtype: ...


class Decoder(Protocol):
    """All that search may ask of a model: its sizes, and the incremental decoding calls. The state is
    the model's own, explicit, and opaque here."""

    @property
    def vocab_size(self) -> int:
        """V: the width of step's logits."""
        ...

    @property
    def max_positions(self) -> int:
        """Decoder positions: BOS and the tokens of a translation never exceed them."""
        ...

    def encode(self, src: Tensor) -> tuple[Memory, Any]:
        """(B, S) source ids, each row ending in EOS, right-padded -> (memory, src_keep)."""
        ...

    def init_state(
        self, memory: Memory, src_keep: Any, max_len: int, beam: int = 1, output: Any = None
    ) -> Any:
        """A state of `beam` rows per sentence, sentence-major, for up to `max_len` steps. `output`: what
        restricts the step's logits to each sentence's own target ids (nmt.translate.shortlist); the
        search never passes one, a decoder over a shortlist does."""
        ...

    def step(self, tokens: Tensor, state: Any) -> tuple[Tensor, Any]:
        """(N,) last tokens -> (N, V) logits of the next position, and the state one position on."""
        ...

    def reorder_beams(self, state: Any, rows: Tensor) -> Any:
        """Row i takes the history of row rows[i], a row of the same sentence: (N,) -> state."""
        ...

    def select_rows(self, state: Any, rows: Tensor) -> Any:
        """Keep only `rows` (whole sentences, each one's beam rows together; any order within one)."""
        ...

    def expand_beams(self, state: Any, beam: int) -> Any:
        """A state of one row per sentence -> `beam` rows per sentence, each a copy of its sentence's row."""
        ...

    # Optional: greedy_loop(state, max_lens, min_len, lenpen, masks) -> (tokens (B, T), scores (B,)) or None,
    # greedy_search's plain loop from init_state's state in one call (nmt.model.Transformer.greedy_loop);
    # beam_loop(state, beam, max_lens, min_len, lenpen, nbest, masks) -> (scores (B, K), tokens (B, K, T))
    # or None, beam_search's (nmt.model.Transformer.beam_loop)


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS/EOS
    score: float  # sum of token log-probs (incl. EOS) divided by the length penalty


# ---- the parts, as pure functions -------------------------------------------------------------------


def length_penalty(length: int, alpha: float) -> float:
    """GNMT lp(Y) = ((5 + |Y|) / 6)^alpha, |Y| the hypothesis length counting its EOS."""
    return ((5 + length) / 6) ** alpha


def length_penalties(lengths: Tensor, alpha: float) -> Tensor:
    """length_penalty of each of the lengths (B,), in their (floating) dtype."""
    return ((5 + lengths) / 6) ** alpha


def output_limits(
    src_len: Tensor, a: float, b: int, max_positions: int, prefix_len: Tensor | None = None
) -> Tensor:
    """Tokens allowed before the EOS: floor(a * |x| + b), |x| the source length without EOS: (B,) -> (B,).

    At least the length of a forced prefix; capped at max_positions - 1 so that BOS + tokens, the
    decoder's inputs, fit its positions.
    """
    limit = (a * src_len + b).floor().long()
    if prefix_len is not None:
        limit = torch.maximum(limit, prefix_len)
    return limit.clamp(0, max_positions - 1)


def max_output_lengths(
    src: Tensor, a: float, b: int, max_positions: int, prefix: Tensor | None = None
) -> Tensor:
    """`output_limits` of a batch: (B, S) right-padded ids ending in EOS, (B, P) prefixes or None -> (B,)."""
    prefix_len = (prefix != PAD).sum(1) if prefix is not None else None
    return output_limits((src != PAD).sum(1) - 1, a, b, max_positions, prefix_len)


def score_dtype(memory: Tensor) -> torch.dtype:
    """Scores in float32 even when the model runs in bf16/fp16 (float64 stays float64)."""
    return torch.promote_types(memory.dtype, torch.float32)


class TokenMasks(NamedTuple):  # a NamedTuple, which TorchScript takes as an argument
    """Which tokens a step may emit, built once per search: additive masks (V,), and the ids a usual
    step forbids, which it sets to -inf in place of adding a mask that is 0 everywhere else."""

    free: Tensor  # forbids PAD and BOS
    no_eos: Tensor  # forbids PAD, BOS and EOS: before min_len
    eos_only: Tensor  # forbids everything but EOS: at the length limit
    banned: Tensor  # (2,) the ids `free` forbids
    banned_no_eos: Tensor  # (3,) the ids `no_eos` forbids


def token_masks(vocab: int, dtype: torch.dtype, device: torch.device) -> TokenMasks:
    banned = torch.tensor([PAD, BOS], device=device)
    banned_no_eos = torch.tensor([PAD, BOS, EOS], device=device)
    free = torch.zeros(vocab, dtype=dtype, device=device)
    free[banned] = -math.inf
    no_eos = torch.zeros(vocab, dtype=dtype, device=device)
    no_eos[banned_no_eos] = -math.inf
    eos_only = torch.full((vocab,), -math.inf, dtype=dtype, device=device)
    eos_only[EOS] = 0.0
    return TokenMasks(free, no_eos, eos_only, banned, banned_no_eos)


def step_log_probs(logits: Tensor, at_limit: Tensor | None, masks: TokenMasks, before_min: bool) -> Tensor:
    """log p(w | y_<t, x) = log_softmax(logits) in the masks' dtype, masked: (N, V), (N,) bool -> (N, V).

    Rows at their length limit may only emit EOS; before min_len no row may emit EOS; no row may emit
    PAD or BOS. `at_limit` None: no row is at its limit (the usual step, one pass less over (N, V)).
    The logits are the step's own: they are overwritten, which saves an (N, V) buffer each step.
    A usual step sets its 2 or 3 forbidden ids to -inf: the numbers that adding its mask gives (x + 0 is
    x), without that pass over (N, V), 0.7% of a file's fp32 decoding time and 1.4% of its int8 (the demo
    model at its default budget, one thread; benchmarks/RESULTS.md, 2026-12-04 02:40).
    """
    logits = logits.to(masks.free.dtype)
    lprobs = torch.log_softmax(logits, dim=-1, out=logits)
    if at_limit is None:
        return lprobs.index_fill_(1, masks.banned_no_eos if before_min else masks.banned, -math.inf)
    mask = masks.no_eos if before_min else masks.free  # (V,)
    return lprobs + torch.where(at_limit[:, None], masks.eos_only, mask)


def block_repeated_ngrams(lprobs: Tensor, history: Tensor, n: int) -> Tensor:
    """Forbid every token that would complete an n-gram already in `history`: (N, V), (N, t) -> (N, V).

    The n-grams of the history whose first n-1 tokens equal its last n-1 tokens name the banned tokens.
    """
    t = history.shape[1]
    if n <= 0 or t < n:
        return lprobs
    windows = history.unfold(1, n, 1)  # (N, t-n+1, n) every n-gram so far
    recent = history[:, t - n + 1 :]  # (N, n-1)
    match = (windows[:, :, :-1] == recent[:, None, :]).all(-1)  # (N, t-n+1)
    hits = torch.zeros(lprobs.shape, dtype=torch.int32, device=lprobs.device)
    hits.scatter_add_(1, windows[:, :, -1], match.int())  # (N, V) how often each token would repeat one
    return lprobs.masked_fill(hits > 0, -math.inf)


def force_prefix(lprobs: Tensor, prefix: Tensor | None, t: int) -> Tensor:
    """Rows whose prefix has a token at position t may emit only that token: (N, V), (N, P) -> (N, V)."""
    if prefix is None or t >= prefix.shape[1]:
        return lprobs
    forced = prefix[:, t]  # (N,) PAD where a row's prefix is shorter
    others = F.one_hot(forced, lprobs.shape[1]) == 0  # (N, V)
    return lprobs.masked_fill(others & (forced != PAD)[:, None], -math.inf)


@dataclass(frozen=True)
class Sampler:
    """Draws the next token instead of taking the best: temperature, then top-k and top-p cuts."""

    topk: int = 0  # 0: no cut
    topp: float = 1.0  # 1.0: no cut
    temperature: float = 1.0
    generator: torch.Generator | None = None

    def __call__(self, lprobs: Tensor) -> tuple[Tensor, Tensor]:
        """(N, V) log-probs -> the drawn tokens' log-probs and the tokens, each (N,)."""
        logits = lprobs / self.temperature
        if self.topk > 0:
            top = logits.topk(min(self.topk, logits.shape[1]), dim=1)  # (N, k)
            logits = torch.full_like(logits, -math.inf).scatter_(1, top.indices, top.values)
        if self.topp < 1.0:
            probs, order = logits.softmax(dim=1).sort(dim=1, descending=True)  # (N, V)
            # keep the smallest set whose mass reaches topp: a token stays if the mass before it is short
            outside = (probs.cumsum(dim=1) - probs) >= self.topp
            # The likeliest token always stays: compared with fp32 mass, a topp below fp32's least
            # number (1e-300) is 0, which would leave no token at all to draw from.
            outside[:, 0] = False
            logits = logits.masked_fill(outside.scatter(1, order, outside), -math.inf)
        tokens = torch.multinomial(logits.softmax(dim=1), 1, generator=self.generator).squeeze(1)
        return lprobs.gather(1, tokens[:, None]).squeeze(1), tokens


def expand_scores(scores: Tensor, lprobs: Tensor) -> Tensor:
    """score(y_1..t w) = score(y_1..t) + log p(w | y_1..t, x): (B, K) and (B*K, V) -> (B, K*V).

    Written into `lprobs`, which the step no longer needs.
    """
    b, k = scores.shape
    return lprobs.view(b, k, -1).add_(scores[:, :, None]).view(b, -1)  # (B, K, V) -> (B, K*V)


# top_k's blocks on the CPU: 128 and 256 were the fastest of 32 to 512 (benchmarks/RESULTS.md, 2026-11-27)
TOP_K_BLOCK = 128


def top_k(x: Tensor, n: int, block: int = TOP_K_BLOCK) -> tuple[Tensor, Tensor]:
    """x.topk(n, dim=1) over a beam step's candidates: (B, W) -> values, indices (B, n), best first.

    torch's CPU top-k took 60 us a row of 32,000 (2 ns an element; the demo model at beam 4): 11% of a
    file's int8 decoding. On the CPU the row is read in blocks of TOP_K_BLOCK instead, and the top n
    looked for only among the n blocks with the largest maxima (and the ragged tail): 3-4x faster at
    32,000, 9x at the base model's 148,000. It is exact. Every element above the n-th largest value v
    lies in a block whose maximum exceeds v, and fewer than n blocks do, so all of them are taken; the
    slots left go to blocks whose maximum is v itself, each of which holds a v, which is as many as the
    ties need. So the values are topk's to the bit; where values tie at the n-th, which of the tied
    elements is taken may differ from torch's, whose choice is unspecified as well. Each row is on its own,
    so a sentence's candidates do not depend on its batch."""
    b, width = x.shape
    blocks = width // block
    if x.device.type != "cpu" or blocks <= 2 * n:
        return x.topk(n, dim=1)
    main = blocks * block
    tiled = x[:, :main].reshape(b, blocks, block)  # a view wherever rows are contiguous
    chosen = tiled.amax(dim=2).topk(n, dim=1).indices  # (B, n) the blocks that hold the top n
    pool = tiled.gather(1, chosen[:, :, None].expand(-1, -1, block)).view(b, n * block)
    if main < width:  # the tail, fewer than a block's elements, is always looked at
        pool = torch.cat([pool, x[:, main:]], dim=1)
    values, at = pool.topk(n, dim=1)  # (B, n) positions in the pool
    pooled = n * block
    in_block = chosen.gather(1, (at // block).clamp_max_(n - 1)) * block + at % block
    return values, torch.where(at < pooled, in_block, at - pooled + main)


def top_candidates(cand: Tensor, n: int, vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """The n best extensions of each sentence, best first: (B, K*V) -> scores, source beams, tokens (B, n)."""
    scores, flat = top_k(cand, n)  # (B, n)
    return scores, flat // vocab, flat % vocab


def finalize(
    fin_scores: Tensor,
    fin_tokens: Tensor,
    cand_scores: Tensor,
    cand_tokens: Tensor,
    cand_seqs: Tensor,
    length: int,
    alpha: float,
    eos: int = EOS,
) -> tuple[Tensor, Tensor]:
    """Finish the candidates that end in EOS and keep each sentence's K best finished hypotheses.

    A finished score is raw / lp(length), `length` = |Y| with the EOS. Only the first K candidates are
    looked at (an EOS ranked below them would not have survived in a beam of K).
    fin_scores (B, K), best first, -inf where empty; fin_tokens (B, K, T); cand_scores, cand_tokens (B, K);
    cand_seqs (B, K, T): each candidate's tokens before its last one, PAD-filled. T need only cover the
    positions filled so far (length - 1): the search passes that much, not its whole length limit.
    """
    k = fin_scores.shape[1]
    ends = (cand_tokens == eos) & torch.isfinite(cand_scores)  # (B, K)
    new_scores = torch.where(ends, cand_scores / length_penalty(length, alpha), -math.inf)  # (B, K)
    scores, pick = torch.cat([fin_scores, new_scores], 1).topk(k, dim=1)  # (B, 2K) -> (B, K)
    tokens = torch.cat([fin_tokens, cand_seqs], 1)  # (B, 2K, T)
    return scores, tokens.gather(1, pick[:, :, None].expand(-1, -1, tokens.shape[2]))  # (B, K, T)


def live_order(cand_tokens: Tensor, k: int, eos: int = EOS) -> Tensor:
    """Which K candidates stay live: the first K not ending in EOS, in candidate order: (B, 2K) -> (B, K).

    Among 2K candidates at most K end in EOS (one per beam), so K always remain. The sort is stable, so
    the candidates keep their score order.
    """
    return torch.sort((cand_tokens == eos).to(torch.uint8), dim=1, stable=True).indices[:, :k]  # (B, K)


def select_live(
    cand_scores: Tensor, cand_beams: Tensor, cand_tokens: Tensor, k: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The K best candidates that do not end in EOS, best first (live_order): (B, 2K) each -> (B, K) each."""
    order = live_order(cand_tokens, k)
    return cand_scores.gather(1, order), cand_beams.gather(1, order), cand_tokens.gather(1, order)


def best_possible(live_best: Tensor, t: int, max_lens: Tensor, alpha: float) -> Tensor:
    """Upper bound on the normalized score a live hypothesis (t + 1 tokens, raw score s) can still reach.

    Later tokens only lower s (log-probs <= 0), and it ends with |Y| in [t + 2, max_len + 1], so its score
    is at most s / max lp(|Y|): lp at max_len + 1 for alpha >= 0, at t + 2 for alpha < 0. (B,) -> (B,).
    """
    longest = length_penalties((max_lens + 1).to(live_best.dtype), alpha)
    return live_best / torch.clamp(longest, min=length_penalty(t + 2, alpha))


def sentence_done(
    fin_scores: Tensor, live_scores: Tensor, t: int, max_lens: Tensor, alpha: float, nbest: int
) -> Tensor:
    """Rules (a), (b), (c) of the module docstring: (B, K) finished and live scores -> (B,) bool."""
    full = torch.isfinite(fin_scores[:, -1])  # (a) K finished
    nth = fin_scores[:, nbest - 1]
    unbeatable = torch.isfinite(nth) & (nth >= best_possible(live_scores[:, 0], t, max_lens, alpha))  # (b)
    return full | unbeatable | (max_lens <= t)  # (c)


def hypotheses(scores: Tensor, tokens: Tensor, n: int) -> list[list[Hypothesis]]:
    """The n best finished hypotheses per sentence, to Python once at the end: (B, K), (B, K, T)."""
    out = []
    for row_scores, row_tokens in zip(scores[:, :n].tolist(), tokens[:, :n].tolist(), strict=True):
        out.append(
            [
                Hypothesis([w for w in seq if w != PAD], s)
                for s, seq in zip(row_scores, row_tokens, strict=True)
                if s != -math.inf
            ]
        )
    return out


def first_width(k: int, vocab: int) -> int:
    """Rows per sentence at beam search's step 0: one, whose 2K best extensions are all distinct (its K
    beams would all start from BOS alike), unless a vocabulary smaller than 2K leaves one row too few."""
    return 1 if 2 * k <= vocab else k


class Beams:
    """The bookkeeping of a beam search over a batch, shared by beam_search and the constrained search
    (nmt.translate.constraints): the live hypotheses of each sentence, its K best finished ones, and the
    sentences done.

    Sentences are numbered as the batch is now (finished ones leave it on `compact`); `ids` gives each
    one's place in the input. Rows of the decoder state are sentence-major, `width` per sentence: one at
    step 0 (its K beams would all start from BOS alike) unless a vocabulary smaller than 2K leaves one
    row too few candidates, K once `widen` has run.
    """

    def __init__(
        self, b: int, k: int, vocab: int, steps: int, max_lens: Tensor, prefix: Tensor | None, dtype
    ):
        dev = max_lens.device
        self.k, self.width = k, first_width(k, vocab)
        self.ids = torch.arange(b, device=dev)  # (B,) original sentence of each live sentence
        self.alive = torch.ones(b, dtype=torch.bool, device=dev)  # (B,) sentences still searching
        self.max_lens = max_lens  # (B,)
        self.prefix = prefix.repeat_interleave(k, dim=0) if prefix is not None else None  # (B*K, P)
        self.scores = torch.full((b, self.width), -math.inf, dtype=dtype, device=dev)  # (B, width) raw
        self.scores[:, 0] = 0.0  # one hypothesis (BOS) to start from; any other rows never win a slot
        self.seqs = torch.full((b * self.width, steps), PAD, device=dev)  # (B*width, T) live tokens so far
        self.spare: Tensor | None = None  # `extend`'s other buffer of seqs' shape: PAD past what it filled
        self.last = torch.full((b * self.width,), BOS, device=dev)
        self.fin_scores = torch.full((b, k), -math.inf, dtype=dtype, device=dev)  # (B, K) best first
        self.fin_tokens = torch.full((b, k, steps), PAD, device=dev)
        self.out_scores, self.out_tokens = self.fin_scores.clone(), self.fin_tokens.clone()
        self.offsets = torch.arange(b, device=dev)[:, None] * self.width  # (B, 1) first row of each sentence
        self.first_limit = int(max_lens.min())  # before this step no sentence is at its length limit
        self.finished = False  # whether any hypothesis has finished
        self.n_dead = 0  # sentences done but still in the batch

    def at_limit(self, t: int) -> Tensor | None:
        """(rows,) whether each row is at its sentence's length limit; None before any can be."""
        return (self.max_lens <= t).repeat_interleave(self.width) if t >= self.first_limit else None

    @property
    def row_prefix(self) -> Tensor | None:
        """(rows, P) each row's forced prefix."""
        return self.prefix if self.prefix is None or self.width == self.k else self.prefix[:: self.k]

    def rows(self, beams: Tensor) -> Tensor:
        """(B, n) beams of each sentence -> (B*n,) their rows."""
        return (self.offsets + beams).view(-1)

    def finish(self, cand_scores: Tensor, cand_beams: Tensor, cand_tokens: Tensor, t: int, lenpen: float):
        """Those among the K best candidates that end in EOS finish, with |Y| = t + 1 (at most steps none
        does: a host check costs less than the operators of finalize on a CPU)."""
        k = self.k
        if not bool((cand_tokens[:, :k] == EOS).any()):
            return
        # Only the t positions filled so far: every finished hypothesis is PAD past them, and the length
        # limit, which the buffers are sized for, is often several times a sentence's length.
        filled = self.seqs[:, :t].index_select(0, self.rows(cand_beams[:, :k])).view(len(cand_beams), k, t)
        fin_tokens = self.fin_tokens[:, :, :t]
        self.fin_scores, fin_tokens[:] = finalize(
            self.fin_scores, fin_tokens, cand_scores[:, :k], cand_tokens[:, :k], filled, t + 1, lenpen
        )
        self.finished = True

    def extend(self, scores: Tensor, beams: Tensor, tokens: Tensor, t: int) -> Tensor:
        """The K live hypotheses of each sentence (B, K) each, their rows taking over their parents'
        histories -> the rows (B*K,) taken, which the decoder state must follow."""
        rows = self.rows(beams)
        self.scores, self.last = scores, tokens.view(-1)
        # The t filled positions move, into the other buffer (PAD past them: it held the tokens of step
        # t - 2 at most), rather than the whole length limit's worth at every step.
        n, spare = len(rows), self.spare
        fits = spare is not None and len(spare) == n  # rows change at step 0 (widen), then only on compact
        target = spare if fits else self.seqs.new_full((n, self.seqs.shape[1]), PAD)
        torch.index_select(self.seqs[:, :t], 0, rows, out=target[:, :t])
        target[:, t] = self.last
        self.seqs, self.spare = target, self.seqs
        return rows

    def widen(self) -> bool:
        """After step 0: each sentence's row has become its K beams. Whether it just did."""
        if self.width == self.k:
            return False
        self.width, self.offsets = self.k, self.offsets * self.k
        return True

    def done(self, t: int, lenpen: float, nbest: int, live: Tensor | None = None) -> Tensor | None:
        """(B,) the sentences done after step t (sentence_done; `live` the live scores it bounds, by
        default the live scores, best first); None where none can be: no hypothesis has finished and
        none has reached its length limit."""
        if not (self.finished or t >= self.first_limit):
            return None
        live = self.scores if live is None else live
        return sentence_done(self.fin_scores, live, t, self.max_lens, lenpen, nbest) & self.alive

    def record(self, done: Tensor | None) -> None:
        """The sentences `done` (B,) keep their finished hypotheses and stop searching."""
        n_done = int(done.sum()) if done is not None else 0
        if n_done:
            self.alive &= ~done
            self.n_dead += n_done
            self.out_scores[self.ids[done]] = self.fin_scores[done]
            self.out_tokens[self.ids[done]] = self.fin_tokens[done]

    @property
    def over(self) -> bool:
        return self.n_dead == len(self.alive)

    @property
    def crowded(self) -> bool:
        """Whether the finished sentences are 1/COMPACT_EVERY of the batch: time they left it."""
        return self.n_dead * COMPACT_EVERY >= len(self.alive)

    def survivors(self) -> Tensor:
        return self.alive.nonzero().squeeze(1)  # (B',)

    def compact(self, keep: Tensor) -> Tensor:
        """Only the sentences `keep` (B',) stay -> their rows (B'*K,), for what else follows the rows."""
        keep_rows = (keep[:, None] * self.k + torch.arange(self.k, device=keep.device)).view(-1)  # (B'*K,)
        self.ids, self.max_lens, self.scores = self.ids[keep], self.max_lens[keep], self.scores[keep]
        self.alive, self.fin_scores, self.fin_tokens = (
            self.alive[keep],
            self.fin_scores[keep],
            self.fin_tokens[keep],
        )
        self.seqs, self.last, self.spare = self.seqs[keep_rows], self.last[keep_rows], None
        self.prefix = self.prefix[keep_rows] if self.prefix is not None else None
        self.offsets = self.offsets[: keep.numel()]
        self.first_limit, self.n_dead = int(self.max_lens.min()), 0
        return keep_rows

    def hypotheses(self, nbest: int) -> list[list[Hypothesis]]:
        return hypotheses(self.out_scores, self.out_tokens, nbest)


# ---- the searches -----------------------------------------------------------------------------------


@torch.no_grad()
def greedy_search(
    model: Decoder,
    src: Tensor,
    max_len_a: float,
    max_len_b: int,
    lenpen: float = 0.0,
    min_len: int = 1,
    no_repeat_ngram: int = 0,
    prefix: Tensor | None = None,
    sampler: Sampler | None = None,
) -> list[Hypothesis]:
    """The most probable next token at every step, or a drawn one with a `sampler`. `lenpen` only scales
    the reported score (as beam 1's).

    src: (B, S) right-padded ids, each row ending in EOS; prefix: (B, P) forced first tokens or None.
    """
    b = src.shape[0]
    max_lens = max_output_lengths(src, max_len_a, max_len_b, model.max_positions, prefix)  # (B,)
    steps = int(max_lens.max()) + 1  # decoder positions: BOS + up to max_len tokens
    memory, src_keep = model.encode(src)
    state = model.init_state(memory, src_keep, steps)
    dtype = score_dtype(memory)
    del memory  # the state holds what the steps need of it (the encoder's keys and values)
    masks = token_masks(model.vocab_size, dtype, src.device)
    # The loop below in one call, where the model has it for this batch (a few sentences on the CPU,
    # nmt.translate.scripted.ScriptedGreedy): the same operators without Python between them
    loop = getattr(model, "greedy_loop", None)
    if loop is not None and prefix is None and sampler is None and no_repeat_ngram <= 0:
        found = loop(state, max_lens, min_len, lenpen, masks)
        if found is not None:
            tokens, scores = found
            return [h[0] for h in hypotheses(scores[:, None], tokens[:, None], 1)]

    ids = torch.arange(b, device=src.device)  # original sentence of each row
    alive = torch.ones(b, dtype=torch.bool, device=src.device)  # sentences still searching
    raw = torch.zeros(b, dtype=dtype, device=src.device)  # (B,) sum of log-probs so far
    seqs = torch.full((b, steps), PAD, device=src.device)  # (B, T) tokens so far
    last = torch.full((b,), BOS, device=src.device)
    out_tokens = torch.full((b, steps), PAD, device=src.device)
    out_scores = torch.zeros(b, dtype=dtype, device=src.device)
    first_limit = int(max_lens.min())  # before this step no row is at its length limit
    n_dead = 0  # sentences done but still in the batch
    for t in range(steps):
        # 1. one decoder step for every live sentence
        logits, state = model.step(last, state)
        at_limit = max_lens <= t if t >= first_limit else None  # (B,)
        lprobs = step_log_probs(logits, at_limit, masks, t < min_len)  # (B, V)
        lprobs = force_prefix(block_repeated_ngrams(lprobs, seqs[:, :t], no_repeat_ngram), prefix, t)
        # 2. the best token, or a drawn one
        best, last = lprobs.max(dim=1) if sampler is None else sampler(lprobs)  # (B,)
        del logits, lprobs  # (B, V), not held through the next step's output projection
        raw = raw + best
        ended = last == EOS
        done = ended & alive
        seqs[:, t] = last.masked_fill(ended, PAD)
        # 3. finished sentences are recorded, and leave the batch once they are a quarter of it. A step of
        # one sentence is a few dozen small operators, so the count of the dead is kept here, not summed.
        n_done = int(done.sum())  # the one host sync a step
        if n_done:
            alive ^= done  # done ones are alive: this clears them
            n_dead += n_done
            out_tokens[ids[done]] = seqs[done]
            out_scores[ids[done]] = raw[done] / length_penalty(t + 1, lenpen)
        if n_dead == len(alive):
            break
        if n_dead * COMPACT_EVERY >= len(alive):
            keep = alive.nonzero().squeeze(1)
            ids, raw, seqs, last, max_lens, alive = (x[keep] for x in (ids, raw, seqs, last, max_lens, alive))
            prefix = prefix[keep] if prefix is not None else None
            first_limit, n_dead = int(max_lens.min()), 0
            state = model.select_rows(state, keep)
    return [h[0] for h in hypotheses(out_scores[:, None], out_tokens[:, None], 1)]


@torch.no_grad()
def beam_search(
    model: Decoder,
    src: Tensor,
    beam: int,
    lenpen: float,
    max_len_a: float,
    max_len_b: int,
    nbest: int = 1,
    min_len: int = 1,
    no_repeat_ngram: int = 0,
    prefix: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Beam search (module docstring) -> the `nbest` best hypotheses of each sentence, best first.

    src: (B, S) right-padded ids, each row ending in EOS; prefix: (B, P) forced first tokens or None.
    Rows of the decoder state are sentence-major: row i * K + j is beam j of sentence i (Beams).
    """
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest {nbest} must be between 1 and the beam size {beam}")
    k = beam
    max_lens = max_output_lengths(src, max_len_a, max_len_b, model.max_positions, prefix)  # (B,)
    steps = int(max_lens.max()) + 1  # decoder positions: BOS + up to max_len tokens
    memory, src_keep = model.encode(src)
    masks = token_masks(model.vocab_size, score_dtype(memory), src.device)
    state = model.init_state(memory, src_keep, steps, first_width(k, model.vocab_size))
    del memory  # the state holds what the steps need of it (the encoder's keys and values)
    # The loop below in one call, where the model has it for this batch (one sentence or two on the CPU,
    # nmt.translate.scripted.ScriptedBeam): the same parts without Python between them
    loop = getattr(model, "beam_loop", None)
    if loop is not None and prefix is None and no_repeat_ngram <= 0:
        found = loop(state, k, max_lens, min_len, lenpen, nbest, masks)
        if found is not None:
            return hypotheses(*found, nbest)
    beams = Beams(src.shape[0], k, model.vocab_size, steps, max_lens, prefix, masks.free.dtype)
    for t in range(steps):
        # 1. one decoder step for every live hypothesis
        logits, state = model.step(beams.last, state)
        lprobs = step_log_probs(logits, beams.at_limit(t), masks, t < min_len)  # (B*width, V)
        lprobs = block_repeated_ngrams(lprobs, beams.seqs[:, :t], no_repeat_ngram)
        lprobs = force_prefix(lprobs, beams.row_prefix, t)
        # 2. the 2K best one-token extensions of each sentence
        cand = top_candidates(expand_scores(beams.scores, lprobs), 2 * k, lprobs.shape[1])  # 3 x (B, 2K)
        # The step's (B*width, V) numbers are done with: held through the next step's output projection,
        # where a batch's memory peaks, they were 14 MiB more of the heap in use there (the demo model at
        # its default budget, fp32 and int8; benchmarks/RESULTS.md, 2026-12-04 02:40)
        del logits, lprobs
        # 3. those among the K best that end in EOS finish
        beams.finish(*cand, t, lenpen)
        # 4. the K best others stay live: their rows take over their parents' histories
        rows = beams.extend(*select_live(*cand, k), t)
        if beams.widen():  # after step 0: the K beams copy their sentence's row, no reordering
            state, rows = model.expand_beams(state, k), None
        # 5. finished sentences are recorded
        beams.record(beams.done(t, lenpen, nbest))
        if beams.over:
            break
        # 6. the decoder state follows the beams; finished sentences leave it once they are 1/COMPACT_EVERY
        # of the batch, in the same gather
        if not beams.crowded:
            state = model.reorder_beams(state, rows) if rows is not None else state
            continue
        keep_rows = beams.compact(beams.survivors())
        state = model.select_rows(state, rows[keep_rows] if rows is not None else keep_rows)
    return beams.hypotheses(nbest)
