"""One typed config object for a whole experiment, loaded strictly from a YAML recipe.

A recipe has four sections, each a frozen dataclass below: `data` (corpora and subwords), `model`
(the Transformer's sizes), `train` (optimisation, budgets, checkpoints) and `decode` (beam search).
Defaults live here and nowhere else. Loading is strict: an unknown key, a wrong type or an impossible
combination raises ConfigError naming the file and the dotted key, with a suggestion for misspellings.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from nmt import limits
from nmt.errors import ConfigError, NmtError
from nmt.languages import BT_TAG, TERM_CLOSE, TERM_OPEN, same, target_tag

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"  # a link to the top-level recipes/ in a checkout
DEFAULT_RECIPE = "multi30k-en-de"


class Choice(str, Enum):
    """A closed set of names a user writes for an option; `parse` is the one place a name is read."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | Choice, option: str):
        """`value` as one of the choices (any case, spaces around ignored); an error names the option and
        lists every choice."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            choices = ", ".join(c.value for c in cls)
            raise ConfigError(f"{option} {value}: expected one of {choices}") from None


class Precision(Choice):
    """`--dtype`: the numbers a model computes in (nmt.device: torch's dtypes; int8: nmt.translate.int8)."""

    AUTO = "auto"
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"


class Engine(Choice):
    """`--engine`: what runs a model, nmt's PyTorch search or CTranslate2 on an exported folder."""

    TORCH = "torch"
    CTRANSLATE2 = "ctranslate2"


@dataclass(frozen=True)
class FileSpec:
    """One file of a corpus: where upstream keeps it, its checksum, and its member inside an archive."""

    url: str
    sha256: str
    member: str | None = None  # path inside a .tgz/.tar archive; None for plain or .gz files


@dataclass(frozen=True)
class CorpusSpec:
    """A parallel corpus: two aligned files, or a test set from sacrebleu's registry (e.g. `wmt14/full`)."""

    name: str
    src: FileSpec | None = None
    tgt: FileSpec | None = None
    sacrebleu: str | None = None
    # Drop training pairs either side of which py3langid names confidently as another language than
    # the pair's (data.langid_threshold): for web-crawled corpora (Common Crawl), not for curated ones.
    langid: bool = False
    # Its own language pair, for a recipe of several directions; None: data.src_lang / data.tgt_lang.
    src_lang: str | None = None
    tgt_lang: str | None = None
    # Training corpora: how often its pairs are drawn, relative to its size (2: twice as often as
    # concatenation would; see DataConfig.sampling_temperature). Validation and test sets ignore it.
    weight: float = 1.0
    # Training corpora: a back-translated one (synthetic sources) has each source begin with the
    # reserved <BT> control symbol, by id (tagged back-translation, Caswell et al. 2019), so the model
    # can tell synthetic sources from real ones; user input never carries it.
    tag: bool = False


@dataclass(frozen=True)
class AugmentConfig:
    """The share of training pairs each modifier of nmt.data.augment is applied to; all 0 is off."""

    uppercase: float = 0.0
    titlecase: float = 0.0
    typos: float = 0.0
    remove_end_punct: float = 0.0
    # Inline terms (nmt.data.terms, Dinu et al. 2019): the share of training pairs with up to two source
    # words followed by their target word between the reserved <term> </term>, so a glossary's terms are
    # placed where their word was; and the share of those words given another word's target (both sides),
    # so the model writes the term it is given rather than the one it would have written.
    inline_terms: float = 0.0
    inline_terms_other: float = 0.0
    seed: int = 1


@dataclass(frozen=True)
class BacktranslateConfig:
    """A back-translation recipe (`nmt run`, nmt.pipeline): a reverse model (target -> source) trained
    on the recipe's bitext with its SentencePiece model, or one given, translates monolingual
    target-language text into synthetic sources (nmt.backtranslate); the pairs join the training
    corpora as one more corpus, and the forward model trains on both."""

    mono: tuple[FileSpec, ...] = ()  # monolingual target-language text, fetched as every corpus is
    name: str = "backtranslated"  # the synthetic corpus's name in statistics and results
    method: Literal["sampling", "topk", "beam", "greedy"] = "sampling"  # nmt backtranslate --method
    seed: int = 1  # the samples' seed
    max_lines: int | None = None  # at most this many monolingual lines (after repeats are dropped)
    tag: bool = True  # each synthetic source begins with <BT> (tagged back-translation, Caswell et al.)
    weight: float = 1.0  # the synthetic corpus's weight (CorpusSpec.weight)
    # A trained target -> source checkpoint to use; its SentencePiece model becomes the recipe's. None:
    # one is trained from the recipe, sources and targets swapped, for reverse_minutes (None: the
    # recipe's train.max_minutes).
    reverse: str | None = None
    reverse_minutes: float | None = None
    # The forward model (and the bitext-only one) start from the reverse model's weights rather than at
    # random: a parent model of the opposite direction, with the same joint vocabulary, still helps its
    # child (Kocmi and Bojar, 2018), and the minutes the reverse model trained are not lost to it.
    warm_start: bool = False
    # Also train the recipe without the synthetic corpus (bitext only, the same minutes and vocabulary),
    # and show it beside the forward model in results.md: the ablation that says what the corpus gave.
    baseline: bool = False
    # Also train the forward model on the same synthetic pairs without <BT> (the same vocabulary, minutes
    # and start), and show tagged against untagged in results.md: what the tag gave (Caswell et al.).
    compare_untagged: bool = False


@dataclass(frozen=True)
class DataConfig:
    src_lang: str
    tgt_lang: str
    train: tuple[CorpusSpec, ...]
    valid: tuple[CorpusSpec, ...]
    test: tuple[CorpusSpec, ...] = ()
    vocab_size: int = 8000  # one joint SentencePiece vocabulary for both languages (paper, 5.1)
    subword_type: Literal["bpe", "unigram"] = "bpe"
    character_coverage: float = 1.0
    spm_sample_sentences: int = 2_000_000  # SentencePiece's own sampling of large corpora
    min_words: int = 1  # cleaning, on whitespace words as Moses' clean-corpus-n.perl counts them
    max_words: int = 250
    max_ratio: float = 1.5
    max_subwords: int = 256  # training pairs longer than this in subwords are dropped after encoding
    # Fine-tuning: a checkpoint whose subwords, model keys and weights the run starts from (nmt.checkpoint).
    init_from: str | None = None
    # Cleaning beyond length (nmt.data.clean): duplicate pairs, exact or equal up to case, punctuation
    # and spaces; pairs whose target is their source unchanged (untranslated copies).
    dedup: bool = True
    drop_copies: bool = True
    langid_threshold: float = 0.9  # for corpora with `langid: true`
    augment: AugmentConfig = field(default_factory=AugmentConfig)  # off unless a share is given
    # Each epoch draws corpus i's share p_i ∝ weight_i * (n_i / N)^(1 / T) of the N training pairs
    # (fairseq's temperature sampling, nmt.data.sampling): T = 1 with every weight 1 is concatenation;
    # T > 1 draws small corpora (low-resource directions) more often than their size says.
    sampling_temperature: float = 1.0
    backtranslate: BacktranslateConfig | None = None

    def direction(self, corpus: CorpusSpec) -> tuple[str, str]:
        """The (source, target) languages of a corpus: its own, or the recipe's."""
        return corpus.src_lang or self.src_lang, corpus.tgt_lang or self.tgt_lang

    @property
    def directions(self) -> tuple[tuple[str, str], ...]:
        """The language pairs the training corpora hold, in recipe order."""
        return tuple(dict.fromkeys(self.direction(c) for c in self.train)) or (
            (self.src_lang, self.tgt_lang),
        )

    @property
    def multilingual(self) -> bool:
        """Several directions: data files are kept per direction (bilingual work directories keep the
        layout they always had)."""
        return len(self.directions) > 1

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t for _, t in self.directions))

    @property
    def languages(self) -> tuple[str, ...]:
        """Every language the model reads or writes: the ones its outputs can wrongly be in."""
        return tuple(dict.fromkeys(lang for pair in self.directions for lang in pair))

    def target_tag(self, target: str) -> str | None:
        """The tag the sources into `target` begin with: None for a model of one target, which has none."""
        return target_tag(target) if len(self.targets) > 1 else None

    @property
    def reserved_tags(self) -> tuple[str, ...]:
        """The reserved subwords the vocabulary is trained with, inserted by id (nmt.languages): a
        target tag per language where there are several targets, so a bilingual model has none and
        stays what it always was; and <BT> where a training corpus is tagged (CorpusSpec.tag) or will be
        (a tagged back-translation recipe, whose vocabulary is trained before its synthetic corpus exists);
        <term> and </term> where training pairs get inline terms (data.augment.inline_terms)."""
        targets = tuple(target_tag(t) for t in self.targets) if len(self.targets) > 1 else ()
        bt = any(c.tag for c in self.train) or (self.backtranslate is not None and self.backtranslate.tag)
        terms = (TERM_OPEN, TERM_CLOSE) if self.augment.inline_terms > 0 else ()
        return targets + ((BT_TAG,) if bt else ()) + terms


