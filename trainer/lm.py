"""Word n-gram language models in the ARPA text format: read one (KenLM's `lmplz` writes them), or build one from
manifests' transcripts, for the beam-search decoder.

    python -m trainer.lm --manifest manifests/an4_train.jsonl --order 3 --out an4_3gram.arpa

The builder uses absolute discounting with backoff: a seen n-gram keeps its count less a discount D (the
Ney estimate n1 / (n1 + 2 n2) from each order's counts of counts, at most 0.9, and 0.5 where no n-gram was seen
once), and the mass taken from a history goes to the words it was never followed by, in proportion to their
lower-order probabilities; the unigrams' is spread evenly over the vocabulary and <unk>, as KenLM's lmplz does. Words
are upper case, as the model spells them; a word never seen in training scores as <unk>.
"""
if __name__ == "__main__":  # first: the imports below take seconds (torch), in which a signal printed a
    # traceback (Ctrl-C) or ended the tool without a word (SIGTERM)
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()

import argparse
import math
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from data.cli import input_path
from data.manifest import file_identity, numbered_lines, print_paths_printable, printable, read_manifest
from data.text import counted, invalid_characters, normalize_text
from trainer.cli import (GivenOnce, check_not_an_input, int_at_least, lines_stream, output_file, run_tool,
                         write_output)

SENTENCE_START, SENTENCE_END, UNKNOWN = "<s>", "</s>", "<unk>"
# How an ARPA file's words are read: the markers as they are, "<UNK>" (as some models spell it, and KenLM reads it) as
# <unk>, and every other word as training reads a transcript (normalize_text: upper case, typographic apostrophes as
# "'"), as the acoustic model spells it.
_MARKERS = {SENTENCE_START: SENTENCE_START, SENTENCE_END: SENTENCE_END, UNKNOWN: UNKNOWN, "<UNK>": UNKNOWN}
NEVER_LOG10 = -99.0  # ARPA's log10 probability for <s>, which is only ever a history
# A number as ARPA files write it (inf and nan are taken here to be refused as not finite): float() also reads "-0_7"
# as -7 and "-٠.٧" (digits of another script) as -0.7, which took a damaged model's numbers for others.
_ARPA_NUMBER = re.compile(r"[-+]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|inf|infinity|nan)", re.I)
# The highest order the reader takes (two digits in "ngram N=" and "\N-grams:"): trainer.lm builds none past it, which
# the tools that decode with it would refuse.
MAX_ORDER = 99
# How a KenLM binary model (build_binary's output, which deepspeech.pytorch and ctcdecode take) begins, complete or not.
_KENLM_BINARY_MAGIC = b"mmap lm http://kheafield.com/code"


