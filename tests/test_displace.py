"""The model's own word for a term's source, found by the attention of its translation without terms
(nmt.translate.displace), on hand-made attention."""

from __future__ import annotations

import torch

from nmt.translate.constraints import Constraint
from nmt.translate.displace import own_words, with_bans

# pieces: 0 "▁Ein" 1 "▁Mann" 2 "▁fährt" 3 "▁ein" 4 "▁Fahr" 5 "rad" 6 "." 7 "▁Velo" 8 "▁Hund" 9 "e"
GLUE = torch.tensor([False, False, False, False, False, True, False, False, False, True])
WORD_ENDS = torch.tensor([True, True, True, True, True, True, False, True, True, True])
VELO = Constraint(((7,),), 1, (4,))  # "bike", the source's subword 4: "▁A ▁man ▁rides ▁a ▁bike ."


def attention(links: list[int], width: int = 7) -> torch.Tensor:
    """(T, S+1) attention: row t puts 0.7 on source subword links[t], the rest spread evenly."""
    out = torch.full((len(links), width), 0.3 / (width - 1))
    out[torch.arange(len(links)), torch.tensor(links)] = 0.7
    return out


def test_the_word_aligned_both_ways_to_the_terms_source_is_banned_whole():
    tokens = [0, 1, 2, 3, 4, 5, 6]  # Ein Mann fährt ein Fahr-rad .
    att = attention([0, 1, 2, 3, 4, 4, 5])
    assert own_words(att, tokens, [VELO], GLUE, WORD_ENDS) == [(4, 5)]
    assert with_bans([[VELO]], [[(4, 5)]]) == [[VELO, Constraint(((4, 5),), 0)]]


def test_no_ban_without_a_link_both_ways_or_where_the_model_writes_the_term():
    tokens = [0, 1, 2, 3, 4, 5, 6]
    # "Fahr" reads "a" most: the piece reading "bike" most is "rad", whose word then reads "a" by its
    # first piece and "bike" by its second; "rad" alone is enough for a link both ways
    assert own_words(attention([0, 1, 2, 3, 3, 4, 5]), tokens, [VELO], GLUE, WORD_ENDS) == [(4, 5)]
    # the word reading "bike" most reads "a" itself, and no piece of it reads "bike" most: no link
    att = attention([0, 1, 2, 3, 3, 3, 5])
    att[2, 4] = 0.5  # "fährt" is the piece that attends most to "bike", but reads "rides" most
    assert own_words(att, tokens, [VELO], GLUE, WORD_ENDS) == []
    # the translation has the term already
    assert own_words(attention([0, 1, 2, 3, 4, 5]), [0, 1, 2, 3, 7, 6], [VELO], GLUE, WORD_ENDS) == []
    # no source positions (a kept span's copy)
    assert own_words(attention([0, 1, 2, 3, 4, 4, 5]), tokens, [Constraint(((7,),))], GLUE, WORD_ENDS) == []


def test_punctuation_and_a_word_inside_the_term_or_around_it_are_kept():
    # the period reads "bike" most: punctuation is never banned
    assert own_words(attention([0, 1, 2, 3, 4]), [0, 1, 2, 3, 6], [VELO], GLUE, WORD_ENDS) == []
    hunde = Constraint(((8, 9),), 1, (4,))  # the term "Hunde"; the model's word "Hund" is part of it
    assert own_words(attention([0, 1, 2, 3, 4, 5]), [0, 1, 2, 3, 8, 6], [hunde], GLUE, WORD_ENDS) == []
    hund = Constraint(((8,),), 1, (4,))  # the term "Hund"; the model's "Hunde" holds it
    assert own_words(attention([0, 1, 2, 3, 4, 4, 5]), [0, 1, 2, 3, 8, 9, 6], [hund], GLUE, WORD_ENDS) == []


def test_a_target_tag_links_no_word():
    tokens = [0, 1, 2, 3, 4, 5, 6]
    tagged = Constraint(((7,),), 1, (5,))  # after the tag: ">>deu<< ▁A ▁man ▁rides ▁a ▁bike ."
    att = attention([1, 2, 3, 4, 5, 5, 6], width=8)
    att[4:6, 0] = 0.75  # "Fahrrad" reads the tag most
    assert own_words(att, tokens, [tagged], GLUE, WORD_ENDS, lead=0) == []
    assert own_words(att, tokens, [tagged], GLUE, WORD_ENDS, lead=1) == [(4, 5)]


def test_a_translation_with_the_term_already_bans_nothing():
    """Where the model writes the term by itself, even out of its place, nothing is banned: a word linked
    to the term's source there may be a word of the line the search would then lose."""
    tokens = [0, 1, 2, 8, 6, 7]  # Ein Mann fährt Hund . Velo
    att = attention([0, 1, 2, 4, 5, 5])
    assert own_words(att, tokens, [VELO], GLUE, WORD_ENDS) == []
    assert own_words(att, [0, 1, 2, 8, 6], [VELO], GLUE, WORD_ENDS) == [(8,)]  # without the term


def test_a_word_that_is_another_term_of_the_line_is_never_banned():
    """A random model's translation "Velo Velo Velo" for a line with two terms, bike -> Velo and man -> Hund:
    the word linked to "man" is Velo, the other term, which a ban would leave no room for."""
    hund = Constraint(((8,),), 1, (1,))  # "man", the source's subword 1
    att = attention([1, 1, 4])
    assert own_words(att, [7, 7, 7], [VELO, hund], GLUE, WORD_ENDS) == []
    assert own_words(att, [7, 7, 7], [hund], GLUE, WORD_ENDS) == [(7,)]  # alone, Velo is just a word
