"""Translation: lines through one of two engines, built one way for every front end.

frontend (the line contract: clean, cut, encode, batch by cost, detokenize), builder (a translator from
the user's choices: models, engine, device, precision, glossary, workers; for `nmt translate`, `nmt serve`,
`nmt run` and validation), stream (`nmt translate`'s files and stdin), chunks (a long input in saved,
resumable chunks: `nmt distill`'s teacher, `nmt backtranslate`), testset (a test set translated once
per model, timed and recorded: `nmt run`, `nmt distill`), split (--split-sentences), workers
(--workers: the plan and the worker processes), search (greedy, beam, sampling over the decoder contract;
Beams, the beam state), constraints (constrained beam search), terminology (glossaries and avoid lists:
text -> constraints), torch_engine and ctranslate2_engine (subword ids in, hypotheses out), ensemble
(several models as one), int8 and prepacked (CPU kernels), shortlist (each sentence decoded over its own
set), align (word alignment from cross-attention).
"""

from nmt.translate.builder import BuiltTranslator, build_translator, ctranslate2_translator, inference_model
from nmt.translate.frontend import LineTranslator, Translator, token_batches
from nmt.translate.stream import translate_stream

__all__ = [
    "BuiltTranslator",
    "LineTranslator",
    "Translator",
    "build_translator",
    "ctranslate2_translator",
    "inference_model",
    "token_batches",
    "translate_stream",
]