class NGramLM:
    """log10 P(word | history) with backoff, from ARPA's tables of (log10 probability, log10 backoff weight)."""

    def __init__(self, tables: dict[tuple[str, ...], tuple[float, float]], source: str = "the language model"):
        self.tables = tables
        self.order = max(len(ngram) for ngram in tables)
        # A marker the model lacks would be read as <unk> (KenLM refuses such a model too): a sentence's first words
        # scored as if after an unknown word, its end as an unknown word.
        for marker, use in ((UNKNOWN, "unseen words"), (SENTENCE_START, "the start of a sentence"),
                            (SENTENCE_END, "the end of a sentence")):
            if (marker,) not in tables:
                raise ValueError(f"{source} has no {marker} unigram, so {use} cannot be scored")

    @classmethod
    def from_arpa(cls, path: str | Path) -> "NGramLM":
        """Reads the file a line at a time: a model's text is several times the size of its tables."""
        path = check_arpa_path(path)
        with path.open("rb") as file:
            return cls.from_arpa_lines(_utf8_lines(file, path), source=str(path))

    @classmethod
    def from_arpa_lines(cls, lines: Iterable[str], source: str) -> "NGramLM":
        """Refuses a model whose sections hold other counts of n-grams than its header declares, or that has no
        \\end\\: a file cut short at a line's end would otherwise load as a smaller (or lower-order) model."""
        tables = {}
        declared, found = {}, Counter()  # n-grams of each order: the header's counts, the sections' lines
        order = 0
        in_data = ended = False  # ARPA files may carry any text before \data\ (KenLM's builder writes a comment there)
        for line_number, line in enumerate(lines, start=1):
            line = line.strip()
            in_data = in_data or line == "\\data\\"
            if in_data and line == "\\end\\":
                ended = True
                break
            if not in_data or not line or line == "\\data\\":
                continue
            if line.startswith("ngram "):
                size, _, count = line[len("ngram "):].partition("=")
                if not (re.fullmatch(r"[0-9]{1,2}", size.strip()) and re.fullmatch(r"[0-9]{1,18}", count.strip())):
                    raise ValueError(f"{source}:{line_number}: not an ARPA header line: {line[:80]!r}")
                declared[int(size)] = int(count)
                continue
            if line.startswith("\\") and line.endswith("-grams:"):
                order_text = line[1 : -len("-grams:")]
                if not re.fullmatch(r"[1-9][0-9]?", order_text):  # str.isdigit takes "²", int() does not
                    raise ValueError(f"{source}:{line_number}: not an ARPA section header: {line[:80]!r}")
                order = int(order_text)
                continue
            if order == 0:  # before the first section: the header, whose lines are "ngram N=COUNT"
                raise ValueError(f"{source}:{line_number}: not an ARPA header line: {line[:80]!r}")
            fields = line.split()
            try:
                numbers = [fields[0], *fields[order + 1 :]]
                if len(fields) not in (order + 1, order + 2) or not all(map(_ARPA_NUMBER.fullmatch, numbers)):
                    raise ValueError
                log_prob = float(fields[0])
                backoff = float(fields[order + 1]) if len(fields) == order + 2 else 0.0
            except ValueError:
                raise ValueError(f"{source}:{line_number}: not an ARPA {order}-gram line: {line[:80]!r}") from None
            if not (math.isfinite(log_prob) and math.isfinite(backoff)):
                raise ValueError(f"{source}:{line_number}: a log10 probability or backoff weight that is not finite: "
                                 f"{line[:80]!r}")
            if log_prob > 0:  # KenLM refuses it too: such a word would outscore every sure one
                raise ValueError(f"{source}:{line_number}: a log10 probability above 0 (a probability above 1): "
                                 f"{line[:80]!r}")
            words = tuple(_MARKERS.get(word, normalize_text(word)) for word in fields[1 : order + 1])
            # A word that is no unigram would be read as <unk> (log10_prob), so such an n-gram would never be scored:
            # a model without the <s> unigram lost every n-gram of a sentence's start. ARPA lists every word as one.
            if order > 1 and (unlisted := [given for given, word in zip(fields[1:], words) if (word,) not in tables]):
                raise ValueError(f"{source}:{line_number}: {unlisted[0]!r} is not a 1-gram of the model, which must "
                                 f"list every word of its n-grams: {line[:80]!r}")
            if words in tables:  # the model spells upper case: "no" and "NO" would be one n-gram with two scores
                raise ValueError(f"{source}:{line_number}: {' '.join(fields[1:order + 1])!r} is an n-gram the model "
                                 "already has (n-grams are read upper case)")
            tables[words] = (log_prob, backoff)
            found[order] += 1
        if not in_data:  # a transcript, a manifest, a word list: it was said to hold "no n-grams"
            raise ValueError(f"{source} is not an ARPA file: it has no \\data\\ line")
        if not tables:
            raise ValueError(f"{source} holds no n-grams")
        if not ended:
            raise ValueError(f"{source} ends before \\end\\ (cut short?)")
        if found != Counter(declared):  # Counters compare a missing order as 0: one declared empty is read as such
            raise ValueError(f"{source}: its header declares {_ngram_counts(declared)}, its sections hold "
                             f"{_ngram_counts(found)} (cut short or edited?)")
        return cls(tables, source)

    def log10_prob(self, history: tuple[str, ...], word: str) -> float:
        """log10 P(word | the last order - 1 words of history), backing off to shorter histories."""
        if (word,) not in self.tables:
            word = UNKNOWN
        history = history[-(self.order - 1) :] if self.order > 1 else ()
        history = tuple(h if (h,) in self.tables else UNKNOWN for h in history)  # as the word itself, and as KenLM
        backoff = 0.0
        while True:
            entry = self.tables.get((*history, word))
            if entry is not None:
                return backoff + entry[0]
            backoff += self.tables.get(history, (0.0, 0.0))[1]
            history = history[1:]


