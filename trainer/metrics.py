"""Corpus-level word / character error rates."""
import math
from dataclasses import astuple, dataclass

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
    """Error and reference counts summed over a corpus; rates are ratios of the sums, not means of ratios.
    `unreadable` and `too_long_for_stride` count the corpus's utterances that could not be decoded, their audio
    unreadable or too short for their transcript's CTC labels (`not_decoded`, both): a rate over the rest is a rate
    over part of the corpus."""

    word_errors: int = 0
    words: int = 0
    char_errors: int = 0
    chars: int = 0
    unreadable: int = 0
    too_long_for_stride: int = 0

    def add(self, reference: str, hypothesis: str) -> tuple[int, int]:
        """Counts one utterance, both texts normalised as the decoders write them (upper case, single spaces); an
        empty reference counts the hypothesis as insertions. Returns its (word errors, char errors)."""
        word_errors = edit_distance(reference.split(), hypothesis.split())
        char_errors = edit_distance(list(reference), list(hypothesis))
        self.word_errors += word_errors
        self.words += len(reference.split())
        self.char_errors += char_errors
        self.chars += len(reference)
        return word_errors, char_errors

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.float64)

    @classmethod
    def from_tensor(cls, counts: torch.Tensor) -> "ErrorCounts":
        return cls(*(int(round(value)) for value in counts.tolist()))

    @property
    def not_decoded(self) -> int:
        return self.unreadable + self.too_long_for_stride

    # NaN, not 0, over no words: a test set that could not be read must not score as perfect.
    @property
    def wer(self) -> float:
        return 100.0 * self.word_errors / self.words if self.words else math.nan

    @property
    def cer(self) -> float:
        return 100.0 * self.char_errors / self.chars if self.chars else math.nan

    def beats(self, best_not_decoded: float, best_wer: float) -> bool:
        """Whether this evaluation makes a better best checkpoint than one with the given counts (scores_better)."""
        return scores_better(self.not_decoded, self.wer, best_not_decoded, best_wer)


def scores_better(not_decoded: float, wer: float, best_not_decoded: float, best_wer: float) -> bool:
    """Whether an evaluation (`not_decoded` test utterances, `wer`) beats the best one on the same test set: it decoded
    more of the test set, or as much at a lower WER (WERs over different parts of a test set do not compare). NaN
    never."""
    return not math.isnan(wer) and (not_decoded, wer) < (best_not_decoded, best_wer)
