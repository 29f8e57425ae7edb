"""The encoder and the decoder step in TorchScript (nmt.translate.scripted) run the eager operators in their
order, so they must give the eager path's very bits: memory, logits and caches, at every row count they
serve, for every kernel they cover, and the same translations; where they cannot run, the eager path does."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from nmt.checkpoint import load_model
from nmt.config import Precision
from nmt.model import Transformer
from nmt.shortlist import Shortlist
from nmt.tokens import EOS, UNK
from nmt.translate import inference_model
from nmt.translate.builder import scripted_words
from nmt.translate.int8 import _ByRows, _Fbgemm, _IntMM, _OneDNN, quantize_int8
from nmt.translate.prepacked import available as prepacked_available
from nmt.translate.scripted import ALL_ROWS, LOOP_ROWS, script_model
from nmt.translate.search import Sampler, beam_search, greedy_search
from nmt.translate.shortlist import ShortlistDecoder

from .synthetic import make_config

# numerics: compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_torch_thread")]

VOCAB = 64


def random_model(**model: object) -> Transformer:
    torch.manual_seed(0)
    net = Transformer(dataclasses.replace(make_config().model, **model), VOCAB).eval()
    for p in net.parameters():  # spread the logits, so that near-ties do not decide the search
        p.data.mul_(2.0)
    for module in net.modules():  # norms each of its own, so that one used for another shows
        if isinstance(module, nn.LayerNorm):
            module.weight.data.add_(torch.randn_like(module.weight) * 0.2)
            module.bias.data.normal_(std=0.2)
    return net


def fbgemm_kernel(monkeypatch) -> None:
    """fbgemm's int8 product, which runs on every x86 CPU, whatever `kernel` would prefer here."""
    bits = _Fbgemm.probe()
    if bits is None:
        pytest.skip("fbgemm's int8 product is not exact here")
    monkeypatch.setattr("nmt.translate.int8.kernel", lambda: (_Fbgemm, bits))


def probed(product) -> int | None:
    """The bits with which an int8 kernel is exact here, None where it is not or does not run."""
    try:
        return product.probe()
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


FEW_ROWS = 4  # int8-byrows: torch._int_mm up to this many rows, oneDNN's kernel above (to 64 rows scripted)


def int8_kernel(monkeypatch, product) -> None:
    """`product` as the int8 kernel, whatever `kernel` would prefer here; _ByRows with FEW_ROWS."""
    bits = probed(product)
    if bits is None:
        pytest.skip(f"{product.name}'s int8 product is not exact here (_ByRows: VNNI or AMX)")
    monkeypatch.setattr("nmt.translate.int8.kernel", lambda: (product, bits))
    monkeypatch.setattr("nmt.translate.int8._few_rows", lambda *shape: FEW_ROWS)


def built(kind: str, monkeypatch, **model: object) -> Transformer:
    """A random model in one of the kernels the scripted step covers, its step scripted."""
    net = random_model(**model)
    if kind.startswith("int8-"):
        int8_kernel(monkeypatch, INT8_KINDS[kind])
        net = inference_model(net, Precision.INT8, torch.device("cpu"))
    elif kind in ("fp32-prepacked", "bf16-prepacked"):
        dtype = torch.float32 if kind == "fp32-prepacked" else torch.bfloat16
        if not prepacked_available(dtype):
            pytest.skip(f"oneDNN's prepacked products do not run in {dtype} here")
        precision = Precision("fp32" if dtype == torch.float32 else "bf16")
        net = inference_model(net, precision, torch.device("cpu"))
    else:  # F.linear, and in bf16 F.scaled_dot_product_attention (nmt.model.attention)
        precision = Precision("bf16" if kind == "bf16-linear" else "fp32")
        net = inference_model(net, precision, torch.device("cpu"), prepack=False)
    assert net.step_rows > 0 and net.encode_rows > 0, f"{kind}: not scripted"
    return net


@contextlib.contextmanager
def eager(net: Transformer) -> Iterator[None]:
    """The model with its scripted paths off inside the block."""
    rows = net.encode_rows, net.step_rows
    net.encode_rows = net.step_rows = 0
    try:
        yield
    finally:
        net.encode_rows, net.step_rows = rows


