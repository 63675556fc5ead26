"""The alphabet and the transcript <-> id mapping."""
import pytest

from data.text import ALPHABET, BLANK, NUM_CLASSES, counted, decode, encode, normalize_text


def test_alphabet_has_the_blank_first_then_apostrophe_letters_and_space():
    assert ALPHABET[BLANK] == "_" and BLANK == 0
    assert NUM_CLASSES == 29 == len(ALPHABET)
    assert ALPHABET[1:] == "'" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + " "


def test_normalize_upper_cases_and_collapses_whitespace():
    assert normalize_text("  it's\tten\n o'clock  ") == "IT'S TEN O'CLOCK"
    assert normalize_text(" \t\n") == ""


def test_normalize_writes_typographic_apostrophes_as_the_alphabets_and_keeps_other_marks():
    assert normalize_text("don\u2019t \u2018tis o\u02bcclock") == "DON'T 'TIS O'CLOCK"
    for text in ("don`t", "caf\u00e9", "\u201cyes\u201d"):  # a backtick, an accent, double quotes: still refused
        with pytest.raises(ValueError, match="outside the alphabet"):
            encode(normalize_text(text))


def test_encode_decode_round_trip_never_uses_the_blank():
    text = "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG'S BACK"
    ids = encode(text)
    assert len(ids) == len(text)
    assert all(1 <= index < NUM_CLASSES for index in ids)
    assert decode(ids) == text
    assert encode("") == []


@pytest.mark.parametrize("text, offending", [("hello", "['e', 'h', 'l', 'o']"), ("CAFÉ", "['É']"), ("A_B", "['_']"),
                                             ("1 2", "['1', '2']")])
def test_encode_names_characters_outside_the_alphabet(text, offending):
    # The whole message: a match on "'e'" passed with every character of the transcript listed as outside.
    with pytest.raises(ValueError) as error:
        encode(text)
    assert str(error.value) == f"transcript {text!r} has characters outside the alphabet {ALPHABET[1:]!r}: {offending}"


def test_decode_shows_blanks_and_rejects_ids_outside_the_alphabet():
    assert decode([BLANK, encode("A")[0], BLANK]) == "_A_"
    with pytest.raises(ValueError, match=r"^id 29 is outside the alphabet's range 0\.\.28$"):
        decode([1, NUM_CLASSES])
    with pytest.raises(ValueError, match=r"^id -1 is outside the alphabet's range 0\.\.28$"):
        decode([-1])


def test_counted_words_every_count_but_one_in_the_plural():
    assert [counted(count, "utterance") for count in (0, 1, 2)] == ["0 utterances", "1 utterance", "2 utterances"]
