"""A foreign model folder checked before anything is built from it: `nmt import`'s validation.

A MarianMT folder (or a Pegasus one, a pre-norm model in the same files) comes from elsewhere, so
every number in it is checked before it sizes a list, a tensor or a loop: config.json's fields are typed
and bounded (nmt.config.MODEL_LIMITS: vocabulary, width, feed-forward size, positions, layers and heads,
heads dividing the width), the weights' names, shapes and types are read from the safetensors header
before a tensor is read (from the loaded state dict for pytorch_model.bin), every weight is finite,
source.spm and target.spm load as SentencePiece models, and vocab.json holds their pieces. Each failure
is one NmtError naming the file and the field.
"""

from __future__ import annotations

import math
from pathlib import Path

import sentencepiece as spm
import torch

from nmt.checkpoint import all_finite, dense
from nmt.config import MODEL_LIMITS
from nmt.errors import NmtError

# config.json's keys as nmt's model keys, whose limits they take
SIZES = {
    "vocab_size": "vocab_size",
    "d_model": "d_model",
    "encoder_layers": "encoder_layers",
    "decoder_layers": "decoder_layers",
    "encoder_ffn_dim": "d_ff",
    "decoder_ffn_dim": "d_ff",
    "encoder_attention_heads": "heads",
    "decoder_attention_heads": "heads",
    "max_position_embeddings": "max_positions",
}
OPTIONAL = {"decoder_ffn_dim", "decoder_attention_heads", "max_position_embeddings"}  # may be absent
RATES = ("dropout", "attention_dropout", "activation_dropout")
TOKEN_IDS = ("pad_token_id", "eos_token_id", "decoder_start_token_id")
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
MODEL_TYPES = ("marian", "pegasus")  # nmt.formats.huggingface.LAYOUTS; pegasus: a final norm per stack
MISSING_PIECES = 0.01  # of a SentencePiece model's pieces, vocab.json may lack at most this fraction


def check_config(hf: dict, path: Path) -> None:
    """config.json's sizes, rates and token ids: of the right type and within bounds, or one line."""

    def fail(key: str, why: str) -> None:
        raise NmtError(f"{path}: {key} {short(hf.get(key))}: {why}")

    if hf.get("model_type") not in MODEL_TYPES:
        fail("model_type", "not a MarianMT or Pegasus model")
    for key, limit_key in SIZES.items():
        if key in OPTIONAL and key not in hf:
            continue
        value, limit = hf.get(key), MODEL_LIMITS[limit_key]
        if not is_int(value) or not 0 < value <= limit:
            fail(key, f"expected an integer from 1 to {limit:,}")
    if hf["d_model"] % 2:
        fail("d_model", "must be even (sinusoidal positions)")
    for key in ("encoder_attention_heads", "decoder_attention_heads"):
        if key in hf and hf["d_model"] % hf[key]:
            fail(key, f"does not divide d_model {hf['d_model']}")
    for key in RATES:
        if key in hf and not (is_number(hf[key]) and 0.0 <= hf[key] < 1.0):
            fail(key, "expected a number in [0, 1)")
    for key in TOKEN_IDS:
        value = hf.get(key)
        if value is not None and not (is_int(value) and 0 <= value < hf["vocab_size"]):
            fail(key, f"expected an id below vocab_size {hf['vocab_size']}")
    if not isinstance(hf.get("activation_function"), str):
        fail("activation_function", "expected a string")


def check_strings(doc: dict, keys: tuple[str, ...], path: Path) -> None:
    """Keys of a JSON object (tokenizer_config.json) that must be text where present."""
    for key in keys:
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise NmtError(f"{path}: {key} {short(doc[key])}: expected a string")


def check_meta(meta: dict, path: Path) -> None:
    """nmt.json of an earlier export: its config's data and decode sections, where present, are objects."""
    config = meta.get("config", {})
    if not isinstance(config, dict):
        raise NmtError(f"{path}: config: expected an object")
    for key in ("data", "decode"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise NmtError(f"{path}: config.{key}: expected an object")
    check_strings(config.get("data") or {}, ("src_lang", "tgt_lang", "subword_type"), path)


def read_sentencepiece(path: Path) -> tuple[bytes, spm.SentencePieceProcessor]:
    """A SentencePiece model file, loaded; one line naming the file when it is not one."""
    try:
        proto = path.read_bytes()
    except FileNotFoundError:
        raise NmtError(f"{path}: missing (a MarianMT folder needs source.spm and target.spm)") from None
    except OSError as e:
        raise NmtError(f"{path}: cannot read: {e.strerror}") from None
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto)
    except (RuntimeError, OSError):  # SentencePiece's own message is a C++ source location
        raise NmtError(f"{path}: not a SentencePiece model") from None
    return proto, sp


