"""The model against the paper's formulas and the invariances a Transformer must hold."""

import math

import pytest
import torch
import torch.nn.functional as F

from nmt.config import ModelConfig
from nmt.model import CACHE_BLOCK, Transformer, attention, count_parameters, sinusoidal_positions
from nmt.tokens import PAD

# numerics: trains or compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = pytest.mark.numerics

TINY = ModelConfig(encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64, heads=4, dropout=0.0)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**TINY.__dict__, **overrides})
    return Transformer(cfg, vocab_size=40).eval()


def test_positional_encoding_is_the_papers_formula():
    d = 16
    pe = sinusoidal_positions(50, d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_embeddings_are_scaled_by_sqrt_d_and_shared_with_the_output_projection():
    model = tiny_model()
    tokens = torch.tensor([[5, 6, 7]])
    expected = model.embed.weight[tokens] * math.sqrt(32) + sinusoidal_positions(3, 32)
    assert torch.allclose(model.embed_tokens(tokens), expected, atol=1e-6)
    y = torch.randn(2, 32)
    assert torch.allclose(model.output(y), y @ model.embed.weight.T, atol=1e-5)
    # one matrix, not three: source, target and pre-softmax weights are the same parameter
    assert sum(p is model.embed.weight for p in model.parameters()) == 1


def test_a_model_given_its_weights_holds_them_and_computes_as_one_loaded_by_copy():
    ref = tiny_model(seed=3)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    state["embed.weight"] = state["embed.weight"].double()  # another dtype: converted, as a copy would be
    rng = torch.get_rng_state()
    model = Transformer.with_weights(ref.cfg, 40, state).eval()
    assert torch.equal(torch.get_rng_state(), rng)  # no random initialisation ran
    # the state's own tensors: a large model's weights are not held twice while it loads
    fc1 = model.encoder[0].ffn.fc1.weight
    assert fc1.data_ptr() == state["encoder.0.ffn.fc1.weight"].data_ptr() and fc1.requires_grad
    assert model.embed.weight.dtype == torch.float32
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    assert torch.equal(model.positions, ref.positions)
    src, tgt = torch.tensor([[5, 6, 7, 2], [8, 9, 2, PAD]]), torch.tensor([[1, 5, 6], [1, 7, PAD]])
    assert torch.equal(model(src, tgt), ref(src, tgt))
    # names and shapes are checked as by a copy
    with pytest.raises(RuntimeError, match="Missing key"):
        missing = {k: v for k, v in state.items() if k != "encoder.0.ffn.fc1.bias"}
        Transformer.with_weights(ref.cfg, 40, missing)
    with pytest.raises(RuntimeError, match="size mismatch"):
        Transformer.with_weights(ref.cfg, 40, {**state, "encoder.0.ffn.fc1.weight": torch.zeros(3, 3)})


def test_attention_heads_follow_d_model_over_h():
    model = tiny_model()
    attn = model.encoder[0].self_attn
    assert attn.heads == 4 and attn.d_head == 8


def test_later_target_tokens_never_change_earlier_decoder_outputs():
    model = tiny_model()
    src = torch.randint(4, 40, (2, 6))
    tgt = torch.randint(4, 40, (2, 8))
    changed = tgt.clone()
    changed[:, 5:] = torch.randint(4, 40, (2, 3))
    a, b = model(src, tgt), model(src, changed)
    assert torch.allclose(a[:, :5], b[:, :5], atol=1e-5)
    assert not torch.allclose(a[:, 5:], b[:, 5:], atol=1e-3)


def test_padding_never_changes_non_pad_outputs():
    model = tiny_model()
    src = torch.randint(4, 40, (1, 5))
    tgt = torch.randint(4, 40, (1, 4))
    padded_src = torch.cat([src, torch.full((1, 3), PAD)], dim=1)
    padded_tgt = torch.cat([tgt, torch.full((1, 2), PAD)], dim=1)
    base = model(src, tgt)
    padded = model(padded_src, padded_tgt)
    assert torch.allclose(base, padded[:, :4], atol=1e-5)
    # and the encoder output of real tokens ignores the padding too
    assert torch.allclose(model.encode(src)[0], model.encode(padded_src)[0][:, :5], atol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_incremental_decoding_equals_full_recomputation(norm):
    model = tiny_model(norm=norm)
    src = torch.randint(4, 40, (3, 7))
    src[1, 4:] = PAD
    tgt = torch.randint(4, 40, (3, 6))
    full = model(src, tgt)
    memory, keep = model.encode(src)
    state = model.init_state(memory, keep, max_len=10)
    steps = []
    for t in range(tgt.shape[1]):
        logits, state = model.step(tgt[:, t], state)
        steps.append(logits)
    assert torch.allclose(torch.stack(steps, 1), full, atol=1e-5)


def test_written_out_attention_is_the_fused_kernels():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 2, 16), torch.randn(3, 4, 9, 16), torch.randn(3, 4, 9, 16)
    bias = torch.zeros(3, 1, 1, 9)
    bias[1, :, :, 6:] = float("-inf")
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert torch.allclose(attention(q, k, v, bias), want, atol=1e-6)
    assert torch.allclose(attention(q, k, v, None), F.scaled_dot_product_attention(q, k, v), atol=1e-6)


@torch.no_grad()  # the incremental contract is for inference: its caches never need gradients
def test_reorder_and_select_rows_move_the_cache_with_the_rows():
    model = tiny_model()
    src = torch.randint(4, 40, (2, 5)).repeat_interleave(2, 0)  # 2 sentences x 2 rows
    tgt = torch.randint(4, 40, (4, 3))
    memory, keep = model.encode(src)
    state = model.init_state(memory, keep, max_len=8)
    for t in range(2):
        _, state = model.step(tgt[:, t], state)
    # row 0 takes row 1's history (same sentence); then only sentence 2 is kept
    state = model.reorder_beams(state, torch.tensor([1, 1, 2, 3]))
    state = model.select_rows(state, torch.tensor([0, 3]))
    logits, _ = model.step(tgt[[1, 3], 2], state)
    expected = model(src[[1, 3]], tgt[[1, 3]])[:, 2]
    assert torch.allclose(logits, expected, atol=1e-5)


@torch.no_grad()
def test_expand_beams_widens_one_row_per_sentence_to_a_beam():
    """Beam search's step 0 runs one row per sentence; each row then becomes `beam` rows with its history,
    which step on (and reorder) as a state made with that beam from the start."""
    model, g = tiny_model(), torch.Generator().manual_seed(1)
    src = torch.randint(4, 40, (2, 5), generator=g)
    memory, keep = model.encode(src)
    narrow = model.init_state(memory, keep, max_len=6, beam=1)
    wide = model.init_state(memory, keep, max_len=6, beam=3)
    bos = torch.full((2,), 2)
    first, narrow = model.step(bos, narrow)
    _, wide = model.step(bos.repeat_interleave(3), wide)
    narrow = model.expand_beams(narrow, 3)
    assert narrow.beam == 3 and narrow.rows == 6 and narrow.spare.numel() == 0  # no buffer kept between steps
    tokens = torch.randint(4, 40, (6,), generator=g)
    for t in range(3):
        got, narrow = model.step(tokens, narrow)
        want, wide = model.step(tokens, wide)
        assert torch.allclose(got, want, atol=1e-5), t  # F.linear's last bits depend on the row count
        moves = torch.tensor([2, 0, 0, 4, 5, 3])  # within each sentence
        narrow, wide = model.reorder_beams(narrow, moves), model.reorder_beams(wide, moves)
        tokens = tokens[moves]
    assert torch.allclose(first, model(src, bos[:, None])[:, 0], atol=1e-5)


@torch.no_grad()
def test_the_cache_grows_past_its_blocks_while_rows_move():
    """Two rows a sentence, reordered every step, a sentence dropped, over several cache blocks: every
    step's logits are those of the whole history recomputed, the cache holds no more positions than it
    needs, and no layer's buffer is kept beyond the caches between steps (DecoderState)."""
    model, g = tiny_model(), torch.Generator().manual_seed(0)
    src = torch.randint(4, 40, (3, 6), generator=g)
    steps = 2 * CACHE_BLOCK + 3
    memory, keep = model.encode(src)
    state = model.init_state(memory, keep, max_len=steps, beam=2)  # 3 sentences x 2 rows
    sources = src.repeat_interleave(2, 0)
    history = torch.full((6, 1), 2)  # BOS
    for t in range(steps):
        logits, state = model.step(history[:, -1], state)
        expected = model(sources, history)[:, -1]
        assert torch.allclose(logits, expected, atol=1e-5), t
        assert all(kv.shape[3] <= t + CACHE_BLOCK for kv in state.self_kv)
        history = torch.cat([history, torch.randint(4, 40, (len(history), 1), generator=g)], 1)
        n = len(history)
        moves = torch.randint(0, 2, (n,), generator=g) + torch.arange(n) // 2 * 2  # within each sentence
        if t == CACHE_BLOCK + 1:  # the first sentence leaves, in the same gather as a reorder
            moves = moves[2:]
            sources = sources[2:]
            state = model.select_rows(state, moves)
        elif t < steps - 1:
            state = model.reorder_beams(state, moves)
        history = history[moves] if t < steps - 1 else history
        assert state.spare.numel() == 0 and state.spare.shape[3] == state.self_kv[0].shape[3], t
    with pytest.raises(ValueError, match="past"):
        model.step(history[:, -1], state)


@torch.no_grad()
def test_a_full_cache_grows_in_the_gather_that_moves_its_rows(monkeypatch):
    """Rows reordered after every step: the caches grow in the reorder's copy, never in a copy of their
    own, and every step reads them at the capacities that growing at the step gives (and so the same
    shapes, and bits, as the scripted loops)."""
    model, g = tiny_model(), torch.Generator().manual_seed(1)
    src = torch.randint(4, 40, (2, 5), generator=g)
    steps = 3 * CACHE_BLOCK + 1
    memory, keep = model.encode(src)
    plain = model.init_state(memory, keep, max_len=steps, beam=2)
    moved = model.init_state(memory, keep, max_len=steps, beam=2)
    tokens = torch.randint(4, 40, (steps, 4), generator=g)
    plain_capacities = []
    for t in range(steps):
        _, plain = model.step(tokens[t], plain)
        plain_capacities.append(plain.self_kv[0].shape[3])
    grown = []
    monkeypatch.setattr(model, "grow_cache", lambda state, capacity: grown.append(capacity))
    moves = torch.tensor([1, 0, 2, 3])  # within each sentence
    for t in range(steps):
        _, moved = model.step(tokens[t], moved)
        assert [kv.shape[3] for kv in moved.self_kv] == [plain_capacities[t]] * len(moved.self_kv), t
        if t < steps - 1:
            moved = model.reorder_beams(moved, moves)
    assert grown == []
    assert plain_capacities[-1] == steps and len(set(plain_capacities)) == 4  # it grew three times


@torch.no_grad()
def test_a_gather_moves_exactly_the_filled_positions_of_its_rows():
    """Each layer's cache after a reorder or a selection holds, in its first rows, the filled positions of
    the rows taken, bit for bit: where the capacity stays (rows moved whole, their unfilled positions
    too), where it grows, and where sentences leave so that a layer's buffer has more rows than the batch."""
    model, g = tiny_model(), torch.Generator().manual_seed(2)
    src = torch.randint(4, 40, (3, 6), generator=g)
    steps = 2 * CACHE_BLOCK + 2
    memory, keep = model.encode(src)
    state = model.init_state(memory, keep, max_len=steps, beam=2)  # 3 sentences x 2 rows
    paths = set()
    for t in range(steps - 1):
        _, state = model.step(torch.randint(4, 40, (state.rows,), generator=g), state)
        n = state.rows
        rows = torch.randint(0, 2, (n,), generator=g) + torch.arange(n) // 2 * 2  # within each sentence
        before = [kv[:, :, :, : t + 1].clone() for kv in state.self_kv]
        grows = state.length == state.self_kv[0].shape[3]
        if t in (1, CACHE_BLOCK - 1) and n > 2:  # a sentence leaves: at a step that keeps, and one that grows
            rows = rows[2:]
            state = model.select_rows(state, rows)
        else:
            state = model.reorder_beams(state, rows)
        for old, kv in zip(before, state.self_kv, strict=True):
            assert torch.equal(kv[:, : len(rows), :, : t + 1], old[:, rows]), t
        paths.add((grows, n == len(rows)))
    assert paths == {(False, True), (True, True), (False, False), (True, False)}  # every path ran


def test_parameter_counts_of_the_paper_models():
    """Base and big with the 37000-subword joint vocabulary (paper: 65M and 213M)."""
    base = ModelConfig()
    big = ModelConfig(d_model=1024, d_ff=4096, heads=16, dropout=0.3)
    with torch.device("meta"):
        assert count_parameters(Transformer(base, 37000)) == 63_082_496
        assert count_parameters(Transformer(big, 37000)) == 214_245_376