# The largest model nmt builds, in each dimension (a recipe, a checkpoint, an imported config.json):
# far beyond any published translation model, yet small enough that a wrong number (1e9 positions, a
# 10^10-entry vocabulary) is an error naming the key, not an allocation of many gigabytes.
MODEL_LIMITS = {
    "encoder_layers": 64,
    "decoder_layers": 64,
    "d_model": 16_384,
    "d_ff": 65_536,
    "heads": 256,
    "max_positions": limits.MAX_POSITIONS,
    "vocab_size": limits.MAX_VOCAB,
}


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the Transformer (paper, Table 3). The vocabulary size comes from the trained subwords."""

    encoder_layers: int = 6
    decoder_layers: int = 6
    d_model: int = 512
    d_ff: int = 2048
    heads: int = 8
    dropout: float = 0.1  # P_drop: on embeddings+positions and every sub-layer output (5.4)
    attention_dropout: float = 0.0  # not in the paper; fairseq and tensor2tensor expose it
    activation_dropout: float = 0.0  # not in the paper; dropout after the FFN's ReLU
    norm: Literal["post", "pre"] = "post"  # post: LayerNorm(x + Sublayer(x)) as in the paper (3.1)
    max_positions: int = 1024
    # Not in the paper; what pretrained MarianMT/OPUS-MT models need (nmt import): the FFN's
    # non-linearity (swish = x * sigmoid(x)) and a fixed bias added to the output logits.
    activation: Literal["relu", "swish"] = "relu"
    output_bias: bool = False
    # What the decoder's first position embeds (the paper does not say): bos, the learned vector of the
    # BOS token; zero, a zero vector (positions still added), Marian's and so OPUS-MT's convention, which
    # CTranslate2's MarianMT converter assumes (start_from_zero_embedding).
    decoder_start: Literal["bos", "zero"] = "bos"


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 1
    batch_tokens: int = 4096  # per device and forward pass: sentences * longest side, padding included
    update_tokens: int = 25000  # per optimizer update, all devices; sets gradient accumulation
    max_steps: int = 100_000
    max_minutes: float | None = None
    warmup: int = 4000
    lr_scale: float = 1.0  # multiplies d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (5.3)
    peak_lr: float | None = None  # alternative to lr_scale: the rate reached at the end of warm-up
    # The last fraction of the budget (max_steps or max_minutes, whichever ends first) in which the rate
    # decays linearly to 0; 0 keeps the paper's schedule to the end.
    cooldown: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    weight_decay: float = 0.0  # > 0: AdamW, decaying the matrices only (not biases, not LayerNorm)
    clip_norm: float = 0.0  # 0 disables clipping (the paper does not clip)
    label_smoothing: float = 0.1
    # auto: bf16 where native (nmt.device); int8 is for translating only
    precision: Literal[Precision.AUTO, Precision.FP32, Precision.BF16, Precision.FP16] = Precision.AUTO
    compile: bool = False
    device: str = "auto"
    threads: int | None = None  # CPU threads for torch; None keeps torch's default
    log_every: int = 100
    validate_every: int = 1000
    valid_bleu: bool = True  # greedy-decode the validation set and score it with sacreBLEU
    save_every: int = 1000
    keep_last: int = 5
    average_last: int = 5  # checkpoints averaged into the final model (paper: 5 base, 20 big)
    patience: int = 0  # validations without a better BLEU before stopping; 0 disables early stopping
    max_nonfinite: int = 5  # consecutive NaN/inf updates skipped before training stops


@dataclass(frozen=True)
class DecodeConfig:
    beam: int = 4
    lenpen: float = 0.6  # GNMT length penalty ((5+|Y|)/6)^alpha
    max_len_a: float = 1.0  # output length limit: a * source length + b
    max_len_b: int = 50
    min_len: int = 1  # tokens before EOS may end a hypothesis: a real sentence never translates to nothing
    # sentences x beam x max(source, output limit): a batch is costed by the steps its search may take
    # (nmt.translate.frontend.batch_cost), so 32768 holds about as many sentences as 8192 source tokens
    # did before outputs counted, and keeps file throughput (benchmarks/RESULTS.md, batch costing)
    batch_tokens: int = 32768
    nbest: int = 1  # hypotheses per input; with sampling, samples per input
    no_repeat_ngram_size: int = 0  # > 0: no n-gram of this size twice in a translation
    sampling: bool = False  # draw each token instead of searching (back-translation)
    sampling_topk: int = 0  # draw from the k likeliest tokens only; 0: all
    sampling_topp: float = 1.0  # draw from the smallest set holding this much probability
    temperature: float = 1.0  # < 1 sharpens, > 1 flattens the distribution drawn from
    seed: int = 1  # the same seed, input and settings give the same samples
    shortlist: bool = False  # decode each sentence over the checkpoint's lexical shortlist (nmt.shortlist)
    recase: bool = False  # lines in ALL CAPS or Title Case translated in sentence case (nmt.translate.casing)
    # A glossary term takes the place of the model's own word for its source: the word the translation
    # without terms aligns to it is banned from the search (nmt.translate.displace); false: the term is
    # only required, and may stand beside that word ("Ein Mann fährt Fahrrad Velo.").
    terms_replace: bool = True


@dataclass(frozen=True)
class Config:
    data: DataConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


@dataclass(frozen=True)
class ShortlistSizes:
    """`nmt shortlist`'s counts (nmt.shortlist builds the sets): Bergamot's students use 100 and 50."""

    frequent: int = 100  # the most frequent target pieces, always in the set
    per_source: int = 50  # the likeliest target pieces of each source piece
    iterations: int = 5  # EM iterations of IBM Model 1


@dataclass(frozen=True)
class DecodeOverrides:
    """Decode settings given on a command line (or in a request), to apply over a model's own.

    A model's decode section comes with its checkpoint, so options can only be applied once it is read:
    `apply` checks them by the same rules as a recipe's decode section, and an error names the option as
    the user typed it (`flags`: field -> option; by default `--field-name`).
    """

    values: dict[str, Any] = field(default_factory=dict)  # by DecodeConfig field; only those given
    flags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def given(cls, flags: dict[str, str] | None = None, **values: Any) -> DecodeOverrides:
        """The options that were given (not None), e.g. `DecodeOverrides.given(beam=beam, lenpen=None)`."""
        return cls({k: v for k, v in values.items() if v is not None}, dict(flags or {}))

    def flag(self, name: str) -> str:
        return self.flags.get(name, "--" + name.replace("_", "-"))

    def apply(self, base: DecodeConfig, source: str) -> DecodeConfig:
        hints = typing.get_type_hints(DecodeConfig)
        values = {}
        for name, value in self.values.items():
            if name not in hints:
                raise ConfigError(f"{source}: unknown decode setting {self.flag(name)}")
            values[name] = _coerce(hints[name], value, source, self.flag(name))
        decode = dataclasses.replace(base, **values)

        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"{source}: {self.flag(name)}: {why}")

        _check_decode(decode, need, self.flag)
        return decode


# ---------------------------------------------------------------------------------------------------------
# Loading


def resolve_recipe(recipe: str | Path | None) -> Path:
    """A path to a YAML file, or the name of a shipped recipe (`multi30k-en-de`); None is the default."""
    name = str(recipe) if recipe is not None else DEFAULT_RECIPE
    path = Path(name)
    if path.exists():
        return path
    shipped = RECIPES_DIR / (name if name.endswith(".yaml") else name + ".yaml")
    if shipped.exists():
        return shipped
    raise ConfigError(f"{name}: no such recipe file")


def load_config(
    recipe: str | Path | None,
    overrides: list[str] | tuple[str, ...] = (),
    checkpoint_config: Callable[[Path], dict] | None = None,
) -> Config:
    """Read a recipe, apply `key.path=value` overrides, and validate the result into a Config.

    A fine-tuning recipe (data.init_from) takes its model and vocabulary keys from the checkpoint, whose
    config `checkpoint_config` reads as a plain dict (nmt.checkpoint.checkpoint_config): passed in, so
    that this module, which every other one imports, imports none of them.
    """
    path = resolve_recipe(recipe)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=StrictLoader)  # noqa: S506 (a SafeLoader)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    except DuplicateKey as e:
        raise ConfigError(f"{path}: {e.problem}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}:{where} not valid YAML: {getattr(e, 'problem', e)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections (data, model, train, decode)")
    for item in overrides:
        apply_override(raw, item)
    if isinstance(raw.get("data"), dict) and raw["data"].get("init_from") is not None:
        if checkpoint_config is None:
            raise ConfigError(f"{path}: data.init_from: this caller cannot read checkpoints")
        merge_init_from(raw, str(path), checkpoint_config)
    return config_from_dict(raw, source=str(path))


# Model keys a fine-tuning recipe may change: they shape training, not the weights.
REGULARIZATION = ("dropout", "attention_dropout", "activation_dropout")
# Data keys that describe the vocabulary, which the checkpoint fixes.
VOCABULARY_KEYS = ("vocab_size", "subword_type")


def merge_init_from(raw: dict, source: str, checkpoint_config: Callable[[Path], dict]) -> None:
    """Fill a raw recipe's model and vocabulary keys from the checkpoint `data.init_from` names, or
    raise ConfigError naming the first key that contradicts it (nmt.checkpoint says why)."""
    path = raw["data"]["init_from"]
    if not isinstance(path, str):
        raise ConfigError(f"{source}: data.init_from: expected a checkpoint path, got {path!r}")
    try:
        base = checkpoint_config(Path(path))
    except NmtError as e:
        raise ConfigError(f"{source}: data.init_from: {e}") from None
    model = raw.setdefault("model", {})
    if not isinstance(model, dict):
        raise ConfigError(f"{source}: model: expected a mapping")
    for section, keys, given in (
        ("model", [k for k in base["model"] if k not in REGULARIZATION], model),
        ("data", VOCABULARY_KEYS, raw["data"]),
    ):
        for key in keys:
            want = base[section][key]
            if key in given and given[key] != want:
                raise ConfigError(
                    f"{source}: {section}.{key} is {given[key]!r} but {path} has {want!r}; "
                    f"leave {section}.{key} out to take the checkpoint's"
                )
            given[key] = want
    for key in REGULARIZATION:
        model.setdefault(key, base["model"][key])


class DuplicateKey(yaml.constructor.ConstructorError):
    pass


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping, at any level.

    Plain YAML keeps the last value, so a second `train:` section would silently replace the first
    whole; the error names the key and both lines instead. Keys brought in by a merge (`<<: *base`) may
    still be overridden, as YAML intends.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise DuplicateKey(
                        None,
                        None,
                        f"duplicate key {key!r} (first on line {seen[key].start_mark.line + 1}, "
                        f"again on line {key_node.start_mark.line + 1})",
                        key_node.start_mark,
                    )
                seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def apply_override(raw: dict, item: str) -> None:
    """Set one dotted key in a raw recipe from `a.b.c=value`; the value is parsed as YAML."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item}: expected KEY=VALUE, e.g. --set train.max_steps=200")
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError:
        node[parts[-1]] = value


