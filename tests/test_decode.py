"""The greedy decoder, the beam-search decoder against brute force over every labelling, and the n-gram language
model it uses, as trainer.lm builds it."""
import argparse
import gzip
import itertools
import math
import os
import random
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from data.text import ALPHABET, NUM_CLASSES, encode
from trainer import decode, lm
from trainer.decode import BeamSearch, Paths, Prefix, greedy_decode
from trainer.lm import NGramLM, build_arpa


def arpa_model(text: str) -> NGramLM:
    """The model an ARPA file of `text` holds, read as NGramLM.from_arpa reads a file's lines."""
    return NGramLM.from_arpa_lines(text.splitlines(), "ARPA text")


def log_probs_over(frames: list[dict[str, float]]) -> torch.Tensor:
    """(T, 1, V) log probabilities: each frame's given characters ("_" the blank) at those probabilities."""
    probs = torch.full((len(frames), 1, NUM_CLASSES), 1e-12, dtype=torch.float64)
    for t, frame in enumerate(frames):
        for char, p in frame.items():
            probs[t, 0, ALPHABET.index(char)] = p
    return (probs / probs.sum(-1, keepdim=True)).log()


def random_log_probs(seed: int, num_frames: int, chars: str) -> torch.Tensor:
    """(num_frames, 1, V) float64 log probabilities, random over the blank and `chars`, all but nothing elsewhere."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.full((num_frames, 1, NUM_CLASSES), -1e4, dtype=torch.float64)
    for char in "_" + chars:
        logits[:, 0, ALPHABET.index(char)] = torch.randn(num_frames, generator=generator, dtype=torch.float64)
    return logits.log_softmax(-1)


def ctc_log_prob_of_every_transcript(log_probs: torch.Tensor, chars: str) -> dict[str, float]:
    """ln P_ctc of every transcript of up to T characters of `chars`, by brute force: every labelling scored with
    torch's CTC loss, and those of one transcript added up (labellings that differ only in spaces that separate no
    words, " A", "A ", "A  B", spell the same one)."""
    num_frames = log_probs.shape[0]
    labellings = ["".join(c) for n in range(1, num_frames + 1) for c in itertools.product(chars, repeat=n)]
    targets = torch.zeros(len(labellings), num_frames, dtype=torch.long)
    for row, text in enumerate(labellings):
        targets[row, : len(text)] = torch.tensor(encode(text))
    scores = -F.ctc_loss(
        log_probs.expand(-1, len(labellings), -1), targets, torch.full((len(labellings),), num_frames),
        torch.tensor([len(text) for text in labellings]), reduction="none", zero_infinity=False,
    )
    by_text = {"": log_probs[:, 0, 0].sum().item()}
    for text, score in zip(labellings, scores.tolist()):
        transcript = " ".join(text.split())
        by_text[transcript] = torch.logaddexp(torch.tensor(by_text.get(transcript, -math.inf)),
                                              torch.tensor(score)).item()
    return by_text


def one_hot_log_probs(paths: list[str]) -> torch.Tensor:
    """(T, B, V) log-probs whose best path spells each string, '_' being the blank."""
    num_steps = max(len(path) for path in paths)
    log_probs = torch.full((num_steps, len(paths), len(ALPHABET)), -10.0)
    for b, path in enumerate(paths):
        for t, char in enumerate(path):
            log_probs[t, b, ALPHABET.index(char)] = 0.0
    return log_probs


def test_greedy_decode_collapses_repeats_and_removes_blanks():
    log_probs = one_hot_log_probs(["HHE_LL_LLO", "__NN_O___"])
    assert greedy_decode(log_probs, torch.tensor([10, 9])) == ["HELLO", "NO"]
    # Frames past a length are ignored even when they spell something.
    assert greedy_decode(log_probs, torch.tensor([3, 4])) == ["HE", "N"]
    assert greedy_decode(log_probs, torch.tensor([4, 5])) == ["HE", "N"]  # the next frames spell L and O
    assert greedy_decode(log_probs, torch.tensor([5, 6])) == ["HEL", "NO"]
    # Spaces the best path puts at the ends or, a blank between them, twice between words: the transcript has one.
    assert greedy_decode(one_hot_log_probs([" HI _ THERE "]), torch.tensor([13])) == ["HI THERE"]


def test_beam_search_reads_each_utterances_frames_and_no_more():
    # As greedy_decode (above): the frames past a length, a batch's padding, spell something here.
    log_probs = one_hot_log_probs(["HHE_LL_LLO", "__NN_O___"])
    search = BeamSearch(beam_width=4)
    assert search(log_probs, torch.tensor([10, 9])) == ["HELLO", "NO"]
    assert search(log_probs, torch.tensor([4, 5])) == ["HE", "N"]


def test_a_narrow_beam_drops_the_prefixes_past_its_width():
    # After the first frame "A" 0.5 leads "B" 0.28 and "" 0.22; at the end "B" (B_, BB, _B) 0.412 leads "AB" 0.3 and
    # "A" 0.2. One prefix kept loses "B"'s paths and ends in "AB"; two keep B_ and BB, 0.28, still short of "AB"; three
    # keep them all. So each width is kept exactly: one prefix more than asked turns 2's "AB" into "B".
    log_probs, lengths = log_probs_over([{"A": 0.5, "B": 0.28, "_": 0.22}, {"B": 0.6, "_": 0.4}]), torch.tensor([2])
    assert [BeamSearch(beam_width=width)(log_probs, lengths) for width in (1, 2, 3)] == [["AB"], ["AB"], ["B"]]


@pytest.mark.parametrize("chars", ["ABC", "AB "])
@pytest.mark.parametrize("seed", range(6))
def test_beam_search_finds_the_most_probable_transcript(seed, chars):
    """With a beam wide enough to keep every prefix, the search returns argmax_W P_ctc(W)."""
    num_frames = 6
    log_probs = random_log_probs(seed, num_frames, chars)
    by_text = ctc_log_prob_of_every_transcript(log_probs, chars)
    best = max(by_text, key=by_text.get)
    decoded = BeamSearch(beam_width=512, prune_log_prob=-math.inf)(log_probs, torch.tensor([num_frames]))
    assert decoded == [best], (decoded, best, sorted(by_text.items(), key=lambda item: -item[1])[:3])


@pytest.mark.parametrize("seed", range(8))
def test_beam_search_with_a_language_model_finds_the_best_scoring_transcript(seed):
    """With a beam that keeps every prefix, the search returns the argmax over every transcript of ln P_ctc(W) +
    lm_weight * ln P_lm(W, </s>) + word_bonus * |W|, the language model's score summed here word by word."""
    num_frames, lm_weight, word_bonus = 5, 0.8, 0.4
    log_probs = random_log_probs(seed, num_frames, "AB ")
    lm = arpa_model(build_arpa([["A", "B"], ["AB", "A"], ["B"], ["A", "A", "B"], ["BA"]], order=3))

    def score(transcript: str, ctc: float) -> float:
        words = transcript.split()
        history = ("<s>", *words, "</s>")
        lm_ln = sum(lm.log10_prob(history[:k], history[k]) for k in range(1, len(history))) * math.log(10)
        return ctc + lm_weight * lm_ln + word_bonus * len(words)

    scored = {text: score(text, ctc) for text, ctc in ctc_log_prob_of_every_transcript(log_probs, "AB ").items()}
    best = max(scored, key=scored.get)
    # Pruned only of the characters left out (log probabilities near -1e4), which leaves it every prefix to keep.
    search = BeamSearch(beam_width=512, lm=lm, lm_weight=lm_weight, word_bonus=word_bonus, prune_log_prob=-100.0)
    decoded = search(log_probs, torch.tensor([num_frames]))
    assert decoded == [best], (decoded, best, sorted(scored.items(), key=lambda item: -item[1])[:3])


