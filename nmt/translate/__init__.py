"""Translation: the line front end (nmt.translate.frontend) over one of two engines.

search (greedy, beam, sampling over the decoder contract), torch_engine and ctranslate2_engine (subword ids
in, hypotheses out), ensemble (several models as one), export (a checkpoint as a CTranslate2 folder).
"""

from nmt.translate.frontend import (
    LineTranslator,
    Translator,
    ctranslate2_translator,
    load_translator,
    token_batches,
    translate_stream,
)

__all__ = [
    "LineTranslator",
    "Translator",
    "ctranslate2_translator",
    "load_translator",
    "token_batches",
    "translate_stream",
]
