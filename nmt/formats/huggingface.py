"""Hugging Face model folders to and from nmt checkpoints: MarianMT, the format of the OPUS-MT models,
for post-norm models, and Pegasus for pre-norm ones.

A MarianMT folder holds config.json, the weights (model.safetensors, or pytorch_model.bin from older
uploads), source.spm and target.spm (one SentencePiece model per language) and vocab.json (their pieces'
ids in the one vocabulary both share), tokenizer_config.json and generation_config.json. Its model is the
paper's (transformers' models/marian/modeling_marian.py): post-LayerNorm layers, sinusoidal positions,
embeddings scaled by sqrt(d_model), one embedding matrix for source, target and output. Pre-norm models
(`norm: pre`) go to the one architecture of transformers that differs from it exactly there
(models/pegasus/modeling_pegasus.py, PegasusForConditionalGeneration): LayerNorm in front of each
sub-layer, one LayerNorm after each stack (encoder.layer_norm, decoder.layer_norm: nmt's encoder_norm and
decoder_norm), everything else as in Marian, code copied from it (the same sinusoid, embedding scale,
attention, tied embeddings, final_logits_bias; no layernorm_embedding). Its folder is a MarianMT folder
but for config.json (model_type pegasus) and the weights (the two final norms, and the position tables,
which Pegasus loads rather than computes); its tokenizer stays MarianTokenizer, which
tokenizer_config.json names, so AutoTokenizer loads it. BART and mBART are no alternative: their
positions are learned, offset by 2, and mBART adds a LayerNorm on the embeddings. What differs from nmt,
and how each difference is carried over exactly, in both layouts:

- Positions: transformers lays the sinusoid out as [sin of every frequency | cos of every frequency], the
  paper interleaves sin and cos (3.5). That is a fixed permutation of the model dimension, and every
  operation on the residual stream (embedding, LayerNorm, the linear maps in and out of it) commutes with
  one, so the weights are permuted along it and nmt's model keeps the paper's layout (`residual_order`).
- Q, K and V are three projections there; nmt fuses Q, K, V (self-attention) and K, V (cross-attention).
- `final_logits_bias` becomes the model's `output_bias` (model.output_bias), a fixed buffer in both.
- `activation_function` relu or swish becomes model.activation.
- Token ids: nmt reserves PAD 0, UNK 1, BOS 2, EOS 3 (nmt.tokens); OPUS-MT has </s> 0, <unk> 1 and <pad>
  last, and starts decoding from <pad>. Tools written for OPUS-MT folders assume that layout
  (CTranslate2's converter drops the last row and starts from a zero vector), so the export writes it
  (`marian_order`): </s>, <unk>, the other pieces in nmt's order, then <pad>, whose row holds the vector
  nmt's decoder starts from (BOS's row, or zeros for `model.decoder_start: zero`). nmt's own PAD row,
  which no real position reads and search never emits, is left out. On import the vocabulary is
  reordered into nmt's layout (`token_order`): the decoder's start token becomes BOS, and where it was
  also the padding token (always, in OPUS-MT) a new zero row is PAD, with an output bias of
  ABSENT_LOGIT, so low that its probability is 0 in float32 and every other token's log-probability is
  unchanged. The two SentencePiece models and the reordered vocabulary travel together as one
  nmt.subword.Subword.

Every nmt model exports, to one layout or the other. On import, what nmt's model cannot hold is refused in
one line: separate source and target vocabularies, untied output embeddings, unscaled embeddings,
learned positions, other activations, and encoder and decoder of different widths. Neither direction
needs transformers: the files are read and written here (safetensors for the weights).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from nmt.atomic import atomic_folder, check_replaceable, refuse_inputs
from nmt.checkpoint import load_checkpoint, save_checkpoint
from nmt.config import Config, DecodeConfig, ModelConfig, config_from_dict, config_to_dict
from nmt.errors import CheckpointError, NmtError
from nmt.formats import META_FILE, validate
from nmt.formats.model_card import model_card
from nmt.languages import short, tag_language
from nmt.model import sinusoidal_positions
from nmt.subword import Subword
from nmt.tokens import BOS, EOS, PAD, UNK

ABSENT_LOGIT = -100.0  # the output bias of a token the original model did not have: exp(-100) is 0 here
MARIAN_EOS = 0  # </s> in OPUS-MT's layout (marian_order)
MARIAN_PAD = "<pad>"  # the last token, which pads and starts the decoder
META_FORMAT = "nmt-huggingface"
ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish"}  # transformers' name -> model.activation


@dataclasses.dataclass(frozen=True)
class Layout:
    """A transformers architecture that holds nmt's model of one model.norm exactly."""

    model_type: str  # config.json's model_type, which chooses the layout on import
    architecture: str  # config.json's architectures: the class AutoModelForSeq2SeqLM builds
    norm: str  # model.norm