def check_arpa_path(path: str | Path) -> Path:
    """`path` where it can be a language model to read; FileNotFoundError where it is missing, ValueError where it is a
    folder. The tools ask before they read a checkpoint, which can take minutes."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"language model {path} is a folder, not an ARPA file")
    if not path.exists():  # not is_file(): a pipe (--lm <(zcat model.arpa.gz)) reads as well
        raise FileNotFoundError(f"language model not found: {path}")
    return path


def _utf8_lines(file: BinaryIO, path: Path) -> Iterator[str]:
    """The lines of a binary file as text, a byte-order mark before the first skipped; a line that is not UTF-8, or
    longer than any model's (data.manifest.numbered_lines), is refused by its number."""
    first_line = b""
    for line_number, raw in numbered_lines(file, path):
        first_line = first_line or raw
        try:
            yield raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            # By its first line, not by peeking at the file's first bytes: a pipe (--lm <(...)) may hold fewer of them.
            if first_line.startswith(_KENLM_BINARY_MAGIC):  # its binary tables follow a line of text
                raise ValueError(f"{path} is a KenLM binary model, which only KenLM reads: give the ARPA file it was "
                                 "built from") from None
            raise ValueError(f"{path} is not an ARPA text file: byte {error.start} of line {line_number} is not UTF-8 "
                             "(a compressed model must be decompressed first)") from None


def _ngram_counts(counts: dict[int, int]) -> str:
    return ", ".join(f"{counts[order]} {order}-grams" for order in sorted(counts)) or "no n-grams"


def longest_ngram(sentences: list[list[str]]) -> int:
    """The longest n-gram in `sentences`: the longest sentence with <s> and </s>."""
    return 2 + max((len(words) for words in sentences), default=0)


def build_arpa(sentences: list[list[str]], order: int) -> str:
    """An ARPA model of `order` from tokenised sentences, with absolute discounting and backoff; of the longest n-gram's
    order where that is lower (an order of no n-grams would read as a model cut short)."""
    if order < 1:
        raise ValueError(f"order must be at least 1, not {order}")
    order = min(order, longest_ngram(sentences))
    counts = [Counter() for _ in range(order + 1)]  # counts[k]: k-grams; <s> is only ever a history
    for words in sentences:
        padded = [SENTENCE_START, *words, SENTENCE_END]
        for k in range(1, order + 1):
            for end in range(k, len(padded) + 1):
                if padded[end - k : end] != [SENTENCE_START]:
                    counts[k][tuple(padded[end - k : end])] += 1

    # n-gram -> (log10 P, log10 backoff weight), as NGramLM holds them; each order is built on the model of the
    # orders below it, so the backoff walk is NGramLM's own.
    tables = {}
    total = sum(counts[1].values())
    discount = _discount(counts[1])
    # The mass taken from the seen words spread evenly over them and <unk>, as KenLM's lmplz does: all of it on <unk>
    # made any string the model cannot spell likelier than most words it can.
    spread = discount * len(counts[1]) / total / (len(counts[1]) + 1)
    for ngram, c in counts[1].items():
        tables[ngram] = (math.log10((c - discount) / total + spread), 0.0)
    tables[(UNKNOWN,)] = (math.log10(spread), 0.0)
    tables[(SENTENCE_START,)] = (NEVER_LOG10, 0.0)  # KenLM refuses a model without it, of any order
    for k in range(2, order + 1):
        lower = NGramLM(tables)  # order k - 1: it never reads the k-grams added below
        discount = _discount(counts[k])
        followers = defaultdict(dict)
        for ngram, c in counts[k].items():
            followers[ngram[:-1]][ngram[-1]] = c
        for history, seen in followers.items():
            history_count = sum(seen.values())
            # The mass taken from the seen words goes to the unseen ones, in proportion to the next order down.
            lower_mass_of_seen = sum(10 ** lower.log10_prob(history[1:], word) for word in seen)
            for word, c in seen.items():
                tables[(*history, word)] = (math.log10((c - discount) / history_count), 0.0)
            backoff = discount * len(seen) / history_count / (1.0 - lower_mass_of_seen)
            tables[history] = (tables[history][0], math.log10(backoff))

    lines = ["\\data\\"]
    sections = []
    # KenLM reads no model of order 1 ("assumes at least a bigram model"): a unigram model goes out with a 2-gram
    # section of none, which KenLM and NGramLM read as the same model.
    for k in range(1, max(order, 2) + 1):
        entries = [
            f"{log_prob:.9f}\t{' '.join(ngram)}" + (f"\t{backoff:.9f}" if backoff else "")
            for ngram, (log_prob, backoff) in sorted(tables.items()) if len(ngram) == k
        ]
        lines.append(f"ngram {k}={len(entries)}")
        sections += ["", f"\\{k}-grams:", *entries]
    return "\n".join([*lines, *sections, "", "\\end\\", ""])