def test_a_space_that_separates_no_words_adds_to_its_transcript():
    # "B" 0.2025 and "B " 0.2475 are one transcript, 0.45 against "A"'s 0.3025; a leading space likewise.
    trailing = log_probs_over([{"A": 0.55, "B": 0.45}, {"B": 0.45, " ": 0.55}])
    leading = log_probs_over([{" ": 0.6, "B": 0.4}, {"A": 1.0}])
    for log_probs, expected, greedy in [(trailing, "B", "A"), (leading, "A", "A")]:
        search = BeamSearch(beam_width=8, prune_log_prob=-math.inf)
        assert search(log_probs, torch.tensor([2])) == [expected]
        assert greedy_decode(log_probs, torch.tensor([2])) == [greedy]  # no stray space to count as an error


def test_decoders_refuse_a_nan():
    log_probs = log_probs_over([{"_": 0.99, "Z": 0.01}])
    log_probs[0, 0, ALPHABET.index("Z")] = math.nan
    for decoder in (greedy_decode, BeamSearch()):
        with pytest.raises(ValueError, match="log_probs hold NaN"):
            decoder(log_probs, torch.tensor([1]))


def test_decoders_refuse_a_nan_in_any_utterance_of_a_batch_and_any_class():
    # Checks of the first utterance only, or of every class but the last (the space), passed the test above.
    log_probs = one_hot_log_probs(["A_", "B_"])
    log_probs[1, 1, ALPHABET.index(" ")] = math.nan
    for decoder in (greedy_decode, BeamSearch()):
        with pytest.raises(ValueError, match="log_probs hold NaN"):
            decoder(log_probs, torch.tensor([2, 2]))


def test_beam_search_sums_paths_where_the_best_path_does_not():
    """Best path: "_" on every frame (0.4^3 = 0.064). But "A" collects the paths A__, _A_, __A, AA_, ... whose
    probabilities add to 0.936 - the paths of "AA" and "" - and wins."""
    frames = [{"_": 0.4, "A": 0.3, "B": 0.3}] * 3
    log_probs = log_probs_over(frames)
    assert greedy_decode(log_probs, torch.tensor([3])) == [""]
    assert BeamSearch(beam_width=8)(log_probs, torch.tensor([3])) in (["A"], ["B"])


def test_language_model_settles_what_the_audio_leaves_open():
    frames = [{"A": 0.98, "_": 0.02}, {" ": 0.98, "_": 0.02}, {"B": 0.55, "C": 0.45}]
    log_probs, lengths = log_probs_over(frames), torch.tensor([3])
    assert BeamSearch(beam_width=8)(log_probs, lengths) == ["A B"]
    lm = arpa_model(build_arpa([["A", "C"]] * 6 + [["A", "B"]], order=2))
    assert BeamSearch(beam_width=8, lm=lm, lm_weight=1.0, word_bonus=0.0)(log_probs, lengths) == ["A C"]


def test_language_model_settles_a_word_that_a_space_completes():
    # The audio prefers "B A"; the unigrams prefer C to B by 1.7 decades (3.9 nats), which only a score given when the
    # space completes the first word brings in: the last word, A, is the same either way.
    frames = [{"B": 0.55, "C": 0.45}, {" ": 1.0}, {"A": 1.0}]
    log_probs, lengths = log_probs_over(frames), torch.tensor([3])
    assert BeamSearch(beam_width=8)(log_probs, lengths) == ["B A"]
    lm = arpa_model(UNIGRAMS.replace("ngram 1=5", "ngram 1=6").replace("-0.7\tAB", "-0.3\tC\n-2.0\tB"))
    assert BeamSearch(beam_width=8, lm=lm, lm_weight=1.0, word_bonus=0.0)(log_probs, lengths) == ["C A"]


def test_language_model_scores_each_word_after_the_words_before_it():
    # A sentence starts with B far more often than with C, but A has only ever been followed by C: scored after <s>
    # (a history the space after A never extended) or as a unigram, the second word would be B, as the audio leans.
    frames = [{"A": 0.98, "_": 0.02}, {" ": 0.98, "_": 0.02}, {"B": 0.55, "C": 0.45}]
    log_probs, lengths = log_probs_over(frames), torch.tensor([3])
    lm = arpa_model(build_arpa([["B"]] * 6 + [["A", "C"]] * 2, order=2))
    assert BeamSearch(beam_width=8, lm=lm, lm_weight=1.0, word_bonus=0.0)(log_probs, lengths) == ["A C"]


def test_a_language_model_of_weight_zero_and_no_word_bonus_changes_nothing():
    generator = torch.Generator().manual_seed(0)
    lm = arpa_model(build_arpa([["A", "B"], ["AB", "A"], ["B"]], order=3))
    for num_frames in [0, 1, 2, *range(3, 40, 4)]:
        logits = torch.full((num_frames, 1, NUM_CLASSES), -8.0)
        for char in "_AB ":
            logits[:, 0, ALPHABET.index(char)] = 2 * torch.randn(num_frames, generator=generator)
        log_probs, lengths = logits.log_softmax(-1), torch.tensor([num_frames])
        without = BeamSearch(beam_width=4)(log_probs, lengths)
        assert BeamSearch(beam_width=4, lm=lm, lm_weight=0.0, word_bonus=0.0)(log_probs, lengths) == without
        if num_frames == 0:
            assert without == greedy_decode(log_probs, lengths) == [""]


