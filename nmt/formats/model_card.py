"""The model card (README.md) of an exported MarianMT (or Pegasus) folder: what the Hugging Face Hub shows
and indexes.

Its front matter carries the Hub's fields: the two languages, the licence (which only the user can say:
`nmt export --license`, a placeholder that says so until then), the pipeline tag `translation`. The body
gives the model's sizes, the training recipe as nmt read it, and the test scores that `nmt run` wrote to
results.json beside the checkpoint, when they are this checkpoint's. It names the layout: MarianMT for a
post-norm model, Pegasus (PegasusForConditionalGeneration, with MarianMT's tokenizer) for a pre-norm one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import yaml

from nmt.config import Config, config_to_dict
from nmt.errors import NmtError
from nmt.languages import short, tag_language

LICENSE_UNSET = "unknown"  # the Hub's own word for a licence nobody stated
LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")  # the Hub's licence identifiers: apache-2.0, cc-by-4.0, ...


def check_license(license: str | None) -> str | None:
    """`--license` as the Hub writes licences (lower case, e.g. apache-2.0); NmtError otherwise."""
    if license is not None and not LICENSE_ID.fullmatch(license):
        raise NmtError(
            f"--license {license!r}: expected a licence identifier as the Hugging Face Hub writes it, "
            "e.g. apache-2.0, mit, cc-by-4.0"
        )
    return license


USE_MARIAN = [
    "from transformers import MarianMTModel, MarianTokenizer",
    "",
    'tokenizer = MarianTokenizer.from_pretrained("path/to/this/folder")',
    'model = MarianMTModel.from_pretrained("path/to/this/folder")',
]
USE_PEGASUS = [  # the Auto classes: config.json names the model, tokenizer_config.json the tokenizer
    "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
    "",
    'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")  # a MarianTokenizer',
    'model = AutoModelForSeq2SeqLM.from_pretrained("path/to/this/folder")  # PegasusForConditionalGeneration',
    "# not MarianMTModel: its post-norm layers cannot hold this model, and it refuses to load it",
]


# Corpora whose domain a user would not guess from the model: a word in a training corpus's name or URL,
# and what the limitations section says of it.
DOMAINS = {
    "multi30k": "image captions (Multi30k: one-sentence descriptions of Flickr photos, about 12 words "
    "long); expect much weaker translations of news, dialogue, technical or long text",
}


def model_card(cfg: Config, model_path: Path, license: str | None = None, tags: Sequence[str] = ()) -> str:
    """README.md for the export of the checkpoint `model_path` (whose config is `cfg`); `tags`: the
    target tags of a model of several targets (`>>fra<<`, ...), which its card lists and its example
    uses."""
    check_license(license)
    src, tgt, m = cfg.data.src_lang, cfg.data.tgt_lang, cfg.model
    targets = [short(tag_language(tag) or tag) for tag in tags]
    into = " and ".join(filter(None, [", ".join(targets[:-1]), targets[-1]])) if targets else tgt
    lead = f"{tags[0]} " if tags else ""  # what the example puts in front of its line
    pre = m.norm == "pre"  # nmt.formats.huggingface.layout_of
    name = model_name(model_path)
    results = find_results(model_path)
    front = {
        "language": list(dict.fromkeys([src, *targets])) if targets else [src, tgt],
        "license": license or LICENSE_UNSET,
        "pipeline_tag": "translation",
        "library_name": "transformers",
        "tags": ["translation", "pegasus" if pre else "marian", "nmt"],
    }
    if cfg.data.train:  # an imported model records none
        front["datasets"] = [corpus.name for corpus in cfg.data.train]
    if results is not None and (index := model_index(name, src, tgt, results)):
        front["model-index"] = index
    head = yaml.safe_dump(front, sort_keys=False, allow_unicode=True).rstrip("\n")
    if license is None:  # a YAML comment on the licence's own line
        unset = f"license: {LICENSE_UNSET}"
        head = head.replace(unset, unset + "  # not set: export again with --license, e.g. apache-2.0", 1)
    lines = [
        "---",
        head,
        "---",
        "",
        f"# {name}: {src} to {', '.join(targets) if targets else tgt} translation",
        "",
        f"A Transformer (Vaswani et al., 2017) translating {src} into {into}, trained with nmt and exported "
        + (
            "as a Pegasus model (PegasusForConditionalGeneration: pre-LayerNorm layers) with a MarianMT "
            "tokenizer and OPUS-MT's vocabulary layout, for transformers, ONNX and CTranslate2."
            if pre
            else "as a MarianMT model (OPUS-MT's layout) for transformers, ONNX and CTranslate2."
        ),
        "",
        *target_section(tags),
        "## Licence",
        "",
        f"`{license}`" if license else "Not set: who publishes the model sets it (`nmt export --license`).",
        "",
        "## Use",
        "",
        "```python",
        *(USE_PEGASUS if pre else USE_MARIAN),
        f'batch = tokenizer(["{lead}A sentence to translate."], return_tensors="pt")',
        "print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))",
        "```",
        "",
        "## Model",
        "",
        f"- {m.encoder_layers} encoder and {m.decoder_layers} decoder layers, d_model {m.d_model}, "
        f"feed-forward {m.d_ff}, {m.heads} heads, {m.activation}, "
        + ("pre-LayerNorm and a LayerNorm after each stack" if pre else "post-LayerNorm")
        + ", sinusoidal positions",
        f"- one vocabulary of {cfg.data.vocab_size} SentencePiece pieces shared by both languages and the "
        "output projection",
        f"- the decoder starts from {start_description(m.decoder_start, pre)}",
        "",
        "## Test scores",
        "",
        *scores_table(results),
        "",
        "## Limitations",
        "",
        *limitations(cfg),
        "",
        "## Training recipe",
        "",
        "The configuration nmt trained with (`nmt train`), every default filled in:",
        "",
        "```yaml",
        yaml.safe_dump(recipe(cfg), sort_keys=False, allow_unicode=True).rstrip("\n"),
        "```",
    ]
    return "\n".join(lines) + "\n"


def target_section(tags: Sequence[str]) -> list[str]:
    """What a model of several targets needs of its user: a tag in front of each line (none for one)."""
    if not tags:
        return []
    rows = [f"| {short(tag_language(tag) or tag)} | `{tag}` |" for tag in tags]
    return [
        "## Target languages",
        "",
        "One model translates into each of these languages. As with OPUS-MT's multi-target models, each "
        f"source line starts with its target language's tag, e.g. `{tags[0]} A sentence.`",
        "",
        "| language | tag |",
        "| --- | --- |",
        *rows,
        "",
    ]


def start_description(decoder_start: str, pre: bool = False) -> str:
    if pre:  # CTranslate2's Pegasus converter embeds the start token's row, whatever it holds
        vector = "a zero vector" if decoder_start == "zero" else "a learned vector"
        return f"{vector} (`model.decoder_start: {decoder_start}`), the <pad> row"
    if decoder_start == "zero":
        return (
            "a zero vector (`model.decoder_start: zero`, Marian's convention): CTranslate2's "
            "ct2-transformers-converter is exact too"
        )
    return (
        "a learned vector (`model.decoder_start: bos`), the <pad> row: transformers and ONNX are exact; "
        "CTranslate2's ct2-transformers-converter starts from a zero vector instead, so convert the "
        "checkpoint with `nmt export --format ctranslate2`"
    )


def recipe(cfg: Config) -> dict:
    """The config's sections, without fine-tuning's checkpoint path (a path of the machine that trained)."""
    sections = config_to_dict(cfg)
    if sections["data"].get("init_from"):
        sections["data"]["init_from"] = Path(sections["data"]["init_from"]).name
    return sections


def model_name(model_path: Path) -> str:
    """The model's name: its run's folder (runs/NAME/checkpoints/average.pt), else the file's stem."""
    path = Path(model_path)
    return path.parent.parent.name if path.parent.name == "checkpoints" else path.stem


