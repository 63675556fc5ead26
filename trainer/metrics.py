"""Corpus-level word / character error rates."""
from dataclasses import dataclass

import torch


def edit_distance(reference: list, hypothesis: list) -> int:
    """Levenshtein distance: substitutions, deletions and insertions all cost one."""
    previous = list(range(len(hypothesis) + 1))
    for i, ref_item in enumerate(reference, start=1):
        current = [i]
        for j, hyp_item in enumerate(hypothesis, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ref_item != hyp_item)))
        previous = current
    return previous[-1]


@dataclass
class ErrorCounts:
    """Error and reference counts summed over a corpus; rates are ratios of the sums, not means of ratios."""

    word_errors: int = 0
    words: int = 0
    char_errors: int = 0
    chars: int = 0

    def add(self, reference: str, hypothesis: str) -> tuple[int, int]:
        """Counts one utterance; returns its (word errors, char errors)."""
        word_errors = edit_distance(reference.split(), hypothesis.split())
        char_errors = edit_distance(list(reference), list(hypothesis))
        self.word_errors += word_errors
        self.words += len(reference.split())
        self.char_errors += char_errors
        self.chars += len(reference)
        return word_errors, char_errors

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.word_errors, self.words, self.char_errors, self.chars], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, counts: torch.Tensor) -> "ErrorCounts":
        return cls(*(int(round(value)) for value in counts.tolist()))

    @property
    def wer(self) -> float:
        return 100.0 * self.word_errors / max(self.words, 1)

    @property
    def cer(self) -> float:
        return 100.0 * self.char_errors / max(self.chars, 1)
