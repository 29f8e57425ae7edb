"""A checkpoint as a CTranslate2 model folder (`nmt export --format ctranslate2`).

The conversion goes through CTranslate2's own specification API (the one its fairseq and OpenNMT-py
converters use): `TransformerSpec.from_config` describes the architecture and the weights are filled in
by name. Our layout already matches CTranslate2's: self-attention projects Q, K, V with one fused matrix
and cross-attention projects Q alone and K, V fused. What is set explicitly rather than left to its
defaults: the sinusoidal position table (ours interleaves sin/cos per dimension pair, section 3.5, which
need not be the layout CTranslate2 would compute), the LayerNorm epsilon (torch's 1e-5) and the special
tokens. The output projection is the shared embedding matrix without a bias, as in nmt.model.

The folder holds CTranslate2's files (model.bin, config.json, shared_vocabulary.json: SentencePiece
pieces in id order) plus spm.model, the subword model, and nmt.json, the checkpoint's languages,
positions and decode settings, so it is enough to translate with `nmt translate --engine ctranslate2 -m DIR`
(nmt.translate.ctranslate2_engine). A checkpoint with a lexical shortlist (nmt.shortlist) also gets
vmap.txt, CTranslate2's vocabulary map, which `translate_batch(..., use_vmap=True)` reads
(`nmt translate --engine ctranslate2 --shortlist`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from nmt.atomic import atomic_folder, check_replaceable
from nmt.checkpoint import Checkpoint, load_checkpoint
from nmt.config import DecodeConfig
from nmt.errors import CheckpointError, NmtError
from nmt.formats import META_FILE
from nmt.subword import Subword
from nmt.tokens import BOS, EOS, PAD, UNK

META_FORMAT = "nmt-ctranslate2"
VMAP_FILE = "vmap.txt"  # the name CTranslate2's converters give the file of --vocab_mapping
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which nmt.model uses


def import_ctranslate2():
    try:
        import ctranslate2
    except ImportError as e:
        raise NmtError(f"CTranslate2 is not installed ({e}): pip install 'nmt[ctranslate2]'") from None
    return ctranslate2


def export_ctranslate2(model_path: Path, output: Path, force: bool = False) -> Path:
    """`nmt export --format ctranslate2`: the checkpoint as a CTranslate2 folder; returns it.

    Built under a temporary name beside `output` and renamed at the end; an existing `output` is replaced
    only with `force` and only when an earlier export wrote it.
    """
    ct2 = import_ctranslate2()
    output = Path(output)
    check_replaceable(output, force, META_FILE)
    ckpt = load_checkpoint(Path(model_path))
    pieces = subword_pieces(ckpt.subword_proto)
    if len(pieces) != ckpt.vocab_size:
        raise NmtError(f"{model_path}: {len(pieces)} subwords but the model has {ckpt.vocab_size} rows")
    with atomic_folder(output) as converted:
        try:
            converter(ckpt, pieces, ct2).convert(str(converted))
        except KeyError as e:
            raise CheckpointError(f"{model_path}: no weight {e} for CTranslate2's Transformer") from None
        (converted / "spm.model").write_bytes(ckpt.subword_proto)
        if ckpt.shortlist is not None:
            (converted / VMAP_FILE).write_text(vocabulary_map(ckpt.shortlist, pieces), encoding="utf-8")
        write_meta(converted / META_FILE, ckpt, source=Path(model_path))
    return output


def subword_pieces(proto: bytes) -> list[str]:
    """The subword pieces in id order: CTranslate2 takes and returns token strings, not ids."""
    return Subword(proto).pieces()


def vocabulary_map(shortlist: dict, pieces: list[str]) -> str:
    """A shortlist (a checkpoint's `shortlist` entry: frequent ids (F,), table (V, K), PAD-filled) as
    CTranslate2's vocabulary map: lines `source n-gram<TAB>target tokens` (space-separated), the empty
    source first for the tokens that are always candidates; then one line per source piece with any.
    CTranslate2 adds UNK, BOS, EOS and PAD itself, and the target prefix, as nmt.shortlist does."""
    lines = ["\t" + " ".join(pieces[i] for i in shortlist["frequent"].tolist())]
    for source, row in enumerate(shortlist["table"].tolist()):
        targets = [pieces[i] for i in row if i != PAD]
        if targets and source not in (PAD, BOS, EOS, UNK):
            lines.append(pieces[source] + "\t" + " ".join(targets))
    return "".join(line + "\n" for line in lines)


def write_meta(path: Path, ckpt: Checkpoint, source: Path) -> None:
    meta = {
        "format": META_FORMAT,
        "version": 1,
        "source": source.name,  # the file's name only: an export carries no path of the machine that made it
        "src_lang": ckpt.config.data.src_lang,
        "tgt_lang": ckpt.config.data.tgt_lang,
        "max_positions": ckpt.config.model.max_positions,
        "decode": dataclasses.asdict(ckpt.config.decode),
    }
    data = ckpt.config.data
    if data.multilingual:  # the languages it reads (its targets are the tags of spm.model)
        meta["sources"] = list(dict.fromkeys(s for s, _ in data.directions))
    path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def read_meta(model_dir: Path) -> dict:
    """nmt.json of an exported folder; NmtError if the folder is not one."""
    path = Path(model_dir) / META_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise NmtError(
            f"{model_dir}: not a model folder written by `nmt export` (no readable {META_FILE})"
        ) from None
    if meta.get("format") != META_FORMAT:
        raise NmtError(f"{path}: not written by `nmt export --format ctranslate2`")
    sources = meta.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, str) and s.strip() for s in sources):
        raise NmtError(f"{path}: sources: expected a list of language codes, got {sources!r}"[:200])
    return meta


def exported_decode(model_dir: Path) -> DecodeConfig:
    """The decode settings of the checkpoint the folder was exported from."""
    return DecodeConfig(**read_meta(model_dir)["decode"])


def converter(ckpt: Checkpoint, pieces: list[str], ct2):
    """A ctranslate2.converters.Converter over an nmt checkpoint (its `convert` validates and saves)."""

    class _Converter(ct2.converters.Converter):
        def _load(self):
            return transformer_spec(ckpt, pieces, ct2.specs)

    return _Converter()


def transformer_spec(ckpt: Checkpoint, pieces: list[str], specs):
    """The checkpoint as a filled-in ctranslate2.specs.TransformerSpec."""
    from nmt.model import sinusoidal_positions

    cfg, w = ckpt.config.model, ckpt.model_state
    spec = specs.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers),
        cfg.heads,
        pre_norm=cfg.norm == "pre",
        activation=specs.Activation.SWISH if cfg.activation == "swish" else specs.Activation.RELU,
        layernorm_embedding=False,
    )
    embed = w["embed.weight"].float()  # (V, D): source and target embeddings and the output projection (3.4)
    positions = sinusoidal_positions(cfg.max_positions, cfg.d_model)  # (max_positions, D)
    for stack, norm in ((spec.encoder, "encoder_norm"), (spec.decoder, "decoder_norm")):
        embeddings = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
        embeddings.weight = embed
        stack.scale_embeddings = True  # x * sqrt(D), as nmt.model.Transformer.embed_tokens
        stack.position_encodings.encodings = positions
        if cfg.norm == "pre":
            set_layer_norm(stack.layer_norm, w, norm)
    spec.decoder.projection.weight = embed  # logits = y E^T (+ the fixed output bias of imported models)
    # model.decoder_start zero: step 0 embeds a zero vector (positions still added), as nmt.model does
    spec.decoder.start_from_zero_embedding = cfg.decoder_start == "zero"
    if cfg.output_bias:
        spec.decoder.projection.bias = w["output_bias"].float()

    for i, layer in enumerate(spec.encoder.layer):
        p = f"encoder.{i}"
        set_linear(layer.self_attention.linear[0], w, f"{p}.self_attn.qkv_proj")  # (3D, D): Q; K; V
        set_linear(layer.self_attention.linear[1], w, f"{p}.self_attn.out_proj")
        set_layer_norm(layer.self_attention.layer_norm, w, f"{p}.res_attn.norm")
        set_ffn(layer.ffn, w, p, "res_ffn")
    for i, layer in enumerate(spec.decoder.layer):
        p = f"decoder.{i}"
        set_linear(layer.self_attention.linear[0], w, f"{p}.self_attn.qkv_proj")  # (3D, D): Q; K; V
        set_linear(layer.self_attention.linear[1], w, f"{p}.self_attn.out_proj")
        set_layer_norm(layer.self_attention.layer_norm, w, f"{p}.res_self.norm")
        set_linear(layer.attention.linear[0], w, f"{p}.cross_attn.q_proj")  # (D, D)
        set_linear(layer.attention.linear[1], w, f"{p}.cross_attn.kv_proj")  # (2D, D): K; V
        set_linear(layer.attention.linear[2], w, f"{p}.cross_attn.out_proj")
        set_layer_norm(layer.attention.layer_norm, w, f"{p}.res_cross.norm")
        set_ffn(layer.ffn, w, p, "res_ffn")

    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    # Decoding starts from BOS; the source is ids + [EOS] (nmt.subword's conventions), which
    # CTranslate2 appends itself so that the folder also works without nmt.
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = (
        pieces[UNK],
        pieces[BOS],
        pieces[EOS],
    )
    spec.config.decoder_start_token = pieces[BOS]
    spec.config.add_source_bos, spec.config.add_source_eos = False, True
    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    return spec


def set_linear(spec, weights: dict, name: str) -> None:
    spec.weight = weights[f"{name}.weight"].float()
    spec.bias = weights[f"{name}.bias"].float()


def set_layer_norm(spec, weights: dict, name: str) -> None:
    spec.gamma = weights[f"{name}.weight"].float()
    spec.beta = weights[f"{name}.bias"].float()


def set_ffn(spec, weights: dict, prefix: str, residual: str) -> None:
    """FFN(x) = max(0, x W1 + b1) W2 + b2; its LayerNorm is the one around it (post: after, pre: before)."""
    set_linear(spec.linear_0, weights, f"{prefix}.ffn.fc1")
    set_linear(spec.linear_1, weights, f"{prefix}.ffn.fc2")
    set_layer_norm(spec.layer_norm, weights, f"{prefix}.{residual}.norm")