def find_results(model_path: Path) -> dict | None:
    """results.json (from `nmt run`) beside the checkpoint or in its run's folder, when its scores were
    measured on this checkpoint."""
    for folder in (model_path.parent, model_path.parent.parent):
        results = read_results(folder / "results.json")
        if results is not None and Path(str(results.get("model", ""))).name == model_path.name:
            return results
    return None


def cell(value: object) -> str:
    """A GFM table cell: a `|` splits cells even inside a code span unless escaped (sacreBLEU's
    signatures are full of them), and a line break would end the row."""
    return " ".join(str(value).split()).replace("|", "\\|")


def scores_table(results: dict | None) -> list[str]:
    """The test scores of `results` (find_results) as a Markdown table."""
    if results is None:
        return ["None recorded: `nmt run` writes them to results.json beside the checkpoints it scores."]
    d = results.get("decode", {})
    rows = [
        f"sacreBLEU and chrF of `nmt run` (beam {d.get('beam')}, length penalty {d.get('lenpen')}):",
        "",
        "| test set | BLEU | chrF | BLEU signature |",
        "| --- | --- | --- | --- |",
    ]
    for name, entry in results["tests"].items():
        bleu, chrf = entry.get("bleu", {}), entry.get("chrf", {})
        signature = cell(bleu.get("signature", ""))
        row = [cell(name), cell(bleu.get("score", "")), cell(chrf.get("score", ""))]
        rows.append(f"| {' | '.join(row)} | `{signature}` |")
    return rows