INT8_KINDS = {"int8-fbgemm": _Fbgemm, "int8-intmm": _IntMM, "int8-byrows": _ByRows, "int8-onednn": _OneDNN}
KINDS = [*INT8_KINDS, "fp32-prepacked", "bf16-prepacked", "fp32-linear", "bf16-linear"]
SHAPES = [  # (sentences, beam): one sentence greedy and at beam 4, a few, and more than 64 rows
    (1, 1),
    (1, 4),
    (3, 2),
    (20, 3),
    (40, 2),
]


def sources(b: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """(b, S) right-padded ids ending in EOS, of lengths 2 to 12."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 13, (b,), generator=gen)
    src = torch.zeros(b, int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        src[i, : n - 1] = torch.randint(4, vocab, (n - 1,), generator=gen)
        src[i, n - 1] = EOS
    return src


def steps_both_ways(net: Transformer, b: int, beam: int, steps: int = 12) -> None:
    """The sources encoded, and `steps` steps (past a cache block, so the cache grows) of the same tokens
    taken, eagerly and scripted: the same memory, logits and caches, bit for bit."""
    with torch.inference_mode():
        src = sources(b, seed=b * 10 + beam)
        with eager(net):
            memory, keep = net.encode(src)
        scripted_memory, scripted_keep = net.encode(src)
        assert torch.equal(memory, scripted_memory) and torch.equal(keep, scripted_keep), (b, src.shape)
        states = [net.init_state(memory, keep, steps, beam) for _ in range(2)]
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            tokens = torch.randint(3, VOCAB, (b * beam,), generator=gen)
            with eager(net):
                logits = net.step(tokens, states[0])[0]
            assert torch.equal(logits, net.step(tokens, states[1])[0]), (b, beam, states[0].length)
        n, t = b * beam, states[0].length
        for by_eager, by_script in zip(states[0].self_kv, states[1].self_kv, strict=True):
            assert torch.equal(by_eager[:, :n, :, :t], by_script[:, :n, :, :t])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("b", "beam"), SHAPES)
def test_the_scripted_step_gives_the_eager_steps_bits(monkeypatch, kind, b, beam):
    steps_both_ways(built(kind, monkeypatch), b, beam)


@pytest.mark.parametrize(
    "model",
    [
        {"norm": "pre"},
        {"activation": "swish"},
        {"decoder_start": "zero"},
        {"norm": "pre", "decoder_start": "zero", "activation": "swish"},
    ],
    ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()),
)
@pytest.mark.parametrize("kind", ["int8-fbgemm", "int8-byrows", "fp32-prepacked", "fp32-linear"])
def test_every_layer_variant_scripts_to_the_same_bits(monkeypatch, kind, model):
    """Pre-norm (the paper's post-norm is the default), MarianMT's swish and zero start: what the eager
    path branches on."""
    net = built(kind, monkeypatch, **model)
    for b, beam in ((1, 1), (2, 4)):
        steps_both_ways(net, b, beam)


def test_int8_and_prepacked_models_are_scripted_for_as_many_rows_as_their_kernels_serve(monkeypatch):
    """fbgemm's and torch._int_mm's scripted forms serve any row count; oneDNN's int8 and prepacked ones,
    and so _ByRows's, those they pad into one piece (up to 64), and the eager path takes larger batches;
    the log says which."""
    net = built("int8-fbgemm", monkeypatch)
    assert net.step_rows == net.encode_rows == ALL_ROWS
    assert (
        scripted_words(net)
        == f"encoder, decoder steps and the searches (up to {LOOP_ROWS} rows) in TorchScript"
    )
    if probed(_IntMM) is not None:
        assert built("int8-intmm", monkeypatch).step_rows == ALL_ROWS
    for kind in ("int8-byrows", "int8-onednn"):
        if probed(INT8_KINDS[kind]) is not None:
            net = built(kind, monkeypatch)
            assert net.step_rows == net.encode_rows == 64 and net.search_loops.rows == LOOP_ROWS, kind
    if prepacked_available(torch.float32):
        net = built("fp32-prepacked", monkeypatch)
        # up to 64 rows where oneDNN keeps a row's bits at every count (its row range, probed on this CPU)
        assert 0 < net.step_rows <= 64 and 0 < net.encode_rows <= 64
        words = f"encoder (up to {net.encode_rows} source tokens), decoder steps (up to {net.step_rows} rows)"
        words += f" and the searches (up to {net.search_loops.rows} rows)"
        assert scripted_words(net) == words + " in TorchScript"


def test_the_scripted_model_keeps_its_state_dict(monkeypatch):
    """The scripted step holds the model's own tensors, not copies, and adds no keys to its state_dict."""
    net = random_model()
    keys = set(net.state_dict())
    fbgemm_kernel(monkeypatch)
    quantize_int8(net)
    keys_int8 = set(net.state_dict())
    assert script_model(net)
    assert set(net.state_dict()) == keys_int8 <= keys | keys_int8
    assert net.step_kernel.embed.data_ptr() == net.embed.weight.data_ptr()
    assert net.encode_kernel.embed.data_ptr() == net.embed.weight.data_ptr()


def test_a_kernel_without_a_scripted_form_or_a_failing_script_leaves_the_eager_step(monkeypatch):
    net = random_model()
    fbgemm_kernel(monkeypatch)
    quantize_int8(net)

    def failing(module):
        raise RuntimeError("no TorchScript here")

    monkeypatch.setattr(torch.jit, "script", failing)
    assert not script_model(net)
    assert net.step_kernel is None and net.encode_kernel is None and scripted_words(net) == ""
    with torch.inference_mode():
        memory, keep = net.encode(sources(2, seed=0))
        logits, _ = net.step(torch.tensor([1, 1]), net.init_state(memory, keep, 4))
    assert logits.shape == (2, VOCAB)


def test_a_model_in_training_mode_encodes_and_steps_eagerly(monkeypatch):
    net = built("fp32-linear", monkeypatch)

    class Refusing(nn.Module):
        def forward(self, *args):
            raise AssertionError("a scripted path ran in training mode")

    net.step_kernel = net.encode_kernel = Refusing()
    net.train()
    with torch.no_grad():
        memory, keep = net.encode(sources(2, seed=0))
        logits, _ = net.step(torch.tensor([1, 1]), net.init_state(memory, keep, 4))
    assert logits.shape == (2, VOCAB)


def test_threads_stepping_one_scripted_model_at_once_get_their_own_results(monkeypatch):
    """`nmt serve`'s search threads share one model: its scripted step keeps nothing between calls, so
    concurrent steps of different batches give what each gives alone."""
    net = built("int8-fbgemm", monkeypatch)

    def run(b: int) -> list[torch.Tensor]:
        with torch.inference_mode():
            memory, keep = net.encode(sources(b, seed=b))
            state, out = net.init_state(memory, keep, 10), []
            for t in range(10):
                out.append(net.step(torch.full((b,), 3 + t), state)[0])
            return out

    alone = {b: run(b) for b in (1, 2, 5, 9)}
    results: dict[int, list[torch.Tensor]] = {}
    threads = [threading.Thread(target=lambda b=b: results.__setitem__(b, run(b))) for b in alone]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for b, logits in alone.items():
        assert all(torch.equal(x, y) for x, y in zip(logits, results[b], strict=True)), b


class Counting:
    """A model's search loops, counting the batches each searched (a loop returns None where it does not)."""

    def __init__(self, loops):
        self.loops, self.rows, self.searched = loops, loops.rows, 0

    def greedy(self, *args):
        return self.count(self.loops.greedy(*args))

    def beam(self, *args):
        return self.count(self.loops.beam(*args))

    def count(self, found):
        self.searched += found is not None
        return found


def a_shortlist(seed: int, vocab: int = VOCAB) -> Shortlist:
    """A random shortlist: 6 frequent ids and 4 per source id, so a few sentences' union is far from all."""
    gen = torch.Generator().manual_seed(seed)
    frequent = torch.randperm(vocab - 4, generator=gen)[:6] + 4
    return Shortlist(frequent, torch.randint(4, vocab, (vocab, 4), generator=gen))


def both_ways(
    net: Transformer, src: torch.Tensor, shortlist: Shortlist | None, beam: int = 1, **options
) -> list:
    """greedy_search's (beam 1) or beam_search's hypotheses with the model's scripted loop and with the
    eager loop over the same scripted step (the loops off): they must be the same, tokens and scores."""

    lenpen = options.pop("lenpen", 0.0 if beam == 1 else 0.6)

    def search(decoder) -> list:
        if beam == 1:
            return greedy_search(decoder, src, 1.0, 3, lenpen=lenpen, **options)
        return beam_search(decoder, src, beam, lenpen, 1.0, 3, **options)

    def translate() -> list:
        with torch.inference_mode():
            if shortlist is None:
                return search(net)
            decoder = ShortlistDecoder(net, shortlist, src)
            return decoder.from_union(search(decoder))

    loops = net.search_loops
    net.search_loops = None
    by_eager = translate()
    net.search_loops = counting = Counting(loops)
    try:
        by_loop = translate()
    finally:
        net.search_loops = loops
    assert by_loop == by_eager
    return [counting.searched, by_loop]


def greedy_both_ways(net: Transformer, src: torch.Tensor, shortlist: Shortlist | None, **options) -> list:
    return both_ways(net, src, shortlist, 1, **options)


@pytest.mark.parametrize("kind", [kind for kind in KINDS if not kind.endswith("-linear")])
@pytest.mark.parametrize("shortlisted", [False, True], ids=["vocabulary", "shortlist"])
def test_the_scripted_greedy_loop_translates_as_the_eager_loop(monkeypatch, kind, shortlisted):
    """One sentence and a few, whose translations end at different steps (past a cache block, so the
    cache grows), with the length limit, min_len and the length penalty at work: the same hypotheses."""
    net = built(kind, monkeypatch)
    assert net.search_loops is not None, kind
    # the loop's sentences: LOOP_ROWS, or fewer where a kernel's scripted form serves fewer rows; more run
    # the eager loop. A shortlist's union in _ByRows builds its oneDNN copy for the loop past FEW_ROWS rows.
    most = net.search_loops.rows
    lengths = set()
    for b, seed in ((1, 0), (1, 1), (3, 2), (LOOP_ROWS, 3)):
        src = sources(b, seed=seed)
        shortlist = a_shortlist(seed) if shortlisted else None
        for options in ({}, {"min_len": 4, "lenpen": 1.0}):
            searched, found = greedy_both_ways(net, src, shortlist, **options)
            assert searched == (b <= most), (kind, b, most, options)
            lengths |= {len(h.tokens) for h in found}
    assert len(lengths) >= 4 and max(lengths) > 8, lengths  # ends at several steps, past a cache block


def test_the_scripted_greedy_loop_leaves_what_it_does_not_cover_to_the_eager_loop(monkeypatch):
    """More sentences than LOOP_ROWS, a forced prefix, n-gram blocking and sampling run the eager loop, and
    so does a model whose output projection has no scripted form (F.linear's: no kernel of its own)."""
    assert built("fp32-linear", monkeypatch).search_loops is None
    net = built("int8-fbgemm", monkeypatch)
    src = sources(LOOP_ROWS + 1, seed=5)
    assert greedy_both_ways(net, src, None)[0] == 0
    assert greedy_both_ways(net, src[:2], None, no_repeat_ngram=2)[0] == 0
    assert greedy_both_ways(net, src[:2], None, prefix=torch.tensor([[5, 6], [7, 0]]))[0] == 0
    sampler = Sampler(topk=5, generator=torch.Generator().manual_seed(0))
    loops = net.search_loops
    net.search_loops = counting = Counting(loops)
    with torch.inference_mode():
        greedy_search(net, src[:2], 1.0, 3, sampler=sampler)
    assert counting.searched == 0
    net.search_loops = loops
    with eager(net), torch.inference_mode():  # the step's scripted form off: the loops' too
        net.search_loops = counting = Counting(loops)
        greedy_search(net, src[:1], 1.0, 3)
        beam_search(net, src[:1], 4, 0.6, 1.0, 3)
    net.search_loops = loops
    assert counting.searched == 0
    # beam search: more rows than LOOP_ROWS, a prefix and n-gram blocking run the eager loop
    assert both_ways(net, src[:3], None, beam=4)[0] == 0
    assert both_ways(net, src[:1], None, beam=4, no_repeat_ngram=2)[0] == 0
    assert both_ways(net, src[:1], None, beam=4, prefix=torch.tensor([[5, 6]]))[0] == 0


@pytest.mark.parametrize("kind", [kind for kind in KINDS if not kind.endswith("-linear")])
@pytest.mark.parametrize("shortlisted", [False, True], ids=["vocabulary", "shortlist"])
def test_the_scripted_beam_loop_translates_as_the_eager_loop(monkeypatch, kind, shortlisted):
    """One sentence at beam 4 (the interactive case) and two, at beams 2 to 4, with the n-best, min_len and
    length penalties at work, hypotheses ending at several steps and past a cache block: the same n-best
    lists, tokens and scores. Two sentences at beam 4 are LOOP_ROWS rows: one sentence finishes first and
    the eager loop drops it, the scripted one keeps it, ignored."""
    net = built(kind, monkeypatch)
    most = net.search_loops.rows
    lengths = set()
    for b, beam, seed in ((1, 4, 0), (1, 4, 1), (2, 4, 2), (1, 2, 3), (2, 3, 4)):
        src = sources(b, seed=seed)
        shortlist = a_shortlist(seed) if shortlisted else None
        for options in ({}, {"nbest": beam}, {"min_len": 4, "lenpen": 1.0}, {"lenpen": -0.5, "nbest": 2}):
            searched, found = both_ways(net, src, shortlist, beam, **options)
            assert searched == (b * beam <= most), (kind, b, beam, most, options)
            lengths |= {len(h.tokens) for hyps in found for h in hyps}
    assert len(lengths) >= 4 and max(lengths) > 8, lengths


def test_the_scripted_beam_loop_starts_at_k_rows_where_the_vocabulary_is_smaller_than_2k(monkeypatch):
    """A shortlist's union of fewer than 2K ids: each sentence starts at K rows (search.first_width), none
    widened after step 0, in the scripted loop as in the eager one."""
    net = built("int8-fbgemm", monkeypatch)
    shortlist = Shortlist(torch.tensor([5]), torch.full((VOCAB, 1), 6))  # the union: the 4 reserved ids, 5, 6
    src = sources(1, seed=7)
    decoder = ShortlistDecoder(net, shortlist, src)
    decoder.ids, decoder.vocab_size = decoder.ids[:7], 7  # no filler: 7 ids, fewer than 2 x 4
    decoder.index = torch.zeros(VOCAB, dtype=torch.long)
    decoder.index[decoder.ids] = torch.arange(7)

    def search():
        with torch.inference_mode():
            return decoder.from_union(beam_search(decoder, src, 4, 0.6, 1.0, 3, nbest=4))

    loops = net.search_loops
    net.search_loops = None
    by_eager = search()
    net.search_loops = counting = Counting(loops)
    try:
        by_loop = search()
    finally:
        net.search_loops = loops
    assert counting.searched == 1 and by_loop == by_eager
    assert {t for hyps in by_loop for h in hyps for t in h.tokens} <= {UNK, 5, 6}


def test_threads_searching_over_their_own_shortlists_at_once_get_their_own_translations(monkeypatch):
    """`nmt serve`'s search threads share one model and its scripted loop; each batch's union projection is
    its own (a copy of the scripted projection over the union's weights), so concurrent searches over
    different unions give what each gives alone."""
    net = built("int8-fbgemm", monkeypatch)

    def run(seed: int) -> list:
        src = sources(1 + seed % 3, seed=seed)
        with torch.inference_mode():
            decoder = ShortlistDecoder(net, a_shortlist(seed), src)
            return decoder.from_union(greedy_search(decoder, src, 1.0, 3))

    alone = {seed: run(seed) for seed in range(6)}
    results: dict[tuple[int, int], list] = {}
    threads = [
        threading.Thread(target=lambda key=(seed, copy): results.__setitem__(key, run(key[0])))
        for seed in alone
        for copy in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {(seed, copy): alone[seed] for seed in alone for copy in range(2)}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int8", "int8-byrows", "fp32"])
def test_a_trained_model_translates_the_same_scripted_and_eager(synthetic_run, monkeypatch, precision):
    """Hypotheses and scores of a model that has learned its task, greedy and at beam 4, one sentence at a
    time and in a batch."""
    if precision == "int8":
        fbgemm_kernel(monkeypatch)
    elif precision == "int8-byrows":
        int8_kernel(monkeypatch, _ByRows)
        precision = "int8"
    net, _, cfg = load_model(synthetic_run / "checkpoints" / "best.pt")
    net = inference_model(net, Precision(precision), torch.device("cpu"))
    assert net.step_rows > 0 and net.encode_rows > 0
    src = sources(24, seed=7, vocab=net.vocab_size)

    def searched() -> list:
        with torch.inference_mode():
            one = [greedy_search(net, src[i : i + 1], 1.0, 5)[0] for i in range(4)]
            one += [beam_search(net, src[i : i + 1], 4, 0.6, 1.0, 5)[0][0] for i in range(4)]
            batch = greedy_search(net, src, 1.0, 5) + [h[0] for h in beam_search(net, src, 4, 0.6, 1.0, 5)]
            return one + batch

    scripted = searched()
    with eager(net):
        assert searched() == scripted