def test_a_pruning_threshold_above_every_class_keeps_the_likeliest():
    frames = [{"A": 0.6, "_": 0.4}]
    search = BeamSearch(beam_width=4, prune_log_prob=math.log(0.9))
    assert search(log_probs_over(frames), torch.tensor([1])) == ["A"]


def test_a_character_at_the_pruning_threshold_is_tried():
    # Only characters below it are left out: with those at it left out too, "B" won, "A" (0.45) never tried.
    frames = [{"A": 0.45, "B": 0.55}, {"A": 0.45, "_": 0.55}]
    log_probs = log_probs_over(frames)
    at_a = log_probs.float()[0, 0, ALPHABET.index("A")].item()  # as the search reads it
    assert BeamSearch(beam_width=4, prune_log_prob=at_a)(log_probs, torch.tensor([2])) == ["A"]


UNIGRAMS = """\\data\\
ngram 1=5

\\1-grams:
-0.6\tA
-0.7\tAB
-0.4\t</s>
-2.0\t<unk>
-99\t<s>

\\end\\
"""


def test_a_transcript_scores_ctc_plus_weighted_language_model_plus_word_bonus():
    lm = arpa_model(UNIGRAMS)
    search = BeamSearch(lm=lm, lm_weight=0.7, word_bonus=0.3)
    ln = math.log(10)
    # "A AB" without its last word scored yet (a prefix's lm holds its completed words), at the end of the audio:
    # its last word and the end of the sentence are scored then, and each of its two words earns the bonus.
    prefix = Prefix(context=search._history((), "<s>"))
    for c in encode("A AB"):
        prefix = search._child(prefix, c)
    assert str(prefix) == "A AB"
    assert prefix.lm == pytest.approx(-0.6 * ln, rel=1e-12)
    paths = Paths(blank=-1.25, char=-2.5)
    expected = math.log(math.exp(-1.25) + math.exp(-2.5)) + 0.7 * (-0.6 - 0.7 - 0.4) * ln + 0.3 * 2
    assert search._rank(prefix, paths, final=True) == pytest.approx(expected, rel=1e-12)
    assert search._rank(prefix, paths) == pytest.approx(expected - 0.7 * (-0.7 - 0.4) * ln, rel=1e-12)


def test_an_empty_transcript_scores_the_end_of_the_sentence_right_after_its_start():
    # Silence is "<s> </s>": its end scored after a word of no letters (<unk>) scores a bigram model's P(</s>) 0.39
    # instead of P(</s> | <s>) 0.19, and weighs silence against every word the audio might hold with the wrong number.
    lm = arpa_model(build_arpa([["A"], ["A", "B"]], order=2))
    search = BeamSearch(lm=lm, lm_weight=0.7, word_bonus=0.3)
    silence = Prefix(context=search._history((), "<s>"))
    expected = -1.25 + 0.7 * lm.log10_prob(("<s>",), "</s>") * math.log(10)
    assert search._rank(silence, Paths(blank=-1.25), final=True) == pytest.approx(expected, rel=1e-12)


def test_a_transcript_that_ends_in_a_space_scores_its_last_word_once():
    # CTC: "A" 0.6 (A, then a space that ends it), "AB" 0.4. With the language model "A" wins, ln 0.6 + ln P(A) +
    # ln P(</s>) = -2.81 against -3.44; scoring A's word twice (as the space and again at the end) would give -4.19.
    frames = [{"A": 1.0}, {" ": 0.6, "B": 0.4}]
    lm = arpa_model(UNIGRAMS)
    assert BeamSearch(lm=lm, lm_weight=1.0, word_bonus=0.0)(log_probs_over(frames), torch.tensor([2])) == ["A"]


@pytest.mark.parametrize("order", [1, 2, 3, 4, 5])
def test_built_model_is_a_distribution_after_every_history(order):
    rng = random.Random(order)
    vocabulary = ["ONE", "TWO", "THREE", "FOUR", "FIVE"]
    sentences = [[rng.choice(vocabulary[: rng.randint(2, 5)]) for _ in range(rng.randint(1, 6))] for _ in range(40)]
    lm = arpa_model(build_arpa(sentences, order))
    histories = [(), ("<s>",), ("ONE",), ("<s>", "TWO"), ("THREE", "FOUR"), ("NEVER", "SEEN"), ("FIVE", "FIVE")]
    # and histories of the longest order the sentences hold, at their starts and ends
    histories += [("<s>", *words)[: order - 1] for words in sentences[:10]] + [tuple(words[-4:]) for words in sentences]
    # and every history the model lists (an n-gram of a lower order that a word can follow)
    histories += [ngram for ngram in lm.tables if len(ngram) < lm.order and ngram[-1] != "</s>"]
    for history in histories:
        total = sum(10 ** lm.log10_prob(history, word) for word in [*vocabulary, "</s>", "<unk>"])
        assert total == pytest.approx(1.0, abs=1e-7), history  # the ARPA text keeps 9 decimals


def test_built_model_discounts_as_ney_and_backs_off_by_hand():
    # Unigrams of "A", "A B" (the end counted as a word): A 2, B 1, </s> 2 of 5, Ney's discount 1 / (1 + 2 * 2)
    # = 0.2, the 0.2 * 3 / 5 taken spread over A, B, </s> and <unk>: 0.03 each.  Bigrams: <s> A 2, A </s> 1, A B 1,
    # B </s> 1, discount 3 / (3 + 2) = 0.6; after <s>: A (2 - 0.6) / 2, backoff 0.6 / 2 / (1 - 0.39); after A: B
    # (1 - 0.6) / 2, backoff 0.6 / (1 - 0.58).
    unigrams = arpa_model(build_arpa([["A"], ["A", "B"]], order=1))
    assert [10 ** unigrams.log10_prob((), word) for word in ("A", "B", "</s>", "NEVER")] == pytest.approx(
        [0.39, 0.19, 0.39, 0.03], abs=1e-8)
    bigrams = arpa_model(build_arpa([["A"], ["A", "B"]], order=2))
    assert [10 ** bigrams.log10_prob(history, word) for history, word in [
        (("<s>",), "A"), (("<s>",), "B"), (("A",), "B"), (("A",), "A"), (("A",), "NEVER")]] == pytest.approx(
        [0.7, 0.3 / 0.61 * 0.19, 0.2, 0.6 / 0.42 * 0.39, 0.6 / 0.42 * 0.03], abs=1e-8)
    # No unigram seen once ("A" twice: A 2, </s> 2 of 4): Ney's discount has no n1, and 0.5 is taken, 0.5 * 2 / 4
    # spread over A, </s> and <unk>: 1/12 each.
    twice = arpa_model(build_arpa([["A"], ["A"]], order=1))
    assert [10 ** twice.log10_prob((), word) for word in ("A", "</s>", "NEVER")] == pytest.approx(
        [1.5 / 4 + 1 / 12, 1.5 / 4 + 1 / 12, 1 / 12], abs=1e-8)
    # Seen three times is no n2: A 3, B 1, </s> 3 of 7, discount 1 / (1 + 2 * 0) capped at 0.9, the 0.9 * 3 / 7
    # spread over A, B, </s> and <unk>.
    thrice = arpa_model(build_arpa([["A"], ["A"], ["A", "B"]], order=1))
    spread = 0.9 * 3 / 7 / 4
    assert [10 ** thrice.log10_prob((), word) for word in ("A", "B", "NEVER")] == pytest.approx(
        [2.1 / 7 + spread, 0.1 / 7 + spread, spread], abs=1e-8)


