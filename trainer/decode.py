"""From the model's per-frame character log probabilities to text: greedy (best path), or a CTC prefix beam search
that can weigh in a word n-gram language model (Hannun et al., 2014, "First-pass large vocabulary continuous
speech recognition using bi-directional recurrent DNNs").

With a language model the beam search ranks a transcript W by  log P_ctc(W | audio) + lm_weight * ln P_lm(W) +
word_bonus * |W|, the language model scoring each word as the space after it (or the end) is reached; without one, by
log P_ctc(W | audio) alone.
"""
import argparse
import math
import weakref
from dataclasses import dataclass, field

import torch

from data.cli import input_path
from data.text import ALPHABET, BLANK, decode
from trainer.cli import finite_float, int_at_least
from trainer.lm import SENTENCE_END, SENTENCE_START, NGramLM, check_arpa_path

SPACE = ALPHABET.index(" ")
LN_10 = math.log(10)
# Each frame extends every prefix kept by every character above the pruning threshold, in Python: the time and memory
# of a frame grow with the width, and a width of 10**8 let the prefixes kept multiply frame by frame until the memory
# ran out. At this width a model unsure of every frame (an untrained one) takes about 8 s a second of audio on one core.
MAX_BEAM_WIDTH = 1024


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
        if self.beam_width > MAX_BEAM_WIDTH:
            raise ValueError(f"beam width must be at most {MAX_BEAM_WIDTH}, not {self.beam_width}")

    def __call__(self, log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """log_probs: (T, B, V); lengths: (B,). The best transcript of each utterance."""
        check_finite(log_probs)
        frames = log_probs.float().transpose(0, 1).cpu()
        return [self.decode_one(frames[b, :length].tolist()) for b, length in enumerate(lengths.tolist())]

    def decode_one(self, frames: list[list[float]]) -> str:
        # The beams map a prefix (one Prefix object per text) to ln P of its paths.
        beams = {Prefix(context=self._history((), SENTENCE_START)): Paths(blank=0.0)}
        for frame in frames:
            candidates = [c for c, value in enumerate(frame) if value >= self.prune_log_prob]
            if not candidates:  # a threshold above every class: try the likeliest
                candidates = [max(range(len(frame)), key=frame.__getitem__)]
            extended: dict[Prefix, Paths] = {}
            for prefix, paths in beams.items():
                total = paths.total()
                for c in candidates:
                    p = frame[c]
                    if c == BLANK:
                        entry = extended.setdefault(prefix, Paths())
                        entry.blank = _log_add(entry.blank, total + p)
                        continue
                    if c == prefix.char:  # the same character again: a repeat unless a blank came between
                        entry = extended.setdefault(prefix, Paths())
                        entry.char = _log_add(entry.char, paths.char + p)
                        arriving = paths.blank + p
                    else:
                        arriving = total + p
                    if arriving == -math.inf:
                        continue  # no path reaches it
                    if c == SPACE and not prefix.partial:
                        # A space that separates no words spells the same transcript as a blank would.
                        entry = extended.setdefault(prefix, Paths())
                        entry.blank = _log_add(entry.blank, arriving)
                        continue
                    entry = extended.setdefault(self._child(prefix, c), Paths())
                    entry.char = _log_add(entry.char, arriving)
            beams = dict(sorted(extended.items(), key=lambda item: -self._rank(*item))[: self.beam_width])
        # "X " is the transcript "X", its parent: its paths add to those of "X".
        transcripts: dict[Prefix, Paths] = {}
        for prefix, paths in beams.items():
            entry = transcripts.setdefault(prefix.parent if prefix.char == SPACE else prefix, Paths())
            entry.blank = _log_add(entry.blank, paths.total())
        return str(max(transcripts.items(), key=lambda item: self._rank(*item, final=True))[0])

    def _child(self, prefix: "Prefix", c: int) -> "Prefix":
        """`prefix` and then character c, as the Prefix already made for that text while anything holds one: the
        paths that reach a text by different routes (a beam "AB" kept, a beam "A" and then B) merge as one key."""
        reference = prefix.children.get(c)
        child = reference() if reference else None
        if child is None:
            if c != SPACE:
                child = Prefix(prefix, c, prefix.words, prefix.lm, prefix.context, prefix.partial + ALPHABET[c])
            else:
                lm = prefix.lm + self._word_score(prefix)
                child = Prefix(prefix, c, prefix.words + 1, lm, self._history(prefix.context, prefix.partial))
            prefix.children[c] = weakref.ref(child)
        return child

    def _rank(self, prefix: "Prefix", paths: "Paths", final: bool = False) -> float:
        if self.lm is None:
            return paths.total()
        lm = prefix.lm
        if final:  # the last word (transcripts are ranked without a trailing space), then the end of the sentence
            history = self._history(prefix.context, prefix.partial) if prefix.partial else prefix.context
            lm += self._word_score(prefix) + self._lm_ln(history, SENTENCE_END)
        return paths.total() + self.lm_weight * lm + self.word_bonus * (prefix.words + bool(prefix.partial))

    def _word_score(self, prefix: "Prefix") -> float:
        """ln P_lm of the word `prefix` ends in given the words before it (0 without a language model or word)."""
        if self.lm is None or not prefix.partial:
            return 0.0
        return self._lm_ln(prefix.context, prefix.partial)

    def _history(self, context: tuple[str, ...], word: str) -> tuple[str, ...]:
        """`word` after `context`, cut to the order - 1 words that the language model reads of a history."""
        keep = self.lm.order - 1 if self.lm else 0
        return (*context, word)[-keep:] if keep else ()

    def _lm_ln(self, history: tuple[str, ...], word: str) -> float:
        return self.lm.log10_prob(history, word) * LN_10


@dataclass(eq=False, slots=True, weakref_slot=True)
class Prefix:
    """A transcript prefix: its last character under the prefix before it (the empty one has neither), and what
    ranking reads of its text, kept here so that no frame costs more as the text grows: the count and ln language
    model score of its completed words, the last order - 1 of them (after <s>) as the model's history, and the word it
    is in the middle of. One object per text, compared by identity (BeamSearch._child); it holds its children (at most
    one per character) weakly, so that those no beam holds any more are freed."""

    parent: "Prefix | None" = None
    char: int | None = None
    words: int = 0
    lm: float = 0.0
    context: tuple[str, ...] = ()
    partial: str = ""
    children: dict[int, weakref.ref] = field(default_factory=dict)

    def __str__(self) -> str:
        chars = []
        prefix = self
        while prefix.parent is not None:
            chars.append(prefix.char)
            prefix = prefix.parent
        return decode(reversed(chars))


@dataclass(slots=True)
class Paths:
    """ln P of a prefix's paths that end in a blank, and of those that end in its last character."""

    blank: float = -math.inf
    char: float = -math.inf

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
    parser.add_argument("--beam", type=int_at_least(1, at_most=MAX_BEAM_WIDTH),
                        help=f"CTC prefix beam search of this width, at most {MAX_BEAM_WIDTH} (default: greedy, or "
                             f"{BeamSearch.beam_width} with --lm)")
    parser.add_argument("--lm", type=input_path,
                        help="an ARPA word n-gram model for the beam search (python -m trainer.lm builds one)")
    parser.add_argument("--lm-weight", type=finite_float,
                        help=f"weight of ln P_lm, with --lm (default {BeamSearch.lm_weight})")
    parser.add_argument("--word-bonus", type=finite_float,
                        help=f"added per word, with --lm (default {BeamSearch.word_bonus})")


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError for a language model's weight without one (it would be ignored), FileNotFoundError / ValueError for
    an --lm that is missing or a folder: found before anything loads."""
    if args.lm is None and (args.lm_weight is not None or args.word_bonus is not None):
        raise ValueError("--lm-weight and --word-bonus weigh a language model's score: give --lm too")
    if args.lm is not None:
        check_arpa_path(args.lm)


def from_arguments(args: argparse.Namespace):
    """greedy_decode, or the BeamSearch the options (passed by check_arguments) ask for; raises FileNotFoundError /
    ValueError for a bad LM."""
    if args.beam is None and args.lm is None:
        return greedy_decode
    lm = NGramLM.from_arpa(args.lm) if args.lm else None
    return BeamSearch(BeamSearch.beam_width if args.beam is None else args.beam, lm,
                      BeamSearch.lm_weight if args.lm_weight is None else args.lm_weight,
                      BeamSearch.word_bonus if args.word_bonus is None else args.word_bonus)
