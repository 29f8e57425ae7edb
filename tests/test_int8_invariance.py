"""`--dtype int8` quantizes activations per row, so a sentence's int8 translation is the same alone and
inside any batch (nmt.translate.int8): byte-identical hypotheses and scores, not merely close ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nmt.model import Transformer
from nmt.tokens import EOS, PAD
from nmt.translate.int8 import Int8Linear, quantize_int8, weight_bits
from nmt.translate.search import beam_search, greedy_search

from .synthetic import make_config

# numerics: compares numbers, so `make test` runs it again with the AVX2 kernels forced (7-bit weights)
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_torch_thread")]

VOCAB = 64


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(make_config().model, VOCAB).eval()
    for p in model.parameters():  # spread the logits, so that the search is not decided by near-ties alone
        p.data.mul_(2.0)
    return quantize_int8(model)


def pad(sources: list[list[int]]) -> torch.Tensor:
    width = max(len(s) for s in sources) + 1
    return torch.tensor([s + [EOS] + [PAD] * (width - len(s) - 1) for s in sources])  # (B, S)


def sentences(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (n,), generator=gen).tolist()
    return [torch.randint(4, VOCAB, (length,), generator=gen).tolist() for length in lengths]


def test_an_int8_row_is_the_same_alone_and_among_any_rows():
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    x = torch.randn(300, 96) * torch.logspace(-2, 2, 300)[:, None]  # rows of very different ranges
    x[7] = 0  # an all-zero row: only the bias
    with torch.inference_mode():
        int8 = Int8Linear(linear.weight, linear.bias)
        alone = torch.cat([int8(x[i : i + 1]) for i in range(len(x))])
        assert torch.equal(alone[7], linear.bias)
        for rows in (2, 3, 17, 64, 299, 300):
            for start in (0, 300 - rows):
                assert torch.equal(int8(x[start : start + rows]), alone[start : start + rows]), (rows, start)


def test_the_weights_have_the_bits_the_cpu_multiplies_exactly():
    # 8 with VNNI; 7 where pairs of products add in int16 (AVX2, as `make test` forces for numerics tests)
    assert weight_bits() in (7, 8)
    linear = Int8Linear(torch.randn(16, 32), None)
    level = (1 << (weight_bits() - 1)) - 1
    assert linear.weight_t.abs().max() == level


@pytest.mark.parametrize("beam", [1, 4])
def test_a_sentence_translates_the_same_alone_and_in_batches_of_any_size(model, beam):
    """Each of 6 sentences alone against inside batches of 2, 7 and 16 with other companions: the same
    tokens. Where no companion is longer (the sentence's rows are padded alike), the same scores to the
    bit too; a longer companion pads the sentence's attention further, which moves the last bits of its
    scores in fp32 as well (a softmax over more, masked, positions), so only the tokens are compared."""

    def search(sources: list[list[int]]) -> list[tuple[list[int], float]]:
        with torch.inference_mode():
            if beam == 1:
                found = greedy_search(model, pad(sources), 0.0, 12)
            else:
                found = [n[0] for n in beam_search(model, pad(sources), beam, 0.6, 0.0, 12)]
        return [(h.tokens, h.score) for h in found]

    probes = sentences(6, seed=1)
    alone = [search([s])[0] for s in probes]
    assert len({tuple(t) for t, _ in alone}) > 1  # the model does not say one thing to everything
    for size, seed in ((2, 2), (7, 3), (16, 4)):
        for i, probe in enumerate(probes):
            batch, position = sentences(size - 1, seed=seed + 10 * i), i % size
            batch.insert(position, probe)
            assert search(batch)[position][0] == alone[i][0], (size, i)
            shorter = [s[: len(probe)] for s in batch]  # the same padding as alone
            assert search(shorter)[position] == alone[i], (size, i)