ARPA = """\\data\\
ngram 1=5
ngram 2=2

\\1-grams:
-1.0\t<unk>
-0.5\tyes\t-0.3
-0.7\tno
-99\t<s>\t-0.2
-0.9\t</s>
\\2-grams:
-0.1\t<s> yes
-0.2\tyes no

\\end\\
"""


def test_arpa_reader_backs_off_and_upper_cases(tmp_path):
    path = tmp_path / "tiny.arpa"
    path.write_text(ARPA)
    lm = NGramLM.from_arpa(path)
    assert lm.order == 2
    assert lm.log10_prob(("<s>",), "YES") == pytest.approx(-0.1)  # seen
    assert lm.log10_prob(("YES",), "NO") == pytest.approx(-0.2)
    assert lm.log10_prob(("YES",), "YES") == pytest.approx(-0.3 - 0.5)  # backoff weight of YES, then P(YES)
    assert lm.log10_prob(("NO",), "MAYBE") == pytest.approx(-1.0)  # unseen word: <unk>; NO has no backoff weight
    assert lm.log10_prob(("<s>", "NO", "YES"), "NO") == pytest.approx(-0.2)  # only the last word is history
    # A model of typeset text: its DON’T scored as <unk>, where transcripts read it as DON'T.
    path.write_text(ARPA.replace("yes", "don’t"))
    assert NGramLM.from_arpa(path).log10_prob(("<s>",), "DON'T") == pytest.approx(-0.1)


# As KenLM's lmplz writes a trigram model: <s> at -99 with a backoff weight, backoff weights of 0 left out (C, B C)
# or written as 0 (<unk>), none in the highest order, and <unk> in an n-gram.
KENLM_TRIGRAMS = """\\data\\
ngram 1=6
ngram 2=4
ngram 3=2

\\1-grams:
-1.5\t<unk>\t0
-99\t<s>\t-0.45
-0.8\t</s>
-0.6\tA\t-0.3
-0.7\tB\t-0.2
-0.9\tC

\\2-grams:
-0.3\t<s> A\t-0.1
-0.4\tA B\t-0.15
-0.2\tB C
-0.5\t<unk> B

\\3-grams:
-0.1\t<s> A B
-0.25\tA B C

\\end\\
"""


@pytest.mark.parametrize("history, word, expected", [
    (("<s>", "A"), "B", -0.1),  # listed
    (("<s>",), "B", -0.45 - 0.7),  # <s>'s weight: -99 is its probability alone
    (("<s>", "A"), "C", -0.1 - 0.3 - 0.9),  # two backoff weights, then the unigram
    (("A", "B"), "</s>", -0.15 - 0.2 - 0.8),
    (("C", "B"), "A", -0.2 - 0.6),  # C B is no bigram: no weight of its own
    (("B", "C"), "NEVER", -1.5),  # an unknown word: <unk>, after weights of 0 left out
    (("NEVER", "B"), "C", -0.2),  # an unknown word in the history: <unk> B, a bigram without a weight
    (("<s>", "NEVER"), "B", -0.5),
])
def test_arpa_reader_backs_off_through_every_order_by_the_arpa_rule(history, word, expected):
    assert arpa_model(KENLM_TRIGRAMS).log10_prob(history, word) == pytest.approx(expected, abs=1e-12)


def test_arpa_reader_takes_what_other_tools_write(tmp_path):
    path = tmp_path / "kenlm.arpa"
    path.write_text("\ufeffThis 2-gram model was built by hand\n# and commented\n" + ARPA.replace(
        "-0.2\tyes no", "-0.2\tyes no\n-0.05\t<unk> yes").replace("ngram 2=2", "ngram 2=3") + "notes after the end\n")
    lm = NGramLM.from_arpa(path)
    assert lm.log10_prob(("FOO",), "YES") == pytest.approx(-0.05)  # an unknown history word is <unk> too
    assert lm.log10_prob(("FOO",), "NO") == pytest.approx(-0.7)  # <unk> has no backoff weight here
    # A byte-order mark (as Notepad saves UTF-8) on the \data\ line itself, which the preamble above hid: a reader
    # that kept it would find no \data\ line.
    path.write_text("\ufeff" + ARPA)
    assert NGramLM.from_arpa(path).tables == arpa_model(ARPA).tables
    # "<UNK>", as some models spell it (KenLM reads it as <unk>): it was refused as a model without <unk>.
    path.write_text(ARPA.replace("<unk>", "<UNK>"))
    assert NGramLM.from_arpa(path).log10_prob(("YES",), "MAYBE") == pytest.approx(-0.3 - 1.0)
    # Numbers as writers other than KenLM may spell them: no digit before the point, an exponent.
    path.write_text(ARPA.replace("-0.7\tno", "-.7\tno").replace("-0.3", "-3e-1"))
    assert NGramLM.from_arpa(path).tables == arpa_model(ARPA).tables
    path.write_text(ARPA.replace("-0.7\tno", "-0.7\tno\n-3.0\tNO"))
    with pytest.raises(ValueError, match=rf"{path}:9: 'NO' is an n-gram the model already has \(n-grams are read"):
        NGramLM.from_arpa(path)