def config_from_dict(raw: dict, source: str = "config", corpora: bool = True) -> Config:
    """`corpora=False` for a model's own config (a checkpoint), which may name no training corpora: an
    imported pretrained model has none."""
    cfg = _build(Config, raw, source, "")
    _check(cfg, source, corpora)
    return cfg


def config_to_dict(cfg: Config) -> dict:
    """Plain dicts/lists/scalars only, so a checkpoint can hold it and `weights_only` can load it."""

    def plain(x: Any) -> Any:
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, tuple | list):
            return [plain(v) for v in x]
        if isinstance(x, Enum):  # a Choice as its name: recipes and checkpoints hold plain strings
            return x.value
        return x

    return plain(cfg)


def _build(cls: type, raw: Any, source: str, prefix: str) -> Any:
    where = prefix or "recipe"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where}: expected a mapping, got {_describe(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {_join(prefix, close[0])}?)" if close else ""
            raise ConfigError(f"{source}: unknown key {_join(prefix, key)}{hint}")
    values = {}
    for name, f in fields.items():
        dotted = _join(prefix, name)
        if name in raw:
            values[name] = _coerce(hints[name], raw[name], source, dotted)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{source}: missing required key {dotted}")
    return cls(**values)


def _coerce(tp: Any, value: Any, source: str, dotted: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(inner[0], value, source, dotted)
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a.value if isinstance(a, Enum) else a) for a in args)
            raise ConfigError(f"{source}: {dotted}: {value!r} is not one of {choices}")
        return args[args.index(value)]  # a Choice's member (Precision.FP32) for its name ("fp32")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{source}: {dotted}: expected a list, got {_describe(value)}")
        return tuple(_coerce(args[0], v, source, f"{dotted}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, source, dotted)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{source}: {dotted}: expected {_type_name(tp)}, got {_describe(value)}")


def _check(cfg: Config, source: str, corpora: bool = True) -> None:
    """Combinations that no single type can rule out."""
    m, t, d, data = cfg.model, cfg.train, cfg.decode, cfg.data

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{source}: {key}: {why}")

    # Each value is checked before any arithmetic is done with it: positive before `d_model % heads`.
    for key in ("encoder_layers", "decoder_layers", "d_model", "d_ff", "heads", "max_positions"):
        need(getattr(m, key) > 0, f"model.{key}", "must be positive")
        limit = MODEL_LIMITS[key]
        need(getattr(m, key) <= limit, f"model.{key}", f"must be at most {limit:,}, got {getattr(m, key):,}")
    need(m.d_model % m.heads == 0, "model.heads", f"d_model {m.d_model} is not divisible by {m.heads} heads")
    need(m.d_model % 2 == 0, "model.d_model", "must be even for sinusoidal positions")
    for key in ("dropout", "attention_dropout", "activation_dropout"):
        need(0.0 <= getattr(m, key) < 1.0, f"model.{key}", "must be in [0, 1)")
    for key in ("batch_tokens", "update_tokens", "max_steps", "warmup", "log_every", "validate_every"):
        need(getattr(t, key) > 0, f"train.{key}", "must be positive")
    for key in ("save_every", "keep_last", "average_last", "max_nonfinite"):
        need(getattr(t, key) > 0, f"train.{key}", "must be positive")
    need(0.0 <= t.label_smoothing < 1.0, "train.label_smoothing", "must be in [0, 1)")
    need(t.peak_lr is None or 0 < t.peak_lr < math.inf, "train.peak_lr", "must be a positive number")
    need(t.max_minutes is None or t.max_minutes > 0, "train.max_minutes", "must be positive")
    need(0.0 <= t.cooldown <= 1.0, "train.cooldown", "must be in [0, 1]")
    need(parse_device(t.device) is not None, "train.device", f"{t.device!r} is not auto, cpu, cuda or cuda:N")
    _check_decode(d, lambda ok, name, why: need(ok, f"decode.{name}", why), lambda name: f"decode.{name}")
    for key in ("lr_scale", "adam_eps"):
        need(0 < getattr(t, key) < math.inf, f"train.{key}", "must be a positive number")
    for key in ("adam_beta1", "adam_beta2"):
        need(0.0 <= getattr(t, key) < 1.0, f"train.{key}", "must be in [0, 1)")
    for key in ("weight_decay", "clip_norm"):
        need(0 <= getattr(t, key) < math.inf, f"train.{key}", "must be 0 or more")
    need(t.patience >= 0, "train.patience", "must be 0 (off) or more")
    need(t.threads is None or t.threads > 0, "train.threads", "must be positive")
    need(0.0 < data.character_coverage <= 1.0, "data.character_coverage", "must be in (0, 1]")
    for key in ("spm_sample_sentences", "max_subwords", "max_ratio"):
        need(getattr(data, key) > 0, f"data.{key}", "must be positive")
    need(data.min_words >= 0, "data.min_words", "must be 0 or more")
    need(data.max_words >= data.min_words, "data.max_words", "must be at least data.min_words")
    need(data.vocab_size >= 16, "data.vocab_size", "must be at least 16")
    limit = MODEL_LIMITS["vocab_size"]
    need(data.vocab_size <= limit, "data.vocab_size", f"must be at most {limit:,}, got {data.vocab_size:,}")
    need(data.src_lang != data.tgt_lang, "data.tgt_lang", "must differ from data.src_lang")
    need(0.0 <= data.langid_threshold <= 1.0, "data.langid_threshold", "must be in [0, 1]")
    a = data.augment
    for key in ("uppercase", "titlecase", "typos", "remove_end_punct", "inline_terms", "inline_terms_other"):
        need(
            0.0 <= getattr(a, key) <= 1.0, f"data.augment.{key}", f"must be in [0, 1], got {getattr(a, key)}"
        )
    need(
        a.uppercase + a.titlecase <= 1.0,
        "data.augment.titlecase",
        "upper and title case exclude each other: uppercase + titlecase must be at most 1",
    )
    need(len(data.train) > 0 or not corpora, "data.train", "names no corpus")
    need(len(data.valid) > 0 or not corpora, "data.valid", "names no corpus")
    need(
        0 < data.sampling_temperature < math.inf,
        "data.sampling_temperature",
        f"must be a positive number, got {data.sampling_temperature}",
    )
    names = ", ".join(f"{s}-{t}" for s, t in data.directions)
    for section in ("train", "valid", "test"):
        for i, c in enumerate(getattr(data, section)):
            pair = c.src is not None and c.tgt is not None
            need(
                pair != (c.sacrebleu is not None),
                f"data.{section}[{i}]",
                "give either src and tgt files or a sacrebleu test set name",
            )
            need(0 < c.weight < math.inf, f"data.{section}[{i}].weight", f"must be positive, got {c.weight}")
            need(
                section == "train" or not c.tag,
                f"data.{section}[{i}].tag",
                "only training corpora are tagged: the model is validated and tested on real sources",
            )
            src, tgt = data.direction(c)
            need(not same(src, tgt), f"data.{section}[{i}].tgt_lang", f"must differ from its source {src}")
            need(
                section == "train" or not corpora or (src, tgt) in data.directions,
                f"data.{section}[{i}]",
                f"{src}-{tgt} is not a direction the training corpora hold ({names})",
            )
    bt = data.backtranslate
    if bt is not None:
        need(len(bt.mono) > 0 or not corpora, "data.backtranslate.mono", "names no monolingual file")
        need(bt.max_lines is None or bt.max_lines > 0, "data.backtranslate.max_lines", "must be positive")
        for key in ("seed", "max_lines"):  # nmt backtranslate's --seed and --max-lines: refused here, not
            value = getattr(bt, key)  # after the reverse model has trained
            why = limits.QUANTITIES[key].problem(value) if value is not None else None
            need(why is None, f"data.backtranslate.{key}", f"must be {why}, got {value}")
        need(0 < bt.weight < math.inf, "data.backtranslate.weight", f"must be positive, got {bt.weight}")
        need(
            bt.reverse_minutes is None or bt.reverse_minutes > 0,
            "data.backtranslate.reverse_minutes",
            "must be positive",
        )
        need(
            bt.tag or not bt.compare_untagged,
            "data.backtranslate.compare_untagged",
            "compares tagged with untagged pairs: it needs tag: true",
        )
        need(
            not data.multilingual,
            "data.backtranslate",
            "back-translates into one language pair's source; this recipe has several directions",
        )
        need(
            data.init_from is None,
            "data.backtranslate",
            "not with data.init_from: give the fine-tuned model's reverse as data.backtranslate.reverse",
        )
        need(
            bt.name not in {c.name for c in data.train},
            "data.backtranslate.name",
            f"{bt.name} already names a training corpus",
        )
    if data.multilingual:  # a corpus is named by its name and direction in statistics and results
        for section in ("train", "valid", "test"):
            seen = [(c.name, data.direction(c)) for c in getattr(data, section)]
            dup = next((n for n, d in seen if seen.count((n, d)) > 1), None)
            need(dup is None, f"data.{section}", f"{dup} is named twice for one direction")


def parse_device(name: str) -> tuple[str, int | None] | None:
    """A device's name as config and runtime accept it: auto, cpu, cuda or cuda:N -> (kind, N or None);
    None for anything else (the caller's error names its key)."""
    text = name.strip().lower()
    if text in ("auto", "cpu"):
        return text, None
    kind, _, index = text.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        return None
    return kind, int(index) if index else None


def _check_decode(d: DecodeConfig, need, key) -> None:
    """The decode rules, for a recipe and for options given on a command line alike; `key` names a field."""
    need(d.beam >= 1, "beam", f"must be at least 1, got {d.beam}")
    need(
        d.nbest >= 1 and (d.sampling or d.nbest <= d.beam),
        "nbest",
        f"must be between 1 and {key('beam')} ({d.beam}), got {d.nbest}",
    )
    need(math.isfinite(d.lenpen), "lenpen", f"must be a finite number, got {d.lenpen}")
    need(
        math.isfinite(d.max_len_a) and d.max_len_a >= 0, "max_len_a", f"must be 0 or more, got {d.max_len_a}"
    )
    need(d.max_len_b >= 0, "max_len_b", f"must be 0 or more, got {d.max_len_b}")
    need(d.min_len >= 0, "min_len", f"must be 0 or more, got {d.min_len}")
    need(d.batch_tokens > 0, "batch_tokens", f"must be positive, got {d.batch_tokens}")
    need(
        d.no_repeat_ngram_size >= 0,
        "no_repeat_ngram_size",
        f"must be 0 or more, got {d.no_repeat_ngram_size}",
    )
    need(d.sampling_topk >= 0, "sampling_topk", f"must be 0 (no cut) or more, got {d.sampling_topk}")
    need(0.0 < d.sampling_topp <= 1.0, "sampling_topp", f"must be in (0, 1], got {d.sampling_topp}")
    need(
        math.isfinite(d.temperature) and d.temperature > 0,
        "temperature",
        f"must be positive, got {d.temperature}",
    )
    # The rest of each bound (the most values, the seed's range), as nmt.limits states it for the options
    # of the same names: a recipe or a request may not ask for what the command line may not.
    for name in DECODE_BOUNDED:
        value = getattr(d, name)
        why = limits.QUANTITIES[name].problem(value)
        need(why is None, name, f"must be {why}, got {limits.show(value)}")


DECODE_BOUNDED = [f.name for f in dataclasses.fields(DecodeConfig) if f.name in limits.QUANTITIES]


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if not isinstance(value, dict | list) else type(value).__name__


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))