def _discount(table: Counter) -> float:
    """Ney's absolute discount n1 / (n1 + 2 n2), where n_r counts the n-grams seen exactly r times."""
    once = sum(1 for c in table.values() if c == 1)
    twice = sum(1 for c in table.values() if c == 2)
    # At most 0.9, so an n-gram seen once keeps some probability where no n-gram was seen twice.
    return min(once / (once + 2 * twice), 0.9) if once else 0.5


def read_transcripts(manifests: list[str]) -> tuple[list[list[str]], int, list[str]]:
    """The words of each transcript of `manifests` that the model can spell, how many it cannot, and the audio files
    listed again (each skipped); ValueError where none is left to count, OSError where a manifest cannot be read."""
    spellable, unspellable, repeats, kept_files = [], 0, [], set()
    for utterance in (u for path in manifests for u in read_manifest(path, audio_needed=False)):
        text = normalize_text(utterance.text)
        # As training keeps an audio file listed again once (a manifest given twice, or through a link), and counts a
        # repeat as one whatever its own transcript: counted twice, its n-grams' counts would double.
        if (audio_file := file_identity(utterance.audio_filepath)) in kept_files:
            repeats.append(utterance.audio_filepath)
        # Transcripts the model cannot spell are left out of training; their words would only take probability.
        elif not text or invalid_characters(text):
            unspellable += 1
        else:
            kept_files.add(audio_file)
            spellable.append(text.split())
    if repeats:
        print(f"skipping {counted(len(repeats), 'transcript')} whose audio file is listed before (the first: "
              f"{printable(repeats[0])})", file=sys.stderr, flush=True)
    if not spellable and not unspellable:  # blank lines alone (a repeat follows a kept one): no transcript to blame
        raise ValueError(f"no words to count: {', '.join(manifests)} list{'s' if len(manifests) == 1 else ''} no "
                         "utterance")
    if not spellable:
        raise ValueError(f"no words to count: the transcripts of {', '.join(manifests)} are empty or have characters "
                         "outside the alphabet")
    return spellable, unspellable, repeats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.lm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", nargs="+", action=GivenOnce, required=True, type=input_path,
                        help="JSONL manifests whose transcripts to count")
    parser.add_argument("--order", type=int_at_least(1, at_most=MAX_ORDER), default=3,
                        help=f"the longest n-gram, at most {MAX_ORDER} (default: 3; at most the longest transcript "
                             "with <s> and </s>)")
    parser.add_argument("--out", type=output_file, required=True, help="the ARPA file to write")
    args = parser.parse_args(argv)
    try:
        check_not_an_input(args.out, args.manifest)
        spellable, unspellable, repeats = read_transcripts(args.manifest)
    except (OSError, ValueError) as error:  # OSError: a manifest that is missing or cannot be read (no permission)
        print(f"error: {error}", file=sys.stderr)
        return 2
    order = min(args.order, longest_ngram(spellable))  # as build_arpa lowers it
    # Outside the try: a print into stdout whose reader stopped early, or on a full disk, is run_tool's to end.
    print(f"counting the {order}-grams of {counted(len(spellable), 'transcript')}", file=lines_stream(args.out),
          flush=True)  # a minute at 100k
    write_output(args.out, build_arpa(spellable, order))
    lowered = f" (--order {args.order}: none is longer than {counted(order - 2, 'word')})" if order < args.order else ""
    left_out = f"; {unspellable} empty or unspellable left out" if unspellable else ""
    left_out += f"; {len(repeats)} whose audio file is listed before left out" if repeats else ""
    print(f"wrote {args.out}: a {order}-gram model of {counted(len(spellable), 'transcript')}{lowered}{left_out}",
          file=lines_stream(args.out))
    return 0


if __name__ == "__main__":
    print_paths_printable(sys.stdout, sys.stderr)
    sys.exit(run_tool(main))