def test_arpa_reader_takes_an_order_its_header_declares_empty():
    # As SRILM's change-lm-vocab can leave it, and as KenLM reads it: a model of no trigrams, not one cut short.
    empty_trigrams = ARPA.replace("ngram 2=2", "ngram 2=2\nngram 3=0").replace("\\end\\", "\\3-grams:\n\n\\end\\")
    assert arpa_model(empty_trigrams).tables == arpa_model(ARPA).tables
    with pytest.raises(ValueError, match=r"declares 5 1-grams, 2 2-grams, 1 3-grams, its sections hold 5 1-grams, 2 2"):
        arpa_model(empty_trigrams.replace("ngram 3=0", "ngram 3=1"))
    # A section the header does not declare at all is as much at odds with it as one it declares of another size.
    undeclared_trigrams = ARPA.replace("\\end\\", "\\3-grams:\n-0.1\t<s> yes no\n\n\\end\\")
    with pytest.raises(ValueError, match=r"declares 5 1-grams, 2 2-grams, its sections hold 5 1-grams, 2 2-grams, 1 3"):
        arpa_model(undeclared_trigrams)


def test_arpa_reader_names_the_file_and_line_of_a_bad_model(tmp_path):
    bad = tmp_path / "bad.arpa"
    for edited in ("minus-one yes no", "-0.2\tyes no\t-0.1\t-0.3"):  # a number where a word goes, one number too many
        bad.write_text(ARPA.replace("-0.2\tyes no", edited))
        with pytest.raises(ValueError, match=rf"{bad}:13: not an ARPA 2-gram line"):
            NGramLM.from_arpa(bad)
    bad.write_text(ARPA.replace("\\2-grams:", "\\two-grams:"))
    with pytest.raises(ValueError, match=rf"{bad}:11: not an ARPA section header"):
        NGramLM.from_arpa(bad)
    without_unknown = tmp_path / "no_unk.arpa"
    without_unknown.write_text(ARPA.replace("-1.0\t<unk>\n", "").replace("ngram 1=5", "ngram 1=4"))
    with pytest.raises(ValueError, match=f"{without_unknown} has no <unk> unigram"):
        NGramLM.from_arpa(without_unknown)
    # Without <s> or </s> each was read as <unk>: a sentence's first words scored as after an unknown word.
    without_start = UNIGRAMS.replace("-99\t<s>\n", "").replace("ngram 1=5", "ngram 1=4")
    with pytest.raises(ValueError, match="has no <s> unigram, so the start of a sentence cannot be scored"):
        arpa_model(without_start)
    without_end = ARPA.replace("-0.9\t</s>\n", "").replace("ngram 1=5", "ngram 1=4")
    with pytest.raises(ValueError, match="has no </s> unigram, so the end of a sentence cannot be scored"):
        arpa_model(without_end)
    # An n-gram with a word that is no unigram was kept but never scored (its word read as <unk>): without the <s>
    # unigram, every n-gram of a sentence's start.
    bad.write_text(ARPA.replace("-99\t<s>\t-0.2\n", "").replace("ngram 1=5", "ngram 1=4"))
    with pytest.raises(ValueError, match=rf"{bad}:11: '<s>' is not a 1-gram of the model, which must list every word"):
        NGramLM.from_arpa(bad)
    bad.write_text(ARPA.replace("yes no", "yes maybe"))
    with pytest.raises(ValueError, match=rf"{bad}:13: 'maybe' is not a 1-gram of the model"):
        NGramLM.from_arpa(bad)
    lines = ARPA.splitlines(keepends=True)
    for cut in (7, 12, 14):  # inside the unigrams, inside the bigrams, before \end\
        bad.write_text("".join(lines[:cut]))
        with pytest.raises(ValueError, match=rf"{bad} ends before \\end\\ \(cut short\?\)$"):
            NGramLM.from_arpa(bad)
    # A unigram gone and the bigrams after an \end\: what is read no longer matches the header.
    bad.write_text("".join(lines[:6] + lines[7:]).replace("\n\\2-grams", "\n\\end\\\n\\2-grams"))
    with pytest.raises(ValueError, match=rf"{bad}: its header declares 5 1-grams, 2 2-grams, its sections hold "
                                         r"4 1-grams \(cut short or edited\?\)"):
        NGramLM.from_arpa(bad)
    bad.write_text(ARPA.replace("ngram 2=2", "ngram 2=two"))
    with pytest.raises(ValueError, match=rf"{bad}:3: not an ARPA header line: 'ngram 2=two'"):
        NGramLM.from_arpa(bad)
    # The order too: "two" was read by int() alone, its ValueError naming neither the file nor the line.
    bad.write_text(ARPA.replace("ngram 2=2", "ngram two=2"))
    with pytest.raises(ValueError, match=rf"{bad}:3: not an ARPA header line: 'ngram two=2'"):
        NGramLM.from_arpa(bad)
    bad.write_text(ARPA.replace("ngram 2=2", "ngram 2=" + "9" * 5000))  # past int()'s 4300 digits
    with pytest.raises(ValueError, match=rf"{bad}:3: not an ARPA header line"):
        NGramLM.from_arpa(bad)
    bad.write_text(ARPA.replace("\\2-grams:", "\\²-grams:"))  # a digit to str.isdigit, not to int()
    with pytest.raises(ValueError, match=rf"{bad}:\d+: not an ARPA section header"):
        NGramLM.from_arpa(bad)
    # A line before the first section that is no "ngram N=COUNT", and a section of 0-grams, were reported as
    # "not an ARPA 0-gram line".
    bad.write_text(ARPA.replace("ngram 2=2", "ngram2=2"))
    with pytest.raises(ValueError, match=rf"{bad}:3: not an ARPA header line: 'ngram2=2'"):
        NGramLM.from_arpa(bad)
    bad.write_text(ARPA.replace("\\2-grams:", "\\0-grams:"))
    with pytest.raises(ValueError, match=rf"{bad}:11: not an ARPA section header: '\\\\0-grams:'"):
        NGramLM.from_arpa(bad)
    for value in ("nan", "1e400", "-inf"):
        for line, edited in ((7, ARPA.replace("-0.3", value)), (8, ARPA.replace("-0.7\tno", f"{value}\tno"))):
            bad.write_text(edited)  # line 7: a backoff weight; 8: a probability
            with pytest.raises(ValueError, match=rf"{bad}:{line}: a log10 probability or backoff weight that is not "
                                                 "finite"):
                NGramLM.from_arpa(bad)
    for value in ("-0_7", "-\u0660.\u0667"):  # read by float() as -7 and -0.7
        for line, edited in ((7, ARPA.replace("-0.3", value)), (8, ARPA.replace("-0.7\tno", f"{value}\tno"))):
            bad.write_text(edited)  # line 7: a backoff weight; 8: a probability
            with pytest.raises(ValueError, match=rf"{bad}:{line}: not an ARPA 1-gram line"):
                NGramLM.from_arpa(bad)
    for value in ("1.5", "0.01"):  # 1.5 was read as P(NO) = 31.6
        bad.write_text(ARPA.replace("-0.7\tno", f"{value}\tno"))
        with pytest.raises(ValueError, match=rf"{bad}:8: a log10 probability above 0 \(a probability above 1\): "
                                             rf"'{value}"):
            NGramLM.from_arpa(bad)
    assert arpa_model(ARPA.replace("-0.7\tno", "0\tno")).log10_prob((), "NO") == 0.0  # P = 1 is one
    compressed = tmp_path / "model.arpa.gz"
    compressed.write_bytes(gzip.compress(ARPA.encode()))
    with pytest.raises(ValueError, match=rf"{compressed} is not an ARPA text file: byte 1 of line 1 is not UTF-8 \(a"):
        NGramLM.from_arpa(compressed)
    bad.write_bytes(ARPA.replace("-0.7\tno", "-0.7\tn\xf6").encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{bad} is not an ARPA text file: byte 6 of line 8 is not UTF-8"):
        NGramLM.from_arpa(bad)
    # A text that is no model (a manifest, a word list) was said to hold "no n-grams", and a KenLM binary model to be
    # compressed ("not UTF-8 (a compressed model must be decompressed first)").
    bad.write_text("no model here\n")
    with pytest.raises(ValueError, match=rf"{bad} is not an ARPA file: it has no \\data\\ line"):
        NGramLM.from_arpa(bad)
    bad.write_text("\\data\\\n\\end\\\n")
    with pytest.raises(ValueError, match=rf"{bad} holds no n-grams"):
        NGramLM.from_arpa(bad)
    kenlm_binary = b"mmap lm http://kheafield.com/code format version 5\n\0\0\0\0\x00\x00\x80\x3f"
    bad.write_bytes(kenlm_binary)
    with pytest.raises(ValueError, match=rf"{bad} is a KenLM binary model, which only KenLM reads: give the ARPA file"):
        NGramLM.from_arpa(bad)
    # Through a pipe whose writer sends the first 10 bytes before the rest (--lm <(...)): a peek at the first bytes
    # saw those 10 alone and called the model compressed.
    reader, writer = os.pipe()

    def write_in_two_parts():
        with os.fdopen(writer, "wb", buffering=0) as pipe:
            pipe.write(kenlm_binary[:10])
            time.sleep(0.3)
            pipe.write(kenlm_binary[10:])

    sender = threading.Thread(target=write_in_two_parts)
    sender.start()
    try:
        with pytest.raises(ValueError, match=r"is a KenLM binary model, which only KenLM reads"):
            NGramLM.from_arpa(f"/dev/fd/{reader}")
    finally:
        sender.join()
        os.close(reader)
    # A file without line breaks (a disk image, /dev/zero given by mistake) was read whole as one line, until the
    # memory ran out.
    bad.write_bytes(b"\0" * (2**20 + 1))
    for path in (bad, "/dev/zero"):
        with pytest.raises(ValueError, match=rf"{path}:1: a line longer than 1,048,576 bytes: not a text file"):
            NGramLM.from_arpa(path)
    # Whole: open()'s own FileNotFoundError names the file too.
    with pytest.raises(FileNotFoundError, match=rf"^language model not found: {tmp_path / 'absent.arpa'}$"):
        NGramLM.from_arpa(tmp_path / "absent.arpa")
    with pytest.raises(ValueError, match=rf"language model {tmp_path} is a folder"):
        NGramLM.from_arpa(tmp_path)


def test_a_language_model_refuses_an_empty_manifest_path(tmp_path, capsys):
    # --manifest "$M" with M unset was read as the current folder: "error: manifest . is a folder, not a file".
    with pytest.raises(SystemExit) as refused:
        lm.main(["--manifest", "", "--out", str(tmp_path / "m.arpa")])
    assert refused.value.code == 2
    assert capsys.readouterr().err.endswith("error: argument --manifest: an empty path (an unset shell variable?)\n")


def test_a_language_model_refuses_a_second_manifest_flag_rather_than_drop_the_first(tmp_path, capsys):
    # argparse kept the last --manifest's list: a model of b.jsonl's transcripts alone, said to be the model built.
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(f'{{"audio_filepath": "{name}.wav", "duration": 1.0, "text": "yes"}}\n')
    with pytest.raises(SystemExit) as refused:
        lm.main(["--manifest", str(tmp_path / "a.jsonl"), "--manifest", str(tmp_path / "b.jsonl"), "--out",
                 str(tmp_path / "m.arpa")])
    assert refused.value.code == 2 and not (tmp_path / "m.arpa").exists()
    assert capsys.readouterr().err.endswith(
        "error: argument --manifest: is given more than once: name all its values after one --manifest\n")


def test_a_language_model_leaves_out_transcripts_the_model_cannot_spell(tmp_path, capsys):
    # None of the audio is here, as where a model is built from transcripts alone: each missing file is its own.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n'
                                      '{"audio_filepath": "b.wav", "duration": 1.0, "text": "café ok"}\n'
                                      '{"audio_filepath": "c.wav", "duration": 1.0, "text": "maybe"}\n')
    assert lm.main(["--manifest", str(tmp_path / "m.jsonl"), "--order", "1", "--out", str(tmp_path / "m.arpa")]) == 0
    out = capsys.readouterr().out
    assert "counting the 1-grams of 2 transcripts" in out  # before the work, which takes a minute at 100k
    assert "a 1-gram model of 2 transcripts; 1 empty or unspellable left out" in out
    words = arpa_model((tmp_path / "m.arpa").read_text()).tables
    assert ("YES",) in words and ("MAYBE",) in words and ("OK",) not in words and ("CAFÉ",) not in words


