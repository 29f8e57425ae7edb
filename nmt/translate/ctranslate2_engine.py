"""The CTranslate2 engine, over a folder written by `nmt export --format ctranslate2`.

A sibling of nmt.translate.torch_engine under the same front end (nmt.translate.LineTranslator): subword
ids in, n-best hypotheses out, nothing of lines or files; so both engines see the same batches. Decode options
map to CTranslate2's own: min_len -> min_decoding_length, no_repeat_ngram_size, prefixes -> target_prefix,
sampling -> sampling_topk / sampling_topp / sampling_temperature with a random seed set once (again per
chunk by nmt.translate.chunks: `reseed`).

How nmt.translate.search's conventions are obtained from CTranslate2's beam search:
- Stopping: a sentence stops once K hypotheses have finished, as ours (rule (a)). CTranslate2 does so
  whenever a length penalty is set; it would otherwise stop at the first finished top beam. So it runs
  with a negligible penalty (|Y|^1e-9, exactly 1 in float32), returns all K finished hypotheses with
  their raw scores (sums of log-probs, EOS included), and the n-best are re-ranked here with the GNMT
  penalty ((5 + |Y|) / 6)^alpha, |Y| counting the EOS, which CTranslate2's |Y|^alpha cannot express.
  Our early stop (rule (b)) only saves work: it never changes the n-best.
- PAD and BOS are never emitted; EOS may come first (an empty translation). CTranslate2 removes PAD and
  BOS before its softmax where our search masks them after it, so its log-probs are renormalized over
  the other tokens: scores come out slightly higher (by the mass the model puts on PAD and BOS, about
  0.01 a token for a model trained with label smoothing), and near-ties can rank differently.
- Prefixes: CTranslate2's scores leave out the forced prefix's log-probs where our search counts them,
  so with beam > 1 and a prefix the length-normalized reranking can pick another hypothesis.
- Length limit: floor(a * |x| + b) tokens before the EOS. CTranslate2 has one limit per batch, so it
  decodes up to the batch's largest limit and longer hypotheses are cut at their sentence's limit. At a
  limit our search forces EOS where CTranslate2 cuts the hypothesis; outputs can differ only for
  sentences that reach their limit (a trained model rarely does with the paper's a=1, b=50).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from nmt.config import DecodeConfig, Engine, Precision
from nmt.errors import NmtError
from nmt.formats.ctranslate2 import VMAP_FILE, import_ctranslate2, read_meta
from nmt.tokens import BOS, EOS, PAD
from nmt.translate.search import Hypothesis, length_penalty, output_limits

NO_PENALTY = 1e-9  # non-zero, so CTranslate2 waits for K finished hypotheses; |Y|^1e-9 == 1.0 in float32
# `--dtype` as CTranslate2's compute type; auto keeps the type the folder was written in (float32)
COMPUTE_TYPES = {
    Precision.AUTO: "default",
    Precision.FP32: "float32",
    Precision.BF16: "bfloat16",
    Precision.FP16: "float16",
    Precision.INT8: "int8",
}


def compute_type(precision: Precision, device) -> str:
    """CTranslate2's compute type for `--dtype`; one line naming what it can do instead where CTranslate2
    cannot compute in it on this device (bf16 or fp16 on most CPUs)."""
    wanted = COMPUTE_TYPES[precision]
    if wanted == "default":
        return wanted
    kind = str(device).partition(":")[0]
    try:
        supported = import_ctranslate2().get_supported_compute_types(kind)
    except (RuntimeError, ValueError) as e:
        raise NmtError(f"--device {device}: CTranslate2 cannot run there ({e})") from None
    if wanted not in supported:
        can = ", ".join(sorted(p for p, c in COMPUTE_TYPES.items() if c in supported and c != "default"))
        raise NmtError(
            f"--dtype {precision}: CTranslate2 cannot compute in {wanted} on {kind}; it can: auto, {can}"
        )
    return wanted


class CT2Engine:
    """An exported model folder, searched by CTranslate2, reranked as nmt.translate.search."""

    name = Engine.CTRANSLATE2

    def __init__(
        self,
        model_dir: Path,
        decode: DecodeConfig,
        device: str = "cpu",
        compute_type: str = "default",
        threads: int | None = None,
        inter_threads: int = 1,
    ):
        ct2 = import_ctranslate2()
        model_dir = Path(model_dir)
        meta = read_meta(model_dir)
        self.decode = decode
        self.max_positions = int(meta["max_positions"])
        if decode.sampling:
            ct2.set_random_seed(decode.seed)
        self.pieces: list[str] = json.loads((model_dir / "shared_vocabulary.json").read_text("utf-8"))
        self.ids = {piece: i for i, piece in enumerate(self.pieces)}
        if decode.shortlist and not (model_dir / VMAP_FILE).is_file():
            raise NmtError(
                f"{model_dir}: carries no shortlist ({VMAP_FILE}); export a checkpoint that has one "
                "(nmt shortlist)"
            )
        kind, _, index = device.partition(":")
        self.options = dict(
            device=kind,
            device_index=int(index or 0),
            compute_type=compute_type,
            inter_threads=inter_threads,  # batches searched at once (nmt.translate.workers.BatchThreads)
            intra_threads=threads or 0,  # 0: CTranslate2's default
        )
        self.model_dir = model_dir
        try:
            self.engine = ct2.Translator(str(model_dir), **self.options)
        except (RuntimeError, ValueError) as e:
            raise NmtError(
                f"{model_dir}: CTranslate2 cannot load it on {device} ({compute_type}): {e}"
            ) from None
        self.compute_type: str = self.engine.compute_type  # what "default" turned out to be

    def reseed(self, seed: int) -> None:
        """Sampling from here on draws from the stream of `seed` (nmt.translate.chunks: one per chunk).
        CTranslate2 seeds each of its threads' generators once, from the global seed at the thread's
        first draw, so setting the seed alone changes nothing on a translator that has sampled: the
        translator is opened again, with new threads."""
        import_ctranslate2().set_random_seed(seed)
        del self.engine  # its threads and weights go before the new ones load
        self.engine = import_ctranslate2().Translator(str(self.model_dir), **self.options)

    def limits(self, ids: list[list[int]], prefixes: list[list[int]] | None) -> list[int]:
        """Tokens each source may have before its EOS: nmt.translate.search's output_limits."""
        d = self.decode
        prefix_len = torch.tensor([len(p) for p in prefixes]) if prefixes is not None else None
        src_len = torch.tensor([len(x) for x in ids])
        return output_limits(src_len, d.max_len_a, d.max_len_b, self.max_positions, prefix_len).tolist()

    def search(
        self, ids: list[list[int]], prefixes: list[list[int]] | None = None, nbest: int | None = None
    ) -> list[list[Hypothesis]]:
        """The `nbest` (by default decode.nbest) best (token ids, GNMT-normalized score) of each source,
        best first."""
        d = self.decode
        n = d.nbest if nbest is None else nbest
        limits = self.limits(ids, prefixes)
        options = {}
        if d.sampling:
            options = dict(
                beam_size=1,
                num_hypotheses=n,
                sampling_topk=d.sampling_topk,
                sampling_topp=d.sampling_topp,
                sampling_temperature=d.temperature,
            )
        results = self.engine.translate_batch(
            [[self.pieces[i] for i in x] for x in ids],  # CTranslate2 appends the EOS itself
            target_prefix=[[self.pieces[i] for i in p] or None for p in prefixes] if prefixes else None,
            **(options or dict(beam_size=d.beam, num_hypotheses=d.beam)),
            length_penalty=NO_PENALTY if d.beam > 1 and not d.sampling else 0.0,
            max_input_length=0,  # already truncated above
            max_decoding_length=max(limits) + 1,  # + 1: the step that emits the EOS
            min_decoding_length=d.min_len,
            no_repeat_ngram_size=d.no_repeat_ngram_size,
            suppress_sequences=[[self.pieces[PAD]], [self.pieces[BOS]]],
            return_scores=True,
            return_end_token=True,
            use_vmap=d.shortlist,  # CTranslate2 decodes a batch over the union of its sentences' sets
        )
        out = []
        for limit, result in zip(limits, results, strict=True):
            hyps = []
            for tokens, raw in zip(result.hypotheses, result.scores, strict=True):
                seq = [self.ids[t] for t in tokens]
                if seq and seq[-1] == EOS:
                    seq.pop()
                seq = seq[:limit]
                hyps.append(Hypothesis(seq, raw / length_penalty(len(seq) + 1, d.lenpen)))  # |Y| with the EOS
            hyps.sort(key=lambda h: -h.score)
            out.append(hyps[:n])
        return out