def model_index(name: str, src: str, tgt: str, results: dict) -> list[dict]:
    """The Hub's model-index (its evaluation results widget): one result per scored test set."""
    entries = []
    for test, entry in results["tests"].items():
        metrics = [
            {"type": metric, "value": entry[metric]["score"], "name": label}
            for metric, label in (("bleu", "BLEU"), ("chrf", "chrF"))
            if isinstance(entry.get(metric), dict) and isinstance(entry[metric].get("score"), int | float)
        ]
        pair = entry.get("direction") or f"{src}-{tgt}"  # a model of several directions scores each
        if metrics:
            entries.append(
                {
                    "task": {"type": "translation", "name": f"Translation {pair}"},
                    "dataset": {"name": str(test), "type": str(test)},
                    "metrics": metrics,
                }
            )
    return [{"name": name, "results": entries}] if entries else []


def limitations(cfg: Config) -> list[str]:
    """What the checkpoint knows of its training data, as the limits a user should expect."""
    corpora = cfg.data.train
    where = " ".join(
        f"{c.name} {c.src.url if c.src is not None else ''} {c.sacrebleu or ''}" for c in corpora
    ).lower()
    domains = [text for word, text in DOMAINS.items() if word in where]
    names = ", ".join(f"`{c.name}`" for c in corpora) or "corpora it does not record"
    lines = [f"- Trained only on {names}" + (f": {'; '.join(domains)}." if domains else ".")]
    if not domains:
        lines.append("- Its quality outside the domain of that data has not been measured.")
    lines += [
        f"- Trained on single sentences of at most {cfg.data.max_subwords} subwords: give it one "
        "sentence at a time; a line of several sentences may come back as the first one only.",
        f"- Its vocabulary ({cfg.data.vocab_size} pieces) was learned from that data; words and scripts "
        "it did not hold come out as unknown pieces or copied.",
    ]
    return lines


def read_results(path: Path) -> dict | None:
    """results.json if it is one `nmt run` wrote (an object with a `tests` object), else None."""
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(results, dict) and isinstance(results.get("tests"), dict)
    return results if ok and all(isinstance(e, dict) for e in results["tests"].values()) else None
