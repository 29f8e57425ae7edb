"""The reserved token ids, the same in every vocabulary nmt makes: data, model and search all read them here.

SentencePiece is trained with these ids (nmt.subword), the embedding keeps row PAD at zero (nmt.model),
and search never emits PAD or BOS (nmt.translate.search).
"""

PAD, UNK, BOS, EOS = 0, 1, 2, 3