def test_a_language_model_counts_a_word_in_any_case_as_the_one_the_model_spells(tmp_path):
    # The ARPA file is also KenLM's to read, which takes "yes" and "YES" for two words, neither of them the decoder's.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n'
                                      '{"audio_filepath": "b.wav", "duration": 1.0, "text": "YES"}\n')
    assert lm.main(["--manifest", str(tmp_path / "m.jsonl"), "--order", "1", "--out", str(tmp_path / "m.arpa")]) == 0
    text = (tmp_path / "m.arpa").read_text()
    unigrams = [line.split("\t")[1] for line in text.split("\\1-grams:\n")[1].split("\n\n")[0].splitlines()]
    assert sorted(unigrams) == ["</s>", "<s>", "<unk>", "NO", "YES"]
    model = arpa_model(text)
    assert model.log10_prob(("<s>",), "YES") > model.log10_prob(("<s>",), "NO")  # seen twice, once


def test_a_language_model_counts_a_typographic_apostrophe_as_the_one_the_model_spells(tmp_path, capsys):
    # As training reads a transcript (normalize_text): a builder that only upper-cased left "don’t" out as unspellable.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "don\u2019t go"}\n')
    assert lm.main(["--manifest", str(tmp_path / "m.jsonl"), "--order", "1", "--out", str(tmp_path / "m.arpa")]) == 0
    assert capsys.readouterr().out.endswith("a 1-gram model of 1 transcript\n")
    assert ("DON'T",) in lm.NGramLM.from_arpa(tmp_path / "m.arpa").tables