MARIAN = Layout("marian", "MarianMTModel", "post")
PEGASUS = Layout("pegasus", "PegasusForConditionalGeneration", "pre")
LAYOUTS = {layout.model_type: layout for layout in (MARIAN, PEGASUS)}


def layout_of(m: ModelConfig) -> Layout:
    return next(layout for layout in LAYOUTS.values() if layout.norm == m.norm)


def residual_order(d_model: int) -> Tensor:
    """transformers' coordinate j of the residual stream is nmt's coordinate order[j]:
    [0, 2, 4, .., 1, 3, 5, ..], its sin half then its cos half of the paper's interleaved sinusoid."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


# ---------------------------------------------------------------------------------------------------------
# nmt -> Hugging Face


def export_huggingface(
    model_path: Path,
    output: Path,
    force: bool = False,
    license: str | None = None,
    note: Callable[[str], None] | None = None,
) -> Path:
    """`nmt export --format huggingface`: the checkpoint as a MarianMT folder (a Pegasus one for a
    pre-norm model) in OPUS-MT's layout, with a model card (README.md, `license` its licence); returns
    it. `note` receives what a user should know about the folder in other tools, one line each.

    Built under a temporary name beside `output` and renamed at the end; an existing `output` is replaced
    only with `force` and only when an earlier export wrote it.
    """
    check_replaceable(output, force, META_FILE)
    ckpt = load_checkpoint(model_path)
    m = ckpt.config.model
    layout = layout_of(m)
    subword = Subword(ckpt.subword_proto)
    pieces = subword.pieces()
    if len(pieces) != ckpt.vocab_size:
        raise NmtError(f"{model_path}: {len(pieces)} subwords but the model has {ckpt.vocab_size} rows")

    order = marian_order(ckpt.vocab_size)
    names = marian_pieces(pieces, order, model_path)
    tags = target_tags(subword)
    card = model_card(ckpt.config, Path(model_path), license, tags)
    with atomic_folder(output) as folder:
        folder.mkdir()
        save_safetensors(folder / "model.safetensors", hf_weights(ckpt.model_state, m, order))
        size = len(order)
        write_json(folder / "config.json", hf_config(layout, m, size))
        generation = generation_config(ckpt.config.decode, m, size, ckpt.config.data.max_subwords)
        write_json(folder / "generation_config.json", generation)
        write_json(folder / "vocab.json", {piece: i for i, piece in enumerate(names)})
        (folder / "source.spm").write_bytes(subword.source_proto)
        (folder / "target.spm").write_bytes(subword.target_proto)
        write_json(folder / "tokenizer_config.json", tokenizer_config(ckpt.config, names, tags))
        (folder / "README.md").write_text(card, encoding="utf-8")
        write_json(
            folder / META_FILE,
            {
                "format": META_FORMAT,
                "version": 2,  # 2: OPUS-MT's layout (pad last, the start token); 1 kept nmt's ids
                "source": Path(model_path).name,  # no path of the machine that made it
                "config": config_to_dict(ckpt.config),
            },
        )
    if note is not None and tags:
        note(
            f"{output} translates into {', '.join(short(tag_language(t) or t) for t in tags)}: each line "
            f"starts with its tag ({', '.join(tags)}), e.g. '{tags[0]} A sentence.' (`nmt translate "
            "--target` adds it)"
        )
    if note is not None and ckpt.shortlist is not None:
        note(
            f"{model_path} carries a lexical shortlist, which {output} does not: transformers decodes over "
            "the whole vocabulary (`nmt export --format ctranslate2` writes it as vmap.txt)"
        )
    if note is not None and m.decoder_start == "bos" and layout is MARIAN:
        note(
            f"{model_path} starts its decoder from a learned BOS vector: transformers and ONNX read "
            f"{output} exactly, but CTranslate2's ct2-transformers-converter will start from a zero vector "
            "(Marian's convention); `nmt export --format ctranslate2` is exact"
        )
    return output


def target_tags(subword: Subword) -> list[str]:
    """The target tags of a model of several targets (`>>fra<<`, ...), in id order; [] for one target."""
    return [tag for tag in subword.tags if tag_language(tag) is not None]


def tokenizer_config(cfg: Config, names: list[str], tags: list[str]) -> dict:
    """tokenizer_config.json: MarianTokenizer over the exported vocabulary `names` (marian_order).

    A model of several targets has its tags in vocab.json, as OPUS-MT's multi-target models do, which
    MarianTokenizer lists as its `supported_language_codes` and reads whole at a line's start (`>>fra<<
    text` is [>>fra<<] + the text's pieces + [</s>]: nmt's ids). They are its additional special tokens
    too, in both layouts (a Pegasus folder has MarianTokenizer as well): that rule wants the tag at the
    very first character and splits `  >>fra<< text` into pieces, where nmt reads the tag after spaces
    too; and decoding with skip_special_tokens never writes one. The price: transformers also reads a
    tag typed mid-line, which nmt reads as text.
    """
    config = {
        "tokenizer_class": "MarianTokenizer",
        "source_lang": cfg.data.src_lang,
        "target_lang": cfg.data.tgt_lang,
        "unk_token": names[1],
        "eos_token": names[0],
        "pad_token": names[-1],
        "model_max_length": cfg.model.max_positions,
        "separate_vocabs": False,
    }
    if tags:
        config["additional_special_tokens"] = list(tags)
    return config


def marian_order(vocab_size: int) -> list[int]:
    """OPUS-MT's layout of nmt's vocabulary: exported row i is nmt's row order[i]. </s> 0, <unk> 1, the
    other pieces in nmt's order, and last the decoder's start token, which OPUS-MT also pads with (its
    row is what nmt's decoder starts from: hf_weights). nmt's PAD row has no place: padding is masked
    wherever it is read, and neither engine emits it; only its share of the softmax, which training
    drives to almost nothing, is gone (greedy choices cannot change; beam scores only in the last
    digits)."""
    return [EOS, UNK, *range(EOS + 1, vocab_size), BOS]


def marian_pieces(pieces: list[str], order: list[int], model_path: Path) -> list[str]:
    """The exported vocabulary's pieces in id order: nmt's, the start token named <pad> as in OPUS-MT
    (CTranslate2's converter finds the row it drops by that name)."""
    names = [pieces[i] for i in order[:-1]] + [MARIAN_PAD]
    if MARIAN_PAD in names[:-1]:
        raise NmtError(f"{model_path}: the subword {MARIAN_PAD!r} is an ordinary piece; OPUS-MT reserves it")
    return names


def hf_weights(w: dict[str, Tensor], m: ModelConfig, tokens: list[int]) -> dict[str, Tensor]:
    """nmt's state dict as MarianMTModel's, or PegasusForConditionalGeneration's for a pre-norm model
    (model.safetensors names), the residual stream permuted and the vocabulary in the order `tokens`
    (marian_order: its last row is the decoder's start)."""
    order = residual_order(m.d_model)
    d = m.d_model
    out: dict[str, Tensor] = {}

    def into(name: str, weight: Tensor, bias: Tensor) -> None:  # a map into the residual stream
        out[f"{name}.weight"], out[f"{name}.bias"] = weight[order], bias[order]

    def norm(name: str, source: str) -> None:
        into(name, w[f"{source}.weight"], w[f"{source}.bias"])

    def attention(name: str, source: str, cross: bool) -> None:
        if cross:
            q, qb = w[f"{source}.q_proj.weight"], w[f"{source}.q_proj.bias"]
            k, v = w[f"{source}.kv_proj.weight"].split(d)  # (D, D) each
            kb, vb = w[f"{source}.kv_proj.bias"].split(d)
        else:
            q, k, v = w[f"{source}.qkv_proj.weight"].split(d)
            qb, kb, vb = w[f"{source}.qkv_proj.bias"].split(d)
        for proj, weight, bias in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
            out[f"{name}.{proj}.weight"], out[f"{name}.{proj}.bias"] = weight[:, order], bias
        into(f"{name}.out_proj", w[f"{source}.out_proj.weight"], w[f"{source}.out_proj.bias"])

    def ffn(name: str, source: str) -> None:
        out[f"{name}.fc1.weight"], out[f"{name}.fc1.bias"] = (
            w[f"{source}.fc1.weight"][:, order],
            w[f"{source}.fc1.bias"],
        )
        into(f"{name}.fc2", w[f"{source}.fc2.weight"], w[f"{source}.fc2.bias"])

    for i in range(m.encoder_layers):
        p, s = f"model.encoder.layers.{i}", f"encoder.{i}"
        attention(f"{p}.self_attn", f"{s}.self_attn", cross=False)
        norm(f"{p}.self_attn_layer_norm", f"{s}.res_attn.norm")
        ffn(p, f"{s}.ffn")
        norm(f"{p}.final_layer_norm", f"{s}.res_ffn.norm")
    for i in range(m.decoder_layers):
        p, s = f"model.decoder.layers.{i}", f"decoder.{i}"
        attention(f"{p}.self_attn", f"{s}.self_attn", cross=False)
        norm(f"{p}.self_attn_layer_norm", f"{s}.res_self.norm")
        attention(f"{p}.encoder_attn", f"{s}.cross_attn", cross=True)
        norm(f"{p}.encoder_attn_layer_norm", f"{s}.res_cross.norm")
        ffn(p, f"{s}.ffn")
        norm(f"{p}.final_layer_norm", f"{s}.res_ffn.norm")
    if m.norm == "pre":  # Pegasus: one LayerNorm after each stack, and the position tables it loads
        norm("model.encoder.layer_norm", "encoder_norm")
        norm("model.decoder.layer_norm", "decoder_norm")
        table = sinusoidal_positions(m.max_positions, d)[:, order]  # (P, D): nmt's own numbers
        out["model.encoder.embed_positions.weight"] = table
        out["model.decoder.embed_positions.weight"] = table.clone()  # safetensors stores no shared tensor
    embed = w["embed.weight"]
    rows = torch.tensor(tokens)
    shared = embed[rows][:, order]  # (V', D); tied to both stacks' embed_tokens and lm_head
    if m.decoder_start == "zero":
        shared[-1] = 0.0  # the start row: what nmt's decoder embeds at its first position
    out["model.shared.weight"] = shared
    bias = w.get("output_bias", torch.zeros(embed.shape[0], dtype=embed.dtype))
    out["final_logits_bias"] = bias[rows][None, :]  # (1, V')
    return {k: v.float().contiguous() for k, v in out.items()}


def hf_config(layout: Layout, m: ModelConfig, vocab_size: int) -> dict:
    """config.json: MarianConfig's (or PegasusConfig's) fields for this model in OPUS-MT's layout
    (marian_order): </s> 0, and the last token both pads and starts the decoder."""
    start = vocab_size - 1
    if layout is MARIAN:
        own = {"decoder_vocab_size": vocab_size, "share_encoder_decoder_embeddings": True}
    else:  # what the Hub's Pegasus configs say, and CTranslate2's converter reads (transformers does not)
        own = {"normalize_before": True, "normalize_embedding": False, "add_final_layer_norm": True}
        own |= marian_refusal(vocab_size)
    return {
        "architectures": [layout.architecture],
        "model_type": layout.model_type,
        "vocab_size": vocab_size,
        **own,
        "tie_word_embeddings": True,
        "d_model": m.d_model,
        "encoder_layers": m.encoder_layers,
        "decoder_layers": m.decoder_layers,
        "encoder_ffn_dim": m.d_ff,
        "decoder_ffn_dim": m.d_ff,
        "encoder_attention_heads": m.heads,
        "decoder_attention_heads": m.heads,
        "activation_function": m.activation,
        "dropout": m.dropout,
        "attention_dropout": m.attention_dropout,
        "activation_dropout": m.activation_dropout,
        "max_position_embeddings": m.max_positions,
        "scale_embedding": True,
        "pad_token_id": start,
        "eos_token_id": MARIAN_EOS,
        "forced_eos_token_id": MARIAN_EOS,
        "decoder_start_token_id": start,
        "bos_token_id": None,
        "is_encoder_decoder": True,
    }


def marian_refusal(vocab_size: int) -> dict:
    """Two keys of MarianConfig that PegasusConfig does not read, so that `MarianMTModel.from_pretrained`
    of a Pegasus folder (what OPUS-MT users type by habit) fails instead of returning garbage.

    transformers only warns when config.json's model_type is not the class's ("a model of type pegasus
    to instantiate a model of type marian"), then loads the weights into post-norm layers with no final
    norms: a model that answers ",,,,,,,". MarianConfig reads these two keys as a target vocabulary of
    its own one row larger than the weights', so MarianMTModel's output bias cannot take them: loading
    stops with a size mismatch, right after that warning. PegasusConfig keeps them as inert attributes;
    the Auto classes, pipeline, optimum's ONNX export and CTranslate2's converter read no such key.
    """
    return {"share_encoder_decoder_embeddings": False, "decoder_vocab_size": vocab_size + 1}


def generation_config(d: DecodeConfig, m: ModelConfig, vocab_size: int, max_source: int) -> dict:
    """The checkpoint's decode settings as far as transformers' generate expresses them, and no flag that
    a greedy call ignores (transformers warns about such a flag at every call).

    The output limit: nmt allows floor(a * |x| + b) tokens before the EOS (decode.max_len_a, max_len_b,
    |x| the source's subwords), within the positions. transformers' limits are absolute, so max_length
    is that rule at the longest source the model was trained on (data.max_subwords: longer pairs were
    dropped), plus the start token and the EOS: every source of the training data gets at least the
    room nmt gives it, and a model that loops stops there (306 tokens by default), not at its positions.

    The length penalty: nmt's is GNMT's ((5 + |Y|) / 6)^alpha, transformers' |Y|^length_penalty, a
    different formula, and a length_penalty in this file makes every greedy call (num_beams=1, as on a
    CPU) warn that it is unused. So none is written: beam search in transformers normalises by |Y|.
    """
    start = vocab_size - 1
    limit = min(math.floor(d.max_len_a * max_source + d.max_len_b), m.max_positions - 1)
    config = {
        "decoder_start_token_id": start,
        "pad_token_id": start,
        "eos_token_id": MARIAN_EOS,
        "forced_eos_token_id": MARIAN_EOS,
        "bad_words_ids": [[start]],  # nmt's search never emits its start token (nor PAD, left out)
        "max_length": limit + 2,  # the start token, the output, its EOS (nmt.translate.search.output_limits)
        "min_new_tokens": d.min_len,
    }
    if d.sampling:
        config.update(do_sample=True, top_k=d.sampling_topk, top_p=d.sampling_topp, temperature=d.temperature)
        if d.nbest > 1:
            config["num_return_sequences"] = d.nbest
        return config
    config["num_beams"] = d.beam
    if d.beam > 1 and d.nbest > 1:  # greedy search returns one sequence
        config["num_return_sequences"] = d.nbest
    if d.no_repeat_ngram_size > 0:
        config["no_repeat_ngram_size"] = d.no_repeat_ngram_size
    return config


# ---------------------------------------------------------------------------------------------------------
# Hugging Face -> nmt


def import_huggingface(
    folder: Path,
    output: Path,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
    force: bool = False,
) -> Path:
    """`nmt import`: a MarianMT folder, or a Pegasus one with MarianMT's tokenizer files (config.json's
    model_type chooses), as one nmt checkpoint (weights, config, subwords); returns it. An existing
    `output` is replaced only with `force`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise NmtError(
            f"{folder}: no such folder (a MarianMT model folder holds config.json, vocab.json, ...)"
        )
    refuse_inputs(output, [folder])  # `-o FOLDER/model.safetensors` would replace what is read
    if Path(output).exists() and not force:  # before the work: the checkpoint may be a trained model
        raise NmtError(f"{output} already exists; add --force to replace it")
    hf = read_json(folder / "config.json")
    validate.check_config(hf, folder / "config.json")  # every size bounded before anything is built
    model_cfg = model_config(hf, folder / "config.json")
    meta = read_json(folder / META_FILE) if (folder / META_FILE).is_file() else {}
    validate.check_meta(meta, folder / META_FILE)
    tokenizer = (
        read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").exists() else {}
    )
    validate.check_strings(
        tokenizer, ("unk_token", "source_lang", "target_lang"), folder / "tokenizer_config.json"
    )
    if tokenizer.get("separate_vocabs") or (folder / "target_vocab.json").exists():
        raise NmtError(
            f"{folder}: separate source and target vocabularies are not supported (target_vocab.json)"
        )
    vocab = read_json(folder / "vocab.json")
    pieces = vocabulary_pieces(vocab, hf["vocab_size"], folder / "vocab.json")
    ids = {
        "pad": hf.get("pad_token_id"),
        "unk": vocab.get(tokenizer.get("unk_token", "<unk>")),
        "start": hf.get("decoder_start_token_id", hf.get("pad_token_id")),
        "eos": hf.get("eos_token_id"),
    }
    order = token_order(ids, len(pieces), folder)
    nmt_pieces = [pieces[i] if i is not None else unused_piece("<pad>", pieces) for i in order]
    if ids["start"] == ids["pad"]:  # the start token was also the padding: it has a name of its own now
        nmt_pieces[BOS] = unused_piece("<s>", pieces)
    (source, source_sp), (target, target_sp) = (
        validate.read_sentencepiece(folder / name) for name in ("source.spm", "target.spm")
    )
    validate.check_pieces(vocab, folder / "vocab.json", source_sp, folder / "source.spm")
    validate.check_pieces(vocab, folder / "vocab.json", target_sp, folder / "target.spm")
    subword = Subword.pair(source, target, nmt_pieces)
    weights = validate.checked_weights(folder, hf, read_weights)
    state = nmt_weights(weights, model_cfg, hf, order, folder)

    saved = meta.get("config", {})
    src = src_lang or saved.get("data", {}).get("src_lang") or tokenizer.get("source_lang")
    tgt = tgt_lang or saved.get("data", {}).get("tgt_lang") or tokenizer.get("target_lang")
    if not src or not tgt:
        raise NmtError(f"{folder}: its languages are not recorded; give --src-lang and --tgt-lang")
    data = {"src_lang": src, "tgt_lang": tgt, "train": [], "valid": [], "vocab_size": len(nmt_pieces)}
    data["subword_type"] = saved.get("data", {}).get("subword_type", "unigram")
    decode = saved.get("decode") or marian_decode(folder)
    model, state = exported_model(dataclasses.asdict(model_cfg), state, meta)
    config = config_from_dict(
        {"data": data, "model": model, "decode": decode},
        source=str(folder),
        corpora=False,
    )
    save_checkpoint(
        Path(output),
        model_state=state,
        config=config,
        subword_proto=subword.proto,
        vocab_size=len(nmt_pieces),
    )
    return Path(output)


def exported_model(model: dict, state: dict[str, Tensor], meta: dict) -> tuple[dict, dict[str, Tensor]]:
    """The model keys and weights of a folder that nmt exported in OPUS-MT's layout (nmt-meta version
    2) as the checkpoint it came from; any other folder's unchanged.

    model.decoder_start is the exported model's (its start row holds that vector either way, so both
    read it alike; other folders start from their start token's row: bos). The PAD row, left out of the
    export and new again here, gets back the zero output bias nmt's own PAD has, and a model that had no
    output bias has none again: so its log-probabilities, and beam search's choices, are the original's.
    """
    config = meta.get("config") if meta.get("format") == META_FORMAT else None
    saved = config.get("model") if isinstance(config, dict) else None
    if not isinstance(saved, dict) or meta.get("version") != 2:
        return model | {"decoder_start": "bos"}, state
    model = model | {"decoder_start": saved.get("decoder_start", "bos")}
    if saved.get("output_bias") is False:
        bias = state["output_bias"].clone()
        bias[PAD] = 0.0
        if not bias.any():
            state = {k: v for k, v in state.items() if k != "output_bias"}
            model["output_bias"] = False
    return model, state


def model_config(hf: dict, path: Path) -> ModelConfig:
    """config.json as model keys; one line naming the key for what nmt's model cannot be."""

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise NmtError(f"{path}: {key} {hf.get(key)!r}: {why}")

    need(hf.get("model_type") in LAYOUTS, "model_type", "not a MarianMT or Pegasus model")
    layout = LAYOUTS[hf["model_type"]]
    for key in ("d_model", "encoder_layers", "decoder_layers", "encoder_ffn_dim", "vocab_size"):
        need(isinstance(hf.get(key), int) and hf[key] > 0, key, "expected a positive integer")
    need(
        hf.get("decoder_ffn_dim", hf["encoder_ffn_dim"]) == hf["encoder_ffn_dim"],
        "decoder_ffn_dim",
        "differs from encoder_ffn_dim; nmt's model has one model.d_ff",
    )
    heads = hf.get("encoder_attention_heads")
    need(
        isinstance(heads, int) and hf.get("decoder_attention_heads", heads) == heads,
        "decoder_attention_heads",
        "differs from encoder_attention_heads; nmt's model has one model.heads",
    )
    need(hf.get("activation_function") in ACTIVATIONS, "activation_function", "not relu or swish")
    need(hf.get("scale_embedding") is True, "scale_embedding", "nmt scales embeddings by sqrt(d_model)")
    if layout is MARIAN:  # Pegasus has neither key; nmt's Pegasus export sets both (MARIAN_REFUSAL)
        need(
            hf.get("share_encoder_decoder_embeddings", True) is True,
            "share_encoder_decoder_embeddings",
            "separate source and target embeddings are not supported",
        )
        need(
            hf.get("decoder_vocab_size") in (None, hf["vocab_size"]),
            "decoder_vocab_size",
            "a target vocabulary of its own is not supported",
        )
    need(hf.get("tie_word_embeddings", True) is True, "tie_word_embeddings", "untied output not supported")
    if layout is MARIAN:  # transformers' Pegasus reads none of them: its layers are what they say
        for key in ("normalize_before", "add_final_layer_norm", "normalize_embedding"):
            need(not hf.get(key), key, "transformers' Marian has no such layers; not a MarianMT config")
    return ModelConfig(
        encoder_layers=hf["encoder_layers"],
        decoder_layers=hf["decoder_layers"],
        d_model=hf["d_model"],
        d_ff=hf["encoder_ffn_dim"],
        heads=heads,
        dropout=float(hf.get("dropout", 0.1)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        activation_dropout=float(hf.get("activation_dropout", 0.0)),
        norm=layout.norm,
        max_positions=int(hf.get("max_position_embeddings", 512)),
        activation=ACTIVATIONS[hf["activation_function"]],
        output_bias=True,
    )


def vocabulary_pieces(vocab: dict, size: int, path: Path) -> list[str]:
    """vocab.json (piece -> id) as the pieces in id order; every id below `size` exactly once."""
    pieces: list[str | None] = [None] * size
    for piece, i in vocab.items():
        if not isinstance(i, int) or not 0 <= i < size or pieces[i] is not None:
            raise NmtError(f"{path}: {piece!r}: id {i!r} is not a free id below vocab_size {size}")
        pieces[i] = piece
    missing = [i for i, p in enumerate(pieces) if p is None]
    if missing:
        raise NmtError(f"{path}: no piece for id {missing[0]} (and {len(missing) - 1} more) of {size}")
    return pieces  # type: ignore[return-value]


def token_order(ids: dict, size: int, folder: Path) -> list[int | None]:
    """Row i of nmt's vocabulary is row order[i] of the MarianMT one (None: a new row).

    nmt's reserved ids first, PAD, UNK, BOS (the decoder's start token), EOS, then every other token in
    its original order. When the start token is also the padding one, PAD is a new row.
    """
    for name, i in ids.items():
        if not isinstance(i, int) or not 0 <= i < size:
            raise NmtError(f"{folder}: the {name} token's id {i!r} is not in the vocabulary of {size}")
    pad = ids["pad"] if ids["pad"] != ids["start"] else None
    reserved = [pad, ids["unk"], ids["start"], ids["eos"]]
    if len({i for i in reserved if i is not None}) != sum(i is not None for i in reserved):
        raise NmtError(f"{folder}: the pad, unk, start and eos tokens must be distinct, got {ids}")
    return reserved + [i for i in range(size) if i not in reserved]


def unused_piece(name: str, pieces: list[str]) -> str:
    while name in pieces:
        name = f"<{name.strip('<>')}_>"
    return name


def read_weights(folder: Path) -> dict[str, Tensor]:
    """model.safetensors, or pytorch_model.bin loaded weights-only (it cannot run code)."""
    st, pt = folder / "model.safetensors", folder / "pytorch_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(st)
        if pt.is_file():
            weights = torch.load(pt, map_location="cpu", weights_only=True)
            if not isinstance(weights, dict):
                raise ValueError("not a state dict")
            return weights
    except Exception as e:  # a truncated or foreign file: one line, not a traceback
        name = st.name if st.is_file() else pt.name
        raise CheckpointError(f"{folder / name}: not readable weights ({str(e)[:120]})") from None
    raise NmtError(f"{folder}: no model.safetensors or pytorch_model.bin")


def nmt_weights(
    w: dict[str, Tensor], m: ModelConfig, hf: dict, order: list[int | None], folder: Path
) -> dict[str, Tensor]:
    """MarianMTModel's (or PegasusForConditionalGeneration's) state dict as nmt's: Q/K/V fused, the
    residual stream and vocabulary reordered."""
    w = {k.removeprefix("model."): v.float() for k, v in w.items()}
    used: set[str] = set()
    inverse = torch.argsort(residual_order(m.d_model))  # nmt coordinate i is transformers' inverse[i]

    def take(name: str) -> Tensor:
        if name not in w:
            raise NmtError(f"{folder}: the weights lack {name}")
        used.add(name)
        return w[name]

    out: dict[str, Tensor] = {}

    def into(name: str, source: str) -> None:  # LayerNorm, or a map into the residual stream
        out[f"{name}.weight"], out[f"{name}.bias"] = (
            take(f"{source}.weight")[inverse],
            take(f"{source}.bias")[inverse],
        )

    def attention(name: str, source: str, cross: bool) -> None:
        q, k, v = (take(f"{source}.{p}_proj.weight")[:, inverse] for p in "qkv")
        qb, kb, vb = (take(f"{source}.{p}_proj.bias") for p in "qkv")
        if cross:
            out[f"{name}.q_proj.weight"], out[f"{name}.q_proj.bias"] = q, qb
            out[f"{name}.kv_proj.weight"], out[f"{name}.kv_proj.bias"] = (
                torch.cat([k, v]),
                torch.cat([kb, vb]),
            )
        else:
            out[f"{name}.qkv_proj.weight"], out[f"{name}.qkv_proj.bias"] = (
                torch.cat([q, k, v]),
                torch.cat([qb, kb, vb]),
            )
        into(f"{name}.out_proj", f"{source}.out_proj")

    def ffn(name: str, source: str) -> None:
        out[f"{name}.fc1.weight"] = take(f"{source}.fc1.weight")[:, inverse]
        out[f"{name}.fc1.bias"] = take(f"{source}.fc1.bias")
        into(f"{name}.fc2", f"{source}.fc2")

    for i in range(m.encoder_layers):
        p, s = f"encoder.{i}", f"encoder.layers.{i}"
        attention(f"{p}.self_attn", f"{s}.self_attn", cross=False)
        into(f"{p}.res_attn.norm", f"{s}.self_attn_layer_norm")
        ffn(f"{p}.ffn", s)
        into(f"{p}.res_ffn.norm", f"{s}.final_layer_norm")
    for i in range(m.decoder_layers):
        p, s = f"decoder.{i}", f"decoder.layers.{i}"
        attention(f"{p}.self_attn", f"{s}.self_attn", cross=False)
        into(f"{p}.res_self.norm", f"{s}.self_attn_layer_norm")
        attention(f"{p}.cross_attn", f"{s}.encoder_attn", cross=True)
        into(f"{p}.res_cross.norm", f"{s}.encoder_attn_layer_norm")
        ffn(f"{p}.ffn", s)
        into(f"{p}.res_ffn.norm", f"{s}.final_layer_norm")
    if m.norm == "pre":  # Pegasus' LayerNorm after each stack
        into("encoder_norm", "encoder.layer_norm")
        into("decoder_norm", "decoder.layer_norm")

    # One embedding matrix, under whichever of its tied names the file kept.
    names = ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"]
    present = [n for n in names if n in w]
    if not present:
        raise NmtError(f"{folder}: the weights lack the embedding matrix (model.shared.weight)")
    embed = w[present[0]]
    for name in present:
        if not torch.equal(w[name], embed):
            raise NmtError(f"{folder}: {name} differs from {present[0]}: untied embeddings are not supported")
        used.add(name)
    if embed.shape != (hf["vocab_size"], m.d_model):
        raise NmtError(
            f"{folder}: {present[0]} is {tuple(embed.shape)}, config.json says vocab_size x d_model"
        )
    bias = w.get("final_logits_bias", torch.zeros(1, hf["vocab_size"])).reshape(-1)
    used.add("final_logits_bias")
    rows = torch.tensor([i if i is not None else 0 for i in order])
    new = torch.tensor([i is None for i in order])
    out["embed.weight"] = embed[rows][:, inverse].masked_fill(new[:, None], 0.0)  # (V', D)
    out["output_bias"] = bias[rows].masked_fill(new, ABSENT_LOGIT)  # (V',)

    for name in ("encoder.embed_positions.weight", "decoder.embed_positions.weight"):
        if name in w:  # older uploads keep the fixed table: it must be the sinusoid nmt computes
            used.add(name)
            table = sinusoidal_positions(w[name].shape[0], m.d_model)[:, residual_order(m.d_model)]
            if w[name].shape != table.shape or not torch.allclose(w[name], table, atol=1e-4):
                raise NmtError(f"{folder}: {name} is not the sinusoid: learned positions are not supported")
    unknown = sorted(set(w) - used)
    if unknown:
        raise NmtError(f"{folder}: weight {unknown[0]} has no place in nmt's model ({len(unknown)} such)")
    return out


def marian_decode(folder: Path) -> dict:
    """The decode keys generation_config.json (or config.json) expresses in nmt's terms."""
    path = folder / "generation_config.json"
    gen = read_json(path) if path.exists() else read_json(folder / "config.json")
    decode: dict = {}
    if isinstance(gen.get("num_beams"), int) and gen["num_beams"] >= 1:
        decode["beam"] = gen["num_beams"]
    if isinstance(gen.get("no_repeat_ngram_size"), int) and gen["no_repeat_ngram_size"] > 0:
        decode["no_repeat_ngram_size"] = gen["no_repeat_ngram_size"]
    return decode


# ---------------------------------------------------------------------------------------------------------
# Files


def read_json(path: Path) -> dict:
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NmtError(
            f"{path}: missing (a MarianMT folder needs config.json, vocab.json, source.spm, ...)"
        ) from None
    except RecursionError:
        raise NmtError(f"{path}: not readable JSON (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise NmtError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise NmtError(f"{path}: expected a JSON object")
    return value


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def save_safetensors(path: Path, tensors: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})  # "pt": transformers checks for it
