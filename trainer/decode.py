"""From the model's per-frame character log probabilities to text: greedy (best path), or a CTC prefix beam search
that can weigh in a word n-gram language model (Hannun et al., 2014, "First-pass large vocabulary continuous
speech recognition using bi-directional recurrent DNNs").

The beam search ranks a transcript W by  log P_ctc(W | audio) + lm_weight * ln P_lm(W) + word_bonus * |W|, the
language model scoring each word as the space after it (or the end) is reached.
"""
import argparse
import math
from dataclasses import dataclass

import torch

from data.text import ALPHABET, BLANK, decode
from trainer.lm import SENTENCE_END, SENTENCE_START, NGramLM

SPACE = ALPHABET.index(" ")
LN_10 = math.log(10)


def greedy_decode(log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    """Best path per frame, repeats collapsed, blanks (BLANK) removed, spaces only between words (as the beam
    search's transcripts and the references have them: a stray space would count as a character error).

    log_probs: (T, B, V); lengths: (B,) valid frames per utterance.
    """
    check_finite(log_probs)
    best = log_probs.argmax(dim=-1).T.cpu()  # (B, T)
    texts = []
    for path, length in zip(best, lengths.tolist()):
        path = torch.unique_consecutive(path[:length])
        texts.append(" ".join(decode(path[path != BLANK].tolist()).split()))
    return texts


def check_finite(log_probs: torch.Tensor) -> None:
    """A NaN would win every argmax and lose every comparison: refuse it rather than decode nonsense."""
    if torch.isnan(log_probs).any():
        raise ValueError("log_probs hold NaN: the model's output is not finite")


@dataclass(frozen=True)
class BeamSearch:
    """beam_width prefixes kept per frame; characters below prune_log_prob at a frame are not tried there. Without
    a language model the ranking is the CTC probability alone (lm_weight and word_bonus apply only with one)."""

    beam_width: int = 16
    lm: NGramLM | None = None
    lm_weight: float = 0.5
    word_bonus: float = 1.0
    prune_log_prob: float = math.log(1e-3)

    def __post_init__(self):
        if self.beam_width < 1:
            raise ValueError(f"beam width must be at least 1, not {self.beam_width}")

    def __call__(self, log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """log_probs: (T, B, V); lengths: (B,). The best transcript of each utterance."""
        check_finite(log_probs)
        frames = log_probs.float().transpose(0, 1).cpu()
        return [self.decode_one(frames[b, :length].tolist()) for b, length in enumerate(lengths.tolist())]

    def decode_one(self, frames: list[list[float]]) -> str:
        # A prefix (a tuple of character ids) carries ln P of its paths ending in a blank and in its last character,
        # and the language model's ln score of its completed words.
        beams = {(): Prefix(blank=0.0)}
        for frame in frames:
            candidates = [c for c, value in enumerate(frame) if value >= self.prune_log_prob]
            if not candidates:  # a threshold above every class: try the likeliest
                candidates = [max(range(len(frame)), key=frame.__getitem__)]
            extended: dict[tuple, Prefix] = {}
            for text, prefix in beams.items():
                total = prefix.total()
                for c in candidates:
                    p = frame[c]
                    if c == BLANK:
                        entry = extended.setdefault(text, Prefix(lm=prefix.lm))
                        entry.blank = _log_add(entry.blank, total + p)
                        continue
                    last = text[-1] if text else None
                    if c == last:  # the same character again: a repeat unless a blank came between
                        entry = extended.setdefault(text, Prefix(lm=prefix.lm))
                        entry.char = _log_add(entry.char, prefix.char + p)
                        arriving = prefix.blank + p
                    else:
                        arriving = total + p
                    if arriving == -math.inf:
                        continue  # no path reaches it
                    if c == SPACE and (not text or last == SPACE):
                        # A space that separates no words spells the same transcript as a blank would.
                        entry = extended.setdefault(text, Prefix(lm=prefix.lm))
                        entry.blank = _log_add(entry.blank, arriving)
                        continue
                    new_text = (*text, c)
                    lm = prefix.lm + (self._word_score(text) if c == SPACE else 0.0)
                    entry = extended.setdefault(new_text, Prefix(lm=lm))
                    entry.char = _log_add(entry.char, arriving)
            beams = dict(sorted(extended.items(), key=lambda item: -self._rank(*item))[: self.beam_width])
        # "X " is the transcript "X": its paths add to those of "X", whose language model score at the end is the same.
        transcripts: dict[tuple, Prefix] = {}
        for text, prefix in beams.items():
            if text and text[-1] == SPACE:
                text, prefix = text[:-1], Prefix(blank=prefix.total(), lm=prefix.lm - self._word_score(text[:-1]))
            entry = transcripts.setdefault(text, Prefix(lm=prefix.lm))
            entry.blank = _log_add(entry.blank, prefix.total())
        best = max(transcripts.items(), key=lambda item: self._rank(*item, final=True))[0]
        return decode(best)

    def _rank(self, text: tuple, prefix: "Prefix", final: bool = False) -> float:
        if self.lm is None:
            return prefix.total()
        words = decode(text).split()
        lm = prefix.lm
        if final:  # the last word (transcripts are ranked without a trailing space), then the end of the sentence
            lm += self._word_score(text) + self._lm_ln(tuple(words), SENTENCE_END)
        return prefix.total() + self.lm_weight * lm + self.word_bonus * len(words)

    def _word_score(self, text: tuple) -> float:
        """ln P_lm of the last word of `text` given the words before it (0 without a language model)."""
        if self.lm is None:
            return 0.0
        words = decode(text).split()
        return self._lm_ln(tuple(words[:-1]), words[-1]) if words else 0.0

    def _lm_ln(self, history: tuple[str, ...], word: str) -> float:
        return self.lm.log10_prob((SENTENCE_START, *history), word) * LN_10


@dataclass
class Prefix:
    blank: float = -math.inf
    char: float = -math.inf
    lm: float = 0.0

    def total(self) -> float:
        return _log_add(self.blank, self.char)


def _log_add(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    return max(a, b) + math.log1p(math.exp(-abs(a - b)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The decoder options of the command-line tools."""
    parser.add_argument("--beam", type=int, help="CTC prefix beam search of this width (default: greedy, or 16 "
                                                 "with --lm)")
    parser.add_argument("--lm", help="an ARPA word n-gram model for the beam search (python -m trainer.lm builds one)")
    parser.add_argument("--lm-weight", type=float, default=BeamSearch.lm_weight, help="weight of ln P_lm")
    parser.add_argument("--word-bonus", type=float, default=BeamSearch.word_bonus, help="added per word, with --lm")


def from_arguments(args: argparse.Namespace):
    """greedy_decode, or the BeamSearch the options ask for; raises FileNotFoundError / ValueError for a bad LM."""
    if args.beam is None and args.lm is None:
        return greedy_decode
    lm = NGramLM.from_arpa(args.lm) if args.lm else None
    return BeamSearch(BeamSearch.beam_width if args.beam is None else args.beam, lm, args.lm_weight, args.word_bonus)