def test_a_unigram_language_model_is_written_as_kenlm_reads_it(tmp_path):
    # KenLM refuses a model without <s>, and any model of order 1 ("assumes at least a bigram model"): --order 1
    # wrote one it refused on both counts.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n')
    assert lm.main(["--manifest", str(tmp_path / "m.jsonl"), "--order", "1", "--out", str(tmp_path / "m.arpa")]) == 0
    text = (tmp_path / "m.arpa").read_text()
    assert text.startswith("\\data\\\nngram 1=5\nngram 2=0\n\n") and "\n-99.000000000\t<s>\n" in text, text
    assert text.endswith("\n\\2-grams:\n\n\\end\\\n"), text
    model = lm.NGramLM.from_arpa(tmp_path / "m.arpa")
    # YES, NO and </s> each seen once of 3: Ney's discount 0.9 (its cap), whatever the history, and the 3 x 0.9 / 3
    # taken spread over the three and <unk>
    assert model.order == 1 and 10 ** model.log10_prob(("YES",), "NO") == pytest.approx(0.1 / 3 + 0.9 / 4, abs=1e-8)


def test_a_word_never_seen_in_training_is_less_likely_than_every_word_seen():
    # All the mass the unigrams' discount took went to <unk>: 0.54 here against NO's 0.02, and on AN4's transcripts
    # <unk> outscored 62 of its 99 words, so the beam search took a string it could not spell for most words.
    model = arpa_model(lm.build_arpa([["YES", "NO", "YES", "YES"]], 1))
    unknown = model.log10_prob((), "NEVER")
    assert all(model.log10_prob((), word) > unknown for word in ("YES", "NO", "</s>")), model.tables


def test_a_language_model_of_an_order_past_the_longest_transcript_is_that_transcripts_order(tmp_path, capsys):
    # "<s> YES NO YES </s>" holds no n-gram longer than 5: a 6-gram section of none read as a model cut short.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no yes"}\n')
    assert lm.main(["--manifest", str(tmp_path / "m.jsonl"), "--order", "6", "--out", str(tmp_path / "m.arpa")]) == 0
    assert "a 5-gram model of 1 transcript (--order 6: none is longer than 3 words)" in capsys.readouterr().out
    model = lm.NGramLM.from_arpa(tmp_path / "m.arpa")
    five = arpa_model(lm.build_arpa([["YES", "NO", "YES"]], 5))
    assert model.order == 5 and model.tables == five.tables
    # by build_arpa too (main lowers the order it passes), and at once, not by a count over every order
    assert lm.build_arpa([["YES"]], 6) == lm.build_arpa([["YES"]], 3)
    assert lm.build_arpa([["YES"]], 10**9) == lm.build_arpa([["YES"]], 3)


def test_a_language_model_of_an_order_its_reader_cannot_take_is_refused_before_it_is_built(tmp_path, capsys):
    # --order 150 over a transcript of 120 words wrote a 122-gram model that trainer.evaluate and trainer.transcribe
    # then refused ("not an ARPA header line: 'ngram 100=5'"): the reader takes orders of two digits.
    text = "yes no " * 60
    (tmp_path / "m.jsonl").write_text(f'{{"audio_filepath": "a.wav", "duration": 1.0, "text": "{text}"}}\n')
    with pytest.raises(SystemExit) as refused:
        lm.main(["--manifest", str(tmp_path / "m.jsonl"), "--order", "100", "--out", str(tmp_path / "m.arpa")])
    assert refused.value.code == 2 and not (tmp_path / "m.arpa").exists()
    assert "argument --order: must be at most 99, not 100" in capsys.readouterr().err
    assert lm.main(["--manifest", str(tmp_path / "m.jsonl"), "--order", "99", "--out", str(tmp_path / "m.arpa")]) == 0
    assert lm.NGramLM.from_arpa(tmp_path / "m.arpa").order == 99


def test_a_language_model_counts_an_audio_files_transcript_once(tmp_path, monkeypatch, capsys):
    # A manifest given twice (as it is, as ./m.jsonl, through a link) counted its transcripts twice: every n-gram's
    # count doubled, and the discounts and backoff weights with them. Training keeps an audio file listed again once.
    for name in ("a.wav", "b.wav"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n'
                                      '{"audio_filepath": "b.wav", "duration": 1.0, "text": "no no"}\n')
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b_link.wav").symlink_to(tmp_path / "b.wav")
    (tmp_path / "elsewhere" / "b.jsonl").write_text('{"audio_filepath": "b_link.wav", "duration": 1.0, '
                                                    '"text": "no no"}\n')
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "m.jsonl")
    monkeypatch.chdir(tmp_path)
    assert lm.main(["--manifest", "m.jsonl", "--order", "2", "--out", "once.arpa"]) == 0
    capsys.readouterr()
    assert lm.main(["--manifest", "m.jsonl", "./m.jsonl", "link.jsonl", "elsewhere/b.jsonl", "--order", "2",
                    "--out", "repeated.arpa"]) == 0
    printed = capsys.readouterr()
    assert (tmp_path / "repeated.arpa").read_text() == (tmp_path / "once.arpa").read_text()
    first = tmp_path / "a.wav"
    assert printed.err == f"skipping 5 transcripts whose audio file is listed before (the first: {first})\n"
    assert printed.out.endswith("a 2-gram model of 2 transcripts; 5 whose audio file is listed before left out\n")


