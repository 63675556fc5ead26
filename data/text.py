"""The character alphabet the model predicts, the mapping between transcripts and target ids, and how messages word a
count."""
from collections.abc import Iterable

# Index 0 is the CTC blank ("_"); it never appears in a transcript.
ALPHABET = "_'ABCDEFGHIJKLMNOPQRSTUVWXYZ "
BLANK = 0
NUM_CLASSES = len(ALPHABET)

_CHAR_TO_ID = {char: index for index, char in enumerate(ALPHABET) if index != BLANK}

# The apostrophes of typeset English ("don’t", "‘tis", the modifier letter ʼ): word processors write them for
# "'", and left as they are they would leave the transcript out as outside the alphabet. Other marks stay outside it.
_APOSTROPHES = str.maketrans(dict.fromkeys("\u2018\u2019\u02bc", "'"))


def normalize_text(text: str) -> str:
    """Upper-case `text`, write typographic apostrophes (‘ ’ ʼ) as "'", and collapse each run of whitespace to one
    space (none at the ends)."""
    return " ".join(text.upper().translate(_APOSTROPHES).split())


def invalid_characters(text: str) -> list[str]:
    """The distinct characters of `text` that `encode` cannot map, sorted."""
    return sorted(set(text) - _CHAR_TO_ID.keys())


def encode(text: str) -> list[int]:
    """Map a normalised transcript to target ids in 1..NUM_CLASSES-1 (never the blank).

    Raises ValueError naming the characters outside the alphabet (lower case included: normalise first).
    """
    bad = invalid_characters(text)
    if bad:
        raise ValueError(f"transcript {text!r} has characters outside the alphabet {ALPHABET[1:]!r}: {bad}")
    return [_CHAR_TO_ID[char] for char in text]


def decode(ids: Iterable[int]) -> str:
    """Map ids back to characters, the blank included as "_" (collapsing CTC output is the decoder's job)."""
    chars = []
    for index in ids:
        if not 0 <= index < NUM_CLASSES:
            raise ValueError(f"id {index} is outside the alphabet's range 0..{NUM_CLASSES - 1}")
        chars.append(ALPHABET[index])
    return "".join(chars)


def counted(count: int, noun: str) -> str:
    """'1 step', '2 steps', '0 steps': a count and its noun, as every log line and message words one."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