def check_pieces(vocab: dict, path: Path, sp: spm.SentencePieceProcessor, spm_path: Path) -> None:
    """vocab.json must hold the SentencePiece model's pieces: a vocabulary of other pieces maps every
    subword to UNK, or to the wrong row, and the model would translate into noise."""
    pieces = [
        sp.id_to_piece(i)
        for i in range(sp.get_piece_size())
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))
    ]
    missing = [p for p in pieces if p not in vocab]
    if pieces and len(missing) > MISSING_PIECES * len(pieces):
        raise NmtError(
            f"{path}: lacks {len(missing)} of the {len(pieces)} pieces of {spm_path.name} "
            f"(such as {short(missing[0])}): not the vocabulary of these SentencePiece models"
        )


def expected_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """The shape of every weight a MarianMT (or Pegasus) model of this config.json has (names without
    `model.`)."""
    d, f, v = hf["d_model"], hf["encoder_ffn_dim"], hf["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {}

    def attention(prefix: str) -> None:
        for p in ("q", "k", "v", "out"):
            shapes[f"{prefix}.{p}_proj.weight"], shapes[f"{prefix}.{p}_proj.bias"] = (d, d), (d,)

    def norm(prefix: str) -> None:
        shapes[f"{prefix}.weight"], shapes[f"{prefix}.bias"] = (d,), (d,)

    def ffn(prefix: str) -> None:
        shapes[f"{prefix}.fc1.weight"], shapes[f"{prefix}.fc1.bias"] = (f, d), (f,)
        shapes[f"{prefix}.fc2.weight"], shapes[f"{prefix}.fc2.bias"] = (d, f), (d,)

    for side, layers in (("encoder", hf["encoder_layers"]), ("decoder", hf["decoder_layers"])):
        for i in range(layers):
            p = f"{side}.layers.{i}"
            attention(f"{p}.self_attn")
            norm(f"{p}.self_attn_layer_norm")
            if side == "decoder":
                attention(f"{p}.encoder_attn")
                norm(f"{p}.encoder_attn_layer_norm")
            ffn(p)
            norm(f"{p}.final_layer_norm")
    if hf["model_type"] == "pegasus":
        norm("encoder.layer_norm")
        norm("decoder.layer_norm")
    for name in ("shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head"):
        shapes[f"{name}.weight"] = (v, d)
    shapes["final_logits_bias"] = (1, v)
    return shapes


def check_weight_shapes(found: dict[str, tuple[tuple[int, ...], str]], hf: dict, path: Path) -> None:
    """Each weight (name -> (shape, dtype name)) has the shape config.json implies and a float type.

    Names config.json does not imply are left to the import, which names them; the fixed position
    tables of older uploads have any number of rows of the model's width."""
    expected = expected_shapes(hf)
    for name, (shape, dtype) in found.items():
        key = name.removeprefix("model.")
        if dtype not in FLOAT_DTYPES:
            raise NmtError(f"{path}: weight {name} is {dtype}: expected floating-point weights")
        want = expected.get(key)
        if key.endswith("embed_positions.weight"):
            if len(shape) != 2 or shape[1] != hf["d_model"]:
                raise NmtError(f"{path}: weight {name} is {shape_text(shape)}: expected (positions, d_model)")
        elif want is not None and tuple(shape) != want:
            raise NmtError(
                f"{path}: weight {name} is {shape_text(shape)}, config.json implies {shape_text(want)}"
            )


def safetensors_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and types from a safetensors file's header, without reading a tensor."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {
                name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                for name in f.keys()
            }
    except Exception as e:  # safetensors' own error types for a damaged or foreign header
        raise NmtError(f"{path}: not readable weights ({' '.join(str(e).split())[:120]})") from None


def checked_weights(folder: Path, hf: dict, read) -> dict[str, torch.Tensor]:
    """The folder's weights, `read(folder)` (nmt.formats.huggingface.read_weights) once the safetensors
    header shows the shapes config.json implies; then every weight's shape and finiteness."""
    st = folder / "model.safetensors"
    if st.is_file():
        check_weight_shapes(safetensors_shapes(st), hf, st)
    weights = read(folder)
    path = st if st.is_file() else folder / "pytorch_model.bin"
    check_weight_shapes(tensor_shapes(weights, path), hf, path)
    check_finite(weights, path)
    return weights


def tensor_shapes(weights: dict, path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """The same description of an already loaded state dict (pytorch_model.bin)."""
    names = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}
    found = {}
    for name, tensor in weights.items():
        if not isinstance(name, str) or not dense(tensor):
            raise NmtError(f"{path}: weight {short(name)}: not a named dense tensor")
        found[name] = (tuple(tensor.shape), names.get(tensor.dtype, str(tensor.dtype)))
    return found


def check_finite(weights: dict[str, torch.Tensor], path: Path) -> None:
    for name, tensor in weights.items():
        if not all_finite(tensor):
            raise NmtError(f"{path}: weight {name} holds NaN or infinite values")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def short(value: object, limit: int = 60) -> str:
    """A value as it goes into a one-line message: repr, cut."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