def test_a_language_model_quotes_the_first_repeats_path_in_escapes(tmp_path, capsys):
    # A zero-width character (U+2060), which the manifest's reader lets through, named another file than the repeat.
    (tmp_path / "a.wav").write_bytes(b"")
    (tmp_path / "a\u2060.wav").symlink_to(tmp_path / "a.wav")
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes"}\n'
                                      '{"audio_filepath": "a\\u2060.wav", "duration": 1.0, "text": "yes"}\n')
    assert lm.main(["--manifest", str(tmp_path / "m.jsonl"), "--order", "1", "--out", str(tmp_path / "m.arpa")]) == 0
    assert capsys.readouterr().err == ("skipping 1 transcript whose audio file is listed before (the first: "
                                       f"{tmp_path}/a\\u2060.wav)\n")


def test_a_language_model_counts_a_repeat_whose_own_transcript_is_unspellable_as_a_repeat(tmp_path, capsys):
    # As training counts it (data.dataset): the repeat was counted among the unspellable transcripts.
    (tmp_path / "a.wav").write_bytes(b"")
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes"}\n'
                                      '{"audio_filepath": "a.wav", "duration": 1.0, "text": "CAF\u00c9"}\n'
                                      '{"audio_filepath": "a.wav", "duration": 1.0, "text": ""}\n')
    assert lm.main(["--manifest", str(tmp_path / "m.jsonl"), "--order", "1", "--out", str(tmp_path / "m.arpa")]) == 0
    assert capsys.readouterr().out.endswith("a 1-gram model of 1 transcript; 2 whose audio file is listed before "
                                            "left out\n")


def test_a_language_model_counts_a_piped_manifests_transcripts_whatever_its_audio_paths(tmp_path):
    # --manifest <(...): a pipe has no folder to take a relative audio path from, which the transcripts alone do not
    # need (training refuses such a manifest).
    reader, writer = os.pipe()
    os.write(writer, b'{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n')
    os.close(writer)
    try:
        assert lm.main(["--manifest", f"/dev/fd/{reader}", "--order", "1", "--out", str(tmp_path / "m.arpa")]) == 0
    finally:
        os.close(reader)
    assert ("YES",) in lm.NGramLM.from_arpa(tmp_path / "m.arpa").tables


def test_a_language_model_refuses_to_write_over_a_manifest_it_reads(tmp_path, capsys):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n')
    assert lm.main(["--manifest", str(manifest), "--out", str(manifest)]) == 2
    assert capsys.readouterr().err == (f"error: {manifest} is also an input of this command: writing it would "
                                       "destroy it\n")
    assert manifest.read_text() == '{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n'


def test_a_language_model_of_no_words_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "blank.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": " "}\n')
    assert lm.main(["--manifest", str(tmp_path / "blank.jsonl"), "--out", str(tmp_path / "x.arpa")]) == 2
    assert "no words to count: the transcripts of" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        lm.main(["--manifest", str(tmp_path / "blank.jsonl"), "--out", str(tmp_path / "no" / "x.arpa")])
    assert refused.value.code == 2 and f"argument --out: no folder {tmp_path / 'no'}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        lm.main(["--manifest", str(tmp_path / "blank.jsonl"), "--order", "0", "--out", str(tmp_path / "x.arpa")])
    assert refused.value.code == 2 and "argument --order: must be at least 1, not 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^order must be at least 1, not 0$"):  # and by build_arpa, for its callers
        lm.build_arpa([["YES"]], 0)


@pytest.mark.parametrize("option", ["--lm-weight", "--word-bonus"])
def test_decoder_weights_must_be_finite(option, capsys):
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    assert getattr(parser.parse_args([option, "-2.5"]), option[2:].replace("-", "_")) == -2.5
    for value in ("nan", "inf", "-inf"):
        with pytest.raises(SystemExit):
            parser.parse_args([f"{option}={value}"])
        assert f"argument {option}: must be a finite number, not {value}" in capsys.readouterr().err


def test_the_decoder_options_reach_the_beam_search(tmp_path):
    # An option read and then dropped would leave a user tuning --lm-weight or --word-bonus against an unchanged search.
    (tmp_path / "lm.arpa").write_text(build_arpa([["A", "B"], ["B"]], order=2))
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    lm = ["--lm", str(tmp_path / "lm.arpa")]
    search = decode.from_arguments(parser.parse_args([*lm, "--beam", "3", "--lm-weight", "2", "--word-bonus", "-1"]))
    assert (search.beam_width, search.lm.order, search.lm_weight, search.word_bonus) == (3, 2, 2.0, -1.0)
    # --lm alone: a beam search with that model, of the width and weights --help gives
    defaults = decode.from_arguments(parser.parse_args(lm))
    assert (defaults.beam_width, defaults.lm.order, defaults.lm_weight, defaults.word_bonus) == (16, 2, 0.5, 1.0)
    assert decode.from_arguments(parser.parse_args([])) is greedy_decode


def test_a_beam_width_below_one_is_refused_as_the_arguments_are_read(capsys):
    # Before any work: BeamSearch refused it only after the checkpoint and the whole language model had been read.
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    assert decode.from_arguments(parser.parse_args(["--beam", "1"])).beam_width == 1  # the search takes it too
    for value in ("0", "-3"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--beam", value])
        assert f"argument --beam: must be at least 1, not {value}" in capsys.readouterr().err


def test_beam_width_zero_is_refused_rather_than_taken_as_the_default():
    arguments = argparse.Namespace(beam=0, lm=None, lm_weight=None, word_bonus=None)
    with pytest.raises(ValueError, match="beam width must be at least 1"):
        decode.from_arguments(arguments)


def test_a_beam_width_past_the_maximum_is_refused_as_the_arguments_are_read(capsys):
    # --beam 100000000 kept the prefixes of every frame multiplying until the memory ran out.
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--beam", "100000000"])
    assert f"argument --beam: must be at most {decode.MAX_BEAM_WIDTH}, not 100000000" in capsys.readouterr().err
    widest = decode.from_arguments(parser.parse_args(["--beam", str(decode.MAX_BEAM_WIDTH)]))
    assert widest.beam_width == decode.MAX_BEAM_WIDTH
    with pytest.raises(ValueError, match=f"beam width must be at most {decode.MAX_BEAM_WIDTH}, not 100000000"):
        decode.BeamSearch(beam_width=100_000_000)


def test_a_language_model_from_manifests_of_blank_lines_says_they_list_no_utterance(tmp_path, capsys):
    # It was told its transcripts were empty or held characters outside the alphabet, sent to look for them.
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    assert lm.main(["--manifest", str(tmp_path / "blank.jsonl"), "--out", str(tmp_path / "x.arpa")]) == 2
    assert capsys.readouterr().err == f"error: no words to count: {tmp_path / 'blank.jsonl'} lists no utterance\n"
