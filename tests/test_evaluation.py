"""Evaluation: corpus error rates, evaluate over a manifest, and the model tools trainer.evaluate and
trainer.transcribe."""
import argparse
import functools
import importlib
import json
import logging
import math
import os
import random
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from conftest import REPO_ROOT, NotesAutocast, compose_config, small_checkpoint
from data.manifest import Utterance, write_manifest
from trainer import build, checkpoint, inference, lm
from trainer.metrics import ErrorCounts, edit_distance


def test_edit_distance_hand_worked():
    assert edit_distance("KITTEN", "SITTING") == 3
    assert edit_distance([], list("ABC")) == 3
    assert edit_distance(list("ABC"), []) == 3
    assert edit_distance("SAME", "SAME") == 0


def test_corpus_error_rates_are_ratios_of_sums():
    counts = ErrorCounts()
    # "TWO SIX EIGHT" -> "TWO SIX": one deletion of 3 words; "YES" -> "YES": none.
    assert counts.add("TWO SIX EIGHT", "TWO SIX") == (1, 6)
    assert counts.add("YES", "YES") == (0, 0)
    assert counts.wer == pytest.approx(100 * 1 / 4)
    assert counts.cer == pytest.approx(100 * 6 / (13 + 3))
    # Substitution plus insertion: "GO" -> "NO NO" is 1 substitution + 1 insertion over 1 word.
    other = ErrorCounts()
    other.add("GO", "NO NO")
    assert other.wer == pytest.approx(200.0)
    counts.unreadable = 2
    assert ErrorCounts.from_tensor(counts.as_tensor()) == counts


def test_counts_summed_over_ranks_stay_exact_past_float32s_integers():
    # The evaluation sums each rank's as_tensor() in one all-reduce: a test set of 2^24 characters and more (some 300
    # hours of speech) must come back to the character, as float32 would not (2^24 + 1 rounds to 2^24).
    ranks = [ErrorCounts(3, 10, 2**24 + 1, 2**24 + 3, 1), ErrorCounts(4, 2**24 + 1, 5, 7, 0)]
    summed = ErrorCounts.from_tensor(sum(counts.as_tensor() for counts in ranks))
    assert summed == ErrorCounts(7, 2**24 + 11, 2**24 + 6, 2**24 + 10, 1)


def test_error_rates_against_an_independent_edit_distance_over_random_texts():
    """Each utterance's errors are the edit distance by the recursive definition (memoised), and the corpus rates the
    summed errors over the summed reference words and characters, whatever the per-utterance ratios average to."""
    def distance(reference, hypothesis):
        @functools.cache
        def d(i, j):
            if not i or not j:
                return i + j
            return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (reference[i - 1] != hypothesis[j - 1]))
        return d(len(reference), len(hypothesis))

    rng = random.Random(0)
    words = ["A", "AB", "BA", "B'A", "ABBA"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 6))) for _ in range(200)]
    pairs = [*zip(texts[::2], texts[1::2]), ("A AB", ""), ("", "A AB"), ("ABBA", "ABBA")]
    counts = ErrorCounts()
    for reference, hypothesis in pairs:
        expected = (distance(tuple(reference.split()), tuple(hypothesis.split())), distance(reference, hypothesis))
        assert counts.add(reference, hypothesis) == expected, (reference, hypothesis)
    word_errors = [distance(tuple(r.split()), tuple(h.split())) for r, h in pairs]
    assert counts.wer == pytest.approx(100 * sum(word_errors) / sum(len(r.split()) for r, _ in pairs), rel=1e-12)
    ratios = [errors / len(r.split()) for errors, (r, _) in zip(word_errors, pairs) if r]
    assert counts.wer != pytest.approx(100 * sum(ratios) / len(ratios), rel=1e-3)  # the texts tell the two apart
    char_errors = sum(distance(r, h) for r, h in pairs)
    assert counts.cer == pytest.approx(100 * char_errors / sum(len(r) for r, _ in pairs), rel=1e-12)


def test_no_words_have_no_error_rate_rather_than_a_perfect_one():
    # A test set none of whose audio could be read once scored 0.00 % and was kept as the best checkpoint.
    assert math.isnan(ErrorCounts(unreadable=130).wer) and math.isnan(ErrorCounts().cer)
    assert not ErrorCounts(unreadable=130).beats(math.inf, math.inf)


def test_the_best_checkpoint_is_chosen_among_evaluations_that_read_the_most():
    # (word errors, words, char errors, chars, unreadable): WER 10 % over the whole set, 5 % over part of it.
    whole, part = ErrorCounts(2, 20, 3, 60, 0), ErrorCounts(1, 20, 1, 60, 4)
    assert whole.beats(math.inf, math.inf) and part.beats(math.inf, math.inf)
    assert whole.beats(part.unreadable, part.wer) and not part.beats(whole.unreadable, whole.wer)
    assert not whole.beats(0, 10.0) and whole.beats(0, 10.5)
    # Audio too short for its transcript is left out as unreadable audio is: 5 % over part of the set is not better.
    short = ErrorCounts(1, 20, 1, 60, too_long_for_stride=4)
    assert not short.beats(whole.not_decoded, whole.wer) and whole.beats(short.not_decoded, short.wer)


def test_transcribe_reads_audio_at_the_models_rate_and_skips_what_it_cannot_use(tmp_path, monkeypatch, capsys):
    from trainer import transcribe

    path = small_checkpoint(tmp_path / "8k.pt", "data.features.sample_rate=8000")
    good, huge = tmp_path / "good.wav", tmp_path / "huge.wav"
    soundfile.write(good, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000, subtype="FLOAT")
    soundfile.write(huge, np.full(16000, 3e38), 16000, subtype="FLOAT")  # float32, whose squares overflow
    rates = []
    load_audio = transcribe.load_audio
    monkeypatch.setattr(transcribe, "load_audio", lambda file, rate: rates.append(rate) or load_audio(file, rate))
    assert transcribe.main(["--checkpoint", str(path), "--device", "cpu", str(good), str(huge)]) == 1
    assert rates == [8000, 8000]
    out, err = capsys.readouterr()
    assert out.startswith(f"{good}\t"), out
    assert f"{huge}\terror: its features are not finite (its largest sample is " in err, err  # the path once


def test_transcribe_prints_the_transcripts_in_the_order_the_files_are_given(tmp_path, capsys):
    # Not in their names' order, nor their lengths': a script pairs each line with the file it gave in that place.
    from trainer import transcribe
    noise = 0.1 * np.random.default_rng(0).standard_normal(16000)
    names = ["c.wav", "a.wav", "gone.wav", "b.wav"]
    for name, seconds in zip(names, [0.5, 1.0, None, 0.25]):
        if seconds:
            soundfile.write(tmp_path / name, noise[: int(16000 * seconds)], 16000)
    paths = [str(tmp_path / name) for name in names]
    assert transcribe.main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                            *paths]) == 1
    out, err = capsys.readouterr()
    assert [line.split("\t")[0] for line in out.splitlines()] == [paths[0], paths[1], paths[3]]
    assert err.startswith(f"{paths[2]}\terror: ")


def test_transcribe_names_a_file_it_cannot_use_once_whatever_the_name_holds(tmp_path, capsys):
    # The reason's line names the file as given, then why: the error, which quotes the name in escapes
    # (data.manifest.printable), is not to name it a second time.
    from trainer import transcribe
    gone = tmp_path / "gone\u200b\x1b[2J.wav"
    assert transcribe.main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                            str(gone)]) == 1
    assert capsys.readouterr().err == f"{gone}\terror: no such audio file\n"


def test_transcribe_names_a_file_of_more_than_five_minutes_on_stderr_before_transcribing_it(tmp_path, capsys):
    # A half-hour recording kept it silent for 4 minutes on a CPU; stdout, which users pipe, holds transcripts alone.
    from trainer import transcribe
    noise = 0.1 * np.random.default_rng(0).standard_normal(16000 * 301).astype(np.float32)
    short, lecture = tmp_path / "short.wav", tmp_path / "lecture.wav"
    soundfile.write(short, noise[:16000 * 300], 16000)
    soundfile.write(lecture, noise, 16000)
    assert transcribe.main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                            str(short), str(lecture)]) == 0
    out, err = capsys.readouterr()
    assert [line.split("\t")[0] for line in out.splitlines()] == [str(short), str(lecture)]
    assert err == f"transcribing {lecture}: 5 minutes of audio\n"


def test_transcribe_prints_a_file_name_that_is_not_utf8_as_its_own_bytes(tmp_path):
    # Where stdout's UTF-8 is strict (a locale such as en_US.UTF-8, or PYTHONIOENCODING), b"\xff.wav" ended
    # python -m trainer.transcribe in a UnicodeEncodeError traceback.
    path = small_checkpoint(tmp_path / "small.pt")
    audio = bytes(tmp_path) + b"/\xff.wav"
    soundfile.write(audio, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    result = subprocess.run([sys.executable, "-m", "trainer.transcribe", "--checkpoint", str(path), "--device", "cpu",
                             audio], cwd=REPO_ROOT, capture_output=True, timeout=300,
                            env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert result.returncode == 0 and result.stdout.startswith(audio + b"\t"), result.stdout + result.stderr


def test_evaluate_writes_a_file_name_that_is_not_utf8_into_its_table_as_its_own_bytes(tmp_path, capsys):
    # A manifest in a folder named with b"\xff" names its audio through it; --out was refused in a line of the codec's
    # ("error: 'utf-8' codec can't encode character '\udcff' ..."), and the table not written.
    from trainer import evaluate
    corpus = Path(os.fsdecode(bytes(tmp_path) + b"/corpus\xff"))
    corpus.mkdir()
    soundfile.write(os.fsencode(corpus / "a.wav"), 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    with open(corpus / "m.jsonl", "w", encoding="utf-8") as manifest:
        manifest.write('{"audio_filepath": "a.wav", "duration": 1.0, "text": "A"}\n')
    out = tmp_path / "table.tsv"
    assert evaluate.main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                          "--manifest", str(corpus / "m.jsonl"), "--out", str(out)]) == 0, capsys.readouterr().err
    assert out.read_bytes().splitlines()[1].startswith(os.fsencode(corpus / "a.wav") + b"\t")


def test_evaluate_writes_its_table_a_row_an_utterance_by_file_name_reference_before_hypothesis(tmp_path, capsys):
    # Listed, and decoded (by duration), in another order than their names': the table is in the names' order.
    from trainer import evaluate
    noise = 0.1 * np.random.default_rng(0).standard_normal(16000)
    utterances = [("c.wav", 0.5, "two six"), ("a.wav", 1.0, "NO"), ("b.wav", 0.25, "GO  ON")]
    for name, seconds, _ in utterances:
        soundfile.write(tmp_path / name, noise[: int(16000 * seconds)], 16000)
    lines = [f'{{"audio_filepath": "{name}", "duration": {seconds}, "text": "{text}"}}\n'
             for name, seconds, text in utterances]
    (tmp_path / "m.jsonl").write_text("".join(lines))
    out = tmp_path / "table.tsv"
    torch.manual_seed(1)  # a model whose errors give the words and the characters different rates (below)
    assert evaluate.main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                          "--manifest", str(tmp_path / "m.jsonl"), "--out", str(out)]) == 0, capsys.readouterr().err
    header, *rows = [line.split("\t") for line in out.read_text().splitlines()]
    assert header == ["audio_filepath", "word_errors", "char_errors", "reference", "hypothesis"]
    assert [(Path(file).name, reference) for file, _, _, reference, _ in rows] == [
        ("a.wav", "NO"), ("b.wav", "GO ON"), ("c.wav", "TWO SIX")]
    for _, word_errors, char_errors, reference, hypothesis in rows:
        assert int(word_errors) == edit_distance(reference.split(), hypothesis.split())
        assert int(char_errors) == edit_distance(list(reference), list(hypothesis))
    # The summary's rates are the table's errors over the references' 5 words and 14 characters.
    all_word_errors, all_char_errors = (sum(int(row[column]) for row in rows) for column in (1, 2))
    assert capsys.readouterr().out == (f"WER {100 * all_word_errors / 5:.2f}%  CER {100 * all_char_errors / 14:.2f}%  "
                                       "(3 utterances, 5 words)\n")
    assert all_word_errors / 5 != all_char_errors / 14, rows  # which the swapped figures would not tell apart


def test_evaluate_counts_audio_too_short_for_its_transcript_under_that_reason_not_as_unreadable(tmp_path, capsys):
    """A readable file whose manifest duration hides that its audio is too short for its transcript is found out when
    loaded: the summary called it unreadable, while the warning above it said why."""
    from trainer import evaluate
    noise = 0.1 * np.random.default_rng(0).standard_normal(16000)
    soundfile.write(tmp_path / "a.wav", noise, 16000)
    # 160 samples: 2 frames, 1 output frame at the model's time stride of 2, too few for "NO"'s 2; a dataset built
    # without the model's stride (1) decoded it.
    soundfile.write(tmp_path / "short.wav", noise[:160], 16000)
    # Two unreadable to one too short: with one of each, a mutant that swapped the two counts passed every test.
    for name in ("corrupt.flac", "corrupt2.flac"):
        (tmp_path / name).write_bytes(b"not audio at all" * 64)
    utterances = [("a.wav", "A"), ("short.wav", "NO"), ("corrupt.flac", "GO"), ("corrupt2.flac", "ON")]
    (tmp_path / "m.jsonl").write_text("".join(f'{{"audio_filepath": "{name}", "duration": 1.0, "text": "{text}"}}\n'
                                              for name, text in utterances))
    # Trained on utterances up to half a second: a test set is scored whole, a.wav's second too, whatever the
    # training's data.max_duration (a dataset given it left a.wav out).
    checkpoint = small_checkpoint(tmp_path / "small.pt", "data.max_duration=0.5")
    assert evaluate.main(["--checkpoint", str(checkpoint), "--device", "cpu", "--manifest",
                          str(tmp_path / "m.jsonl")]) == 0
    # The utterances and words the WER is over are those decoded: a.wav's alone.
    summary = "(1 utterance, 1 word; left out: 2 utterances (unreadable), 1 utterance (too long for stride))"
    assert summary in capsys.readouterr().out


def test_evaluate_names_a_few_of_a_test_set_left_out_and_skipped_lists_every_one(tmp_path, capsys, caplog):
    """A test set of punctuated transcripts ("YES.") gave one warning line each at the start: 104 lines for a manifest
    of 200. The first 5 of a reason are named, the rest counted; --skipped lists every one."""
    from trainer import evaluate

    soundfile.write(tmp_path / "a.wav", 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    punctuated = [f"said{number}.wav" for number in range(7)]
    listings = [("a.wav", "A"), *((name, "YES.") for name in punctuated)]
    (tmp_path / "m.jsonl").write_text("".join(f'{{"audio_filepath": "{name}", "duration": 1.0, "text": "{text}"}}\n'
                                              for name, text in listings))
    skip_list = tmp_path / "skipped.jsonl"
    with caplog.at_level(logging.WARNING):
        assert evaluate.main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                              "--manifest", str(tmp_path / "m.jsonl"), "--skipped", str(skip_list)]) == 0
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert [warning.split(":")[0] for warning in warnings[:-1]] == [
        f"skipping {tmp_path / name}" for name in punctuated[:5]]
    assert warnings[-1] == ("skipping 2 more utterances (characters outside the alphabet); every one left out is "
                            f"listed in {skip_list}")
    assert [json.loads(line)["audio_filepath"] for line in skip_list.read_text().splitlines()] == [
        str(tmp_path / name) for name in punctuated]
    assert "left out: 7 utterances (characters outside the alphabet)" in capsys.readouterr().out


def test_evaluate_names_a_skip_list_it_cannot_write_in_one_line(tmp_path, capsys):
    from trainer import cli, evaluate

    soundfile.write(tmp_path / "a.wav", 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    (tmp_path / "m.jsonl").write_text("".join(f'{{"audio_filepath": "{name}", "duration": 1.0, "text": "{text}"}}\n'
                                              for name, text in [("a.wav", "A"), ("said.wav", "YES.")]))
    assert cli.run_tool(lambda: evaluate.main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")),
                                               "--device", "cpu", "--manifest", str(tmp_path / "m.jsonl"),
                                               "--skipped", "/dev/full"])) == 2
    assert capsys.readouterr().err.endswith("error: cannot write /dev/full: No space left on device\n")


@pytest.mark.parametrize("tool", ["evaluate", "transcribe"])
def test_the_model_tools_decode_with_the_beam_search_that_beam_asks_for(tool, tmp_path, capsys):
    # A decoder built from --beam and then not passed on gave the greedy transcript, exit code 0. This untrained model
    # (seeded) is unsure of every frame, where summing paths gives another transcript than the best path's.
    main = importlib.import_module(f"trainer.{tool}").main
    audio, table = tmp_path / "a.wav", tmp_path / "table.tsv"
    soundfile.write(audio, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(audio), 1.0, "YES", "a")])
    torch.manual_seed(0)
    common = ["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu"]
    inputs = [str(audio)] if tool == "transcribe" else ["--manifest", str(tmp_path / "m.jsonl"), "--out", str(table)]

    def hypothesis(*decoder_options: str) -> str:
        assert main([*common, *decoder_options, *inputs]) == 0
        out = capsys.readouterr().out
        return (out if tool == "transcribe" else table.read_text().splitlines()[1]).rstrip("\n").split("\t")[-1]

    assert hypothesis("--beam", "4") != hypothesis()


@pytest.mark.parametrize("tool", ["evaluate", "transcribe"])
def test_the_model_tools_refuse_a_language_model_they_cannot_read_in_one_line(tool, tmp_path, capsys):
    # The language model is read after the checkpoint: a decoder built outside the tools' handling of the model's
    # errors would end in a traceback, which only the slow AN4 run (a missing --lm) checked.
    main = importlib.import_module(f"trainer.{tool}").main
    audio = tmp_path / "a.wav"
    soundfile.write(audio, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(audio), 1.0, "YES", "a")])
    common = ["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu"]
    inputs = [str(audio)] if tool == "transcribe" else ["--manifest", str(tmp_path / "m.jsonl")]
    word_list, absent = tmp_path / "words.txt", tmp_path / "absent.arpa"
    word_list.write_text("YES\nNO\n")
    for model, complaint in [(word_list, f"{word_list} is not an ARPA file: it has no \\data\\ line"),
                             (absent, f"language model not found: {absent}")]:
        assert main([*common, "--lm", str(model), *inputs]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == f"error: {complaint}\n", err


@pytest.mark.parametrize("tool", ["evaluate", "transcribe"])
def test_the_model_tools_refuse_a_model_that_is_not_finite_in_one_line(tool, tmp_path, capsys):
    main = importlib.import_module(f"trainer.{tool}").main
    audio = tmp_path / "a.wav"
    soundfile.write(audio, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000, subtype="FLOAT")
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(audio), 1.0, "A", "a")])
    inputs = [str(audio)] if tool == "transcribe" else ["--manifest", str(tmp_path / "m.jsonl")]
    saved = checkpoint.load(small_checkpoint(tmp_path / "small.pt"))
    saved["model"]["classifier.weight"][0, 0] = math.nan
    checkpoint.save(tmp_path / "nan.pt", saved)
    assert main(["--checkpoint", str(tmp_path / "nan.pt"), "--device", "cpu", *inputs]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'nan.pt'}: its model holds values that are not finite, "
                                       "in classifier.weight\n")
    # Finite weights whose output is not (the batch norm's running variance negative: the square root of it NaN).
    saved = checkpoint.load(small_checkpoint(tmp_path / "small.pt"))
    variance = next(name for name in saved["model"] if name.endswith("running_var"))
    saved["model"][variance].fill_(-1.0)
    checkpoint.save(tmp_path / "negative.pt", saved)
    assert main(["--checkpoint", str(tmp_path / "negative.pt"), "--device", "cpu", *inputs]) == 2
    error = capsys.readouterr().err.rsplit("\r", 1)[-1]  # after evaluate's progress bar
    assert error.startswith(f"error: {tmp_path / 'negative.pt'}: log_probs hold NaN") and error.count("\n") == 1, error


def test_a_gpu_the_machine_lacks_is_refused_counting_those_it_has(monkeypatch):
    # A machine with one GPU (faked: the tools' check asks torch how many) answered "has 1 CUDA GPU(s)".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'cuda:1': this machine has 1 CUDA GPU$"):
        inference.device_argument("cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'cuda:2': this machine has 2 CUDA GPUs$"):
        inference.device_argument("cuda:2")
    # The last GPU is one it has: a check that took only cuda:0 (or cuda) passed every refusal above.
    assert inference.device_argument("cuda:1") == torch.device("cuda", 1)


def test_the_model_runs_on_a_gpu_by_default_where_one_is_visible_and_on_the_cpu_where_none_is(monkeypatch):
    # The GPU faked as above: on a machine without one, every test passed with the default always cpu.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for visible, device in [(False, "cpu"), (True, "cuda")]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)
        parser = argparse.ArgumentParser()
        inference.add_model_arguments(parser)
        assert parser.parse_args(["--checkpoint", "x.pt"]).device == torch.device(device)


def test_transcribe_and_evaluate_give_a_file_the_same_transcript(tmp_path, capsys):
    # Each tool turns a file into features and lengths its own way (evaluate through the dataset and a batch): a length
    # cut short in one would decode part of the file. The beam search's transcript of this model grows with the audio.
    from trainer import evaluate, transcribe
    audio, table = tmp_path / "a.wav", tmp_path / "table.tsv"
    soundfile.write(audio, 0.1 * np.random.default_rng(0).standard_normal(24000), 16000)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(audio), 1.5, "YES", "a")])
    torch.manual_seed(0)
    common = ["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu", "--beam", "4"]
    assert transcribe.main([*common, str(audio)]) == 0
    transcript = capsys.readouterr().out.rstrip("\n").split("\t")[1]
    assert evaluate.main([*common, "--manifest", str(tmp_path / "m.jsonl"), "--out", str(table)]) == 0
    assert table.read_text().splitlines()[1].split("\t")[-1] == transcript
    assert len(transcript) > 10, transcript


def test_evaluate_puts_as_many_utterances_in_a_batch_as_batch_size_asks(tmp_path, monkeypatch, caplog):
    # --batch-size read and then dropped decoded in batches of the default 16, which a user had lowered to fit memory.
    from trainer import evaluate
    noise = 0.1 * np.random.default_rng(0).standard_normal(16000)
    names = ["a.wav", "b.wav", "c.wav"]
    for name in names:
        soundfile.write(tmp_path / name, noise, 16000)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / name), 1.0, "YES", name) for name in names])
    monkeypatch.setattr(evaluate, "PROGRESS_LINE_S", 0)  # a progress line each batch, naming how many there are
    caplog.set_level(logging.INFO)
    arguments = ["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                 "--manifest", str(tmp_path / "m.jsonl")]
    for batch_size, batches in [("2", 2), ("1", 3)]:
        caplog.clear()
        assert evaluate.main([*arguments, "--batch-size", batch_size]) == 0
        assert f"evaluating: batch {batches} of {batches}" in caplog.text, caplog.text


def test_evaluate_on_a_terminal_shows_its_progress_as_a_bar_not_as_log_lines(tmp_path, monkeypatch, caplog,
                                                                             capsys):
    """The lines on the progress are for a pipe or a batch job's log; where stderr shows a bar, the bar says it. The
    tests run without a terminal, and a mutant that never drew the bar passed them all."""
    from trainer import evaluate

    soundfile.write(tmp_path / "a.wav", 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / "a.wav"), 1.0, "YES", "a")])
    monkeypatch.setattr(evaluate, "PROGRESS_LINE_S", 0)  # without the bar, a line each batch
    monkeypatch.setattr(evaluate, "shows_a_progress_bar", lambda stream: stream is sys.stderr)
    caplog.set_level(logging.INFO)
    assert evaluate.main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                          "--manifest", str(tmp_path / "m.jsonl")]) == 0
    assert "evaluating: batch" not in caplog.text, caplog.text
    assert capsys.readouterr().err.startswith("\revaluating: ")  # the bar, drawn on stderr


@pytest.mark.parametrize("tool", ["evaluate", "transcribe"])
def test_a_missing_best_pt_beside_a_last_pt_is_refused_naming_the_last_pt(tool, tmp_path, capsys):
    """A run stopped (train.max_steps) before its first evaluation has a last.pt and no best.pt, the file README's
    examples name: the one line said only that best.pt was not found."""
    main = importlib.import_module(f"trainer.{tool}").main
    extra = ["a.flac"] if tool == "transcribe" else []
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    assert main(["--checkpoint", str(folder / "best.pt"), *extra]) == 2  # no last.pt either: no hint
    assert capsys.readouterr().err == f"error: checkpoint not found: {folder / 'best.pt'}\n"
    small_checkpoint(folder / "last.pt")
    assert main(["--checkpoint", str(folder / "best.pt"), *extra]) == 2
    assert capsys.readouterr().err == (f"error: checkpoint not found: {folder / 'best.pt'} (a run writes best.pt at "
                                       f"its first evaluation; {folder / 'last.pt'} holds its latest checkpoint)\n")
    assert main(["--checkpoint", str(folder / "other.pt"), *extra]) == 2  # only best.pt's absence has that cause
    assert capsys.readouterr().err == f"error: checkpoint not found: {folder / 'other.pt'}\n"


def test_evaluate_refuses_a_pipe_that_a_checkpoint_names_as_its_test_set(tmp_path):
    """A checkpoint whose stored data.eval_manifest is a named pipe: opening it waited for a writer, for ever (run in
    a process of its own here, so that the wait fails the test rather than hangs it)."""
    pipe = tmp_path / "fifo"
    os.mkfifo(pipe)
    path = small_checkpoint(tmp_path / "small.pt", f"data.eval_manifest={pipe}")
    result = subprocess.run([sys.executable, "-m", "trainer.evaluate", "--checkpoint", str(path), "--device", "cpu"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (2, f"error: the run's data.eval_manifest {pipe} is not a file (a "
                                                     "pipe, a device, a folder): give --manifest\n")


def test_evaluate_refuses_a_test_set_that_a_checkpoint_names_by_no_path_in_one_line(tmp_path, capsys):
    """A checkpoint edited by hand whose stored data.eval_manifest is a number, a list, null or missing ended
    trainer.evaluate in os.fspath's TypeError traceback (exit code 1)."""
    from trainer import evaluate
    path = small_checkpoint(tmp_path / "small.pt")
    saved = torch.load(path, weights_only=True)
    for value, said in ((5, "5"), (["a.jsonl"], "['a.jsonl']"), (None, "None"), (..., "None")):
        data = {key: entry for key, entry in saved["config"]["data"].items() if key != "eval_manifest"}
        edited = {**saved, "config": {**saved["config"], "data": data if value is ... else {**data,
                                                                                          "eval_manifest": value}}}
        torch.save(edited, tmp_path / "edited.pt")
        assert evaluate.main(["--checkpoint", str(tmp_path / "edited.pt"), "--device", "cpu"]) == 2
        assert capsys.readouterr().err == (f"error: {tmp_path / 'edited.pt'}: its data.eval_manifest is {said}, not a "
                                           "path: give --manifest\n")


def test_evaluate_elsewhere_than_training_ran_names_the_runs_relative_test_set_as_such(tmp_path, monkeypatch, capsys):
    """Without --manifest, a relative data.eval_manifest is the training folder's: run from another folder, the tool
    says so and how to go on, where "manifest manifests/test.jsonl does not exist" left the user to guess which
    manifest that was and why. A mutant without the check passed every test."""
    from trainer import evaluate

    path = small_checkpoint(tmp_path / "small.pt", "data.eval_manifest=manifests/test.jsonl")
    monkeypatch.chdir(tmp_path)
    assert evaluate.main(["--checkpoint", str(path), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("error: the run's data.eval_manifest manifests/test.jsonl is relative to the "
                                       "folder its training ran in: run this there, or give --manifest\n")
    # An absolute one that is not there is no matter of the folder: said to be missing (a mutant that called every
    # missing one relative passed every test).
    gone = tmp_path / "gone" / "test.jsonl"
    path = small_checkpoint(tmp_path / "small.pt", f"data.eval_manifest={gone}")
    assert evaluate.main(["--checkpoint", str(path), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == f"error: manifest {gone} does not exist\n"


@pytest.mark.parametrize("flag", ["--out", "--skipped"])
def test_evaluate_refuses_to_write_over_the_test_set_its_checkpoint_names(flag, tmp_path, capsys):
    """Without --manifest the tool reads the run's data.eval_manifest, which an --out or --skipped naming it would
    have destroyed: refused as the inputs given on the command line are. A mutant that left out this check passed
    every test."""
    from trainer import evaluate

    test_set = tmp_path / "test.jsonl"
    test_set.write_text("kept\n")
    path = small_checkpoint(tmp_path / "small.pt", f"data.eval_manifest={test_set}")
    assert evaluate.main(["--checkpoint", str(path), "--device", "cpu", flag, str(test_set)]) == 2
    assert capsys.readouterr().err == (f"error: {test_set} is also an input of this command: writing it would "
                                       "destroy it\n")
    assert test_set.read_text() == "kept\n"


@pytest.mark.parametrize("tool", ["evaluate", "transcribe"])
def test_the_model_tools_refuse_a_missing_checkpoint_or_an_unknown_device_in_one_line(tool, tmp_path, capsys):
    main = importlib.import_module(f"trainer.{tool}").main
    extra = ["a.flac"] if tool == "transcribe" else []
    assert main(["--checkpoint", str(tmp_path / "nope.pt"), *extra]) == 2
    assert capsys.readouterr().err == f"error: checkpoint not found: {tmp_path / 'nope.pt'}\n"
    path = small_checkpoint(tmp_path / "small.pt")
    devices = [("tpu9", "argument --device: 'tpu9' is not a device: cpu, cuda or cuda:N"),
               ("meta", "argument --device: 'meta': the model runs on cpu, cuda or cuda:N")]
    if not torch.cuda.is_available():
        devices.append(("cuda", "argument --device: 'cuda': no CUDA GPU is visible here"))
    for device, complaint in devices:
        with pytest.raises(SystemExit) as stopped:
            main(["--checkpoint", str(path), "--device", device, *extra])
        assert stopped.value.code == 2 and capsys.readouterr().err.endswith(f"error: {complaint}\n")
    # A language model's weights without one would be ignored: the greedy decoder takes no weights.
    assert main(["--checkpoint", str(path), "--device", "cpu", "--lm-weight", "7", *extra]) == 2
    assert capsys.readouterr().err == ("error: --lm-weight and --word-bonus weigh a language model's score: give --lm "
                                       "too\n")


@pytest.mark.parametrize("tool", ["evaluate", "transcribe"])
def test_the_model_tools_refuse_their_arguments_before_reading_the_checkpoint(tool, tmp_path, capsys):
    # A checkpoint that cannot be read: each argument error must come before it is found (after loading the checkpoint
    # and the language model, which a user waits for, these errors came only where both could be read).
    main = importlib.import_module(f"trainer.{tool}").main
    unreadable = tmp_path / "unreadable.pt"
    unreadable.write_text("not a checkpoint\n")
    common = ["--checkpoint", str(unreadable), "--device", "cpu"]
    (tmp_path / "m.jsonl").write_text("{}\n")  # evaluate checks that its manifest is there before the checkpoint
    inputs = [str(tmp_path / "a.wav")] if tool == "transcribe" else ["--manifest", str(tmp_path / "m.jsonl")]
    assert main([*common, "--word-bonus", "1", *inputs]) == 2
    assert capsys.readouterr().err == ("error: --lm-weight and --word-bonus weigh a language model's score: give --lm "
                                       "too\n")
    # A mistyped --lm was told only after the checkpoint had been read, which takes minutes for a large model.
    for model, complaint in [(tmp_path / "absent.arpa", f"language model not found: {tmp_path / 'absent.arpa'}"),
                             (tmp_path, f"language model {tmp_path} is a folder, not an ARPA file")]:
        assert main([*common, "--lm", str(model), *inputs]) == 2
        assert capsys.readouterr().err == f"error: {complaint}\n"
    if tool == "evaluate":
        for output in (unreadable, tmp_path / "words.arpa", tmp_path / "m.jsonl"):
            assert main([*common, "--lm", str(tmp_path / "words.arpa"), *inputs, "--out", str(output)]) == 2
            assert capsys.readouterr().err == f"error: {output} is also an input of this command: writing it would " \
                                              "destroy it\n"
        assert unreadable.read_text() == "not a checkpoint\n"
        # Left to the batching, a batch size of 0 was refused after the checkpoint was read, in a traceback: a mutant
        # that took any integer passed every test.
        with pytest.raises(SystemExit) as refused:
            main([*common, *inputs, "--batch-size", "0"])
        assert refused.value.code == 2
        assert capsys.readouterr().err.endswith("error: argument --batch-size: must be at least 1, not 0\n")


def evaluate_manifest(utterances, tmp_path, batch_size=4, **options):
    """(counts, rows) of a tiny untrained model over a manifest of `utterances` (Utterance arguments) in batches of
    `batch_size`, `options` to evaluate."""
    from data.dataset import SpeechDataset
    from data.manifest import Utterance, write_manifest
    from data.sampler import eval_shards
    from trainer.evaluate import evaluate

    write_manifest(tmp_path / "m.jsonl", [Utterance(*arguments) for arguments in utterances])
    cfg = compose_config(["model.depth=1", "model.hidden=8", "model.conv_channels=2", "data.features.kind=mel",
                          "data.features.n_mels=40"])
    features = build.features(cfg.data)
    model = build.model(cfg.model, features.num_features)
    dataset = SpeechDataset([tmp_path / "m.jsonl"], features, None, model.time_stride)
    return evaluate(model, dataset, eval_shards(dataset.durations, 1, batch_size)[0], torch.device("cpu"), **options)


def five_test_utterances(an4_source):
    """Five of AN4's test files as manifest rows, each said to be "TWO": batches of 4 make two of them."""
    audio = sorted((an4_source / "wav" / "an4test_clstk").rglob("*.flac"))[:5]
    return [(str(path), 2.0, "TWO", "x") for path in audio]


def test_evaluation_counts_audio_too_short_for_its_transcript_apart_from_unreadable_audio(tmp_path):
    soundfile.write(tmp_path / "short.wav", np.full(1, 0.1, np.float32), 16000)  # its manifest says 2 s
    counts, rows = evaluate_manifest([(str(tmp_path / "short.wav"), 2.0, "TWO", "x"),
                                      (str(tmp_path / "gone.flac"), 2.0, "SIX", "x")], tmp_path)
    assert (len(rows), counts.unreadable, counts.too_long_for_stride, counts.not_decoded) == (0, 1, 1, 2)
    # Summed over batches: one a batch, a mutant that kept the last batch's count of those too short passed.
    soundfile.write(tmp_path / "short2.wav", np.full(1, 0.1, np.float32), 16000)
    counts, _ = evaluate_manifest([(str(tmp_path / "short.wav"), 2.0, "TWO", "x"),
                                   (str(tmp_path / "short2.wav"), 2.0, "SIX", "x"),
                                   (str(tmp_path / "gone.flac"), 2.0, "SIX", "x"),
                                   (str(tmp_path / "gone2.flac"), 2.0, "TWO", "x")], tmp_path, batch_size=1)
    assert (counts.unreadable, counts.too_long_for_stride) == (2, 2)
    # best.pt's choice goes by both, as before they were told apart: a checkpoint's best_unreadable counted both
    assert not counts.beats(1, math.inf) and ErrorCounts(words=1, too_long_for_stride=1).beats(2, math.inf)


def test_evaluation_compares_against_the_normalised_transcript(an4_source, tmp_path):
    audio = next((an4_source / "wav" / "an4test_clstk").rglob("*.flac"))
    counts, rows = evaluate_manifest([(str(audio), 2.0, "  two   six eight ", "x")], tmp_path)
    assert rows[0]["reference"] == "TWO SIX EIGHT" and counts.words == 3 and counts.unreadable == 0


def test_evaluation_without_a_bar_logs_its_progress_as_often_as_asked(an4_source, tmp_path, caplog, monkeypatch):
    """A batch job's log, where a large test set ran for minutes without a word."""
    from trainer import evaluate

    caplog.set_level(logging.INFO)
    five = five_test_utterances(an4_source)
    evaluate_manifest(five, tmp_path, progress_line_s=0)
    assert [record.getMessage() for record in caplog.records if "evaluating" in record.getMessage()] == [
        "evaluating: batch 1 of 2", "evaluating: batch 2 of 2"]
    caplog.clear()
    evaluate_manifest(five, tmp_path, progress_line_s=3600)
    evaluate_manifest(five, tmp_path, progress_bar=True, progress_line_s=0)  # the bar says it; stderr not captured
    assert "evaluating" not in caplog.text
    # A clock 11 s later at each reading: asked for a line every 10 s, each batch gets one. At 0 s and an hour, above,
    # a line every 20 s passed too.
    readings = iter(range(0, 1000, 11))
    monkeypatch.setattr(evaluate, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    evaluate_manifest(five, tmp_path, progress_line_s=10)
    assert [record.getMessage() for record in caplog.records if "evaluating" in record.getMessage()] == [
        "evaluating: batch 1 of 2", "evaluating: batch 2 of 2"]
    # Counted from the last line, not the start, and one due at exactly 10 s: read at 0 (the start), 10 (batch 1's
    # check, a line), 10 (the line's time) and 15 (batch 2's check, 5 s after the line). Mutants that kept the start's
    # time, or waited for more than 10 s, passed the readings above.
    caplog.clear()
    readings = iter([0, 10, 10, 15])
    evaluate_manifest(five, tmp_path, progress_line_s=10)
    assert [record.getMessage() for record in caplog.records if "evaluating" in record.getMessage()] == [
        "evaluating: batch 1 of 2"]


def test_evaluation_stops_after_the_batch_in_progress_once_asked_to_and_returns_what_it_has(an4_source, tmp_path):
    """A training run's stop signal mid-evaluation: the ranks waited for the whole test set to decode."""
    five = five_test_utterances(an4_source)
    asked = iter([False, True])
    counts, rows = evaluate_manifest(five, tmp_path, stop=lambda: next(asked))
    assert len(rows) == 4 and counts.words == 4
    # And asks no more: in three batches, a mutant that went on to the next batch (decoding none) passed above; a
    # training run's every rank asks the others (a collective) and read the rest of the test set.
    answers = [False, True]
    counts, rows = evaluate_manifest(five, tmp_path, batch_size=2, stop=lambda: answers.pop(0))
    assert len(rows) == 2 and answers == []


def test_evaluation_ends_where_its_stop_signal_ended_the_wait_for_a_batch(an4_source, tmp_path):
    """`stopping()` true as its workers start: no batch comes (None instead), and the evaluation returns with nothing
    decoded, whatever `stop()` says yet (a mutant that went on to decode the None passed every test: the trainer's
    stop() is true by then)."""
    counts, rows = evaluate_manifest(five_test_utterances(an4_source), tmp_path, num_workers=1,
                                     stop=lambda: False, stopping=lambda: True)
    assert (rows, counts.words, counts.not_decoded) == ([], 0, 0)


def test_evaluation_counts_the_utterances_it_could_not_read(an4_source, tmp_path, caplog):
    audio = next((an4_source / "wav" / "an4test_clstk").rglob("*.flac"))
    counts, rows = evaluate_manifest([(str(audio), 2.0, "TWO", "x"), (str(tmp_path / "gone.flac"), 2.0, "SIX", "x")],
                                     tmp_path)
    assert (len(rows), counts.words, counts.unreadable) == (1, 1, 1)
    assert "gone.flac: no such audio file" in caplog.text


def test_evaluation_leaves_the_model_in_its_mode_and_an_earlier_table_when_nothing_decodes(an4_source, tmp_path,
                                                                                           capsys):
    from data.dataset import SpeechDataset
    from data.manifest import Utterance, write_manifest
    from trainer.evaluate import evaluate, main

    path = small_checkpoint(tmp_path / "small.pt")
    model, features, _ = build.from_checkpoint(path, torch.device("cpu"))
    audio = next((an4_source / "wav" / "an4test_clstk").rglob("*.flac"))
    write_manifest(tmp_path / "one.jsonl", [Utterance(str(audio), 2.0, "TWO", "x")])
    dataset = SpeechDataset([tmp_path / "one.jsonl"], features, None, model.time_stride)
    for training in (False, True):
        model.train(training)
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        evaluate(model, dataset, [[0]], torch.device("cpu"))
        assert model.training is training
        # Decoded in eval mode: a run's model, in training mode after its epoch, moved its batch-norm statistics
        # towards the test set's (a mutant that left the mode as it came passed every test).
        assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())

    write_manifest(tmp_path / "gone.jsonl", [Utterance(str(tmp_path / "gone.flac"), 1.0, "TWO", "x")])
    table = tmp_path / "errors.tsv"
    table.write_text("an earlier run's table\n")
    assert main(["--checkpoint", str(path), "--manifest", str(tmp_path / "gone.jsonl"), "--out", str(table)]) == 1
    assert "none of the 1 utterance of" in capsys.readouterr().err
    assert table.read_text() == "an earlier run's table\n"


@pytest.mark.parametrize("amp", ["bf16", "none"])
def test_evaluation_runs_the_model_under_the_autocast_amp_asks_for(amp, an4_source, tmp_path, cpu_takes_bf16):
    """An evaluation that ran the model without autocast passed every test of a CPU, which never takes bf16 (a GPU
    run then evaluated in fp32 whatever train.amp said)."""
    from data.dataset import SpeechDataset
    from trainer.evaluate import evaluate

    model, features, _ = build.from_checkpoint(small_checkpoint(tmp_path / "small.pt"), torch.device("cpu"))
    audio = next((an4_source / "wav" / "an4test_clstk").rglob("*.flac"))
    write_manifest(tmp_path / "one.jsonl", [Utterance(str(audio), 2.0, "TWO", "x")])
    dataset = SpeechDataset([tmp_path / "one.jsonl"], features, None, model.time_stride)
    noted = NotesAutocast(model)
    evaluate(noted, dataset, [[0]], torch.device("cpu"), amp)
    assert noted.under_autocast == [amp == "bf16"]


def test_evaluate_refuses_to_write_its_table_over_the_language_model_it_reads(tmp_path, capsys):
    from trainer.evaluate import main

    audio = tmp_path / "a.wav"
    soundfile.write(audio, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000, subtype="FLOAT")
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(audio), 1.0, "YES", "a")])
    model = tmp_path / "words.arpa"
    model.write_text(lm.build_arpa([["YES"]], 2))
    arguments = ["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                 "--manifest", str(tmp_path / "m.jsonl"), "--lm", str(model)]
    assert main([*arguments, "--out", str(model)]) == 2
    assert capsys.readouterr().err == f"error: {model} is also an input of this command: writing it would destroy it\n"
    assert model.read_text() == lm.build_arpa([["YES"]], 2)


def test_evaluate_refuses_one_file_for_both_its_table_and_its_skip_list(tmp_path, capsys):
    # --out X --skipped X wrote the list and then the table over it, exit code 0, the log saying the list held them.
    from trainer.evaluate import main

    soundfile.write(tmp_path / "a.wav", 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / "a.wav"), 1.0, "YES", "a")])
    both = tmp_path / "out.txt"
    assert main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu", "--manifest",
                 str(tmp_path / "m.jsonl"), "--out", str(both), "--skipped", f"{tmp_path}/./out.txt"]) == 2
    assert capsys.readouterr().err == f"error: --out and --skipped both name {both}: give each a file of its own\n"
    assert not both.exists()


@pytest.mark.parametrize("argument", ["--lm", "--manifest", "--checkpoint", "--out"])
def test_evaluate_refuses_an_empty_path_it_would_take_as_none_given(argument, tmp_path, capsys):
    # --lm "$LM" with LM unset decoded without a language model (its --lm-weight ignored), and --manifest "" the run's
    # data.eval_manifest, exit code 0 both; --checkpoint "" and --out "" were each refused as the current folder ("is
    # a folder"), which named no empty path.
    from trainer.evaluate import main

    audio = tmp_path / "a.wav"
    soundfile.write(audio, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000, subtype="FLOAT")
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(audio), 1.0, "YES", "a")])
    arguments = {"--checkpoint": str(small_checkpoint(tmp_path / "small.pt", f"data.eval_manifest={tmp_path}/m.jsonl")),
                 "--device": "cpu", "--manifest": str(tmp_path / "m.jsonl"), "--lm-weight": "2", argument: ""}
    with pytest.raises(SystemExit) as refused:
        main([part for pair in arguments.items() for part in pair])
    assert refused.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: argument {argument}: an empty path (an unset shell variable?)\n")


@pytest.mark.parametrize("empty", ["--checkpoint", "audio"])
def test_transcribe_refuses_an_empty_path(empty, tmp_path, capsys):
    # --checkpoint "$CK" with CK unset was refused as "checkpoint . is a folder", and an audio file "" was named as
    # "\terror: no such audio file", a line that begins with no name.
    from trainer import transcribe

    audio = tmp_path / "a.wav"
    soundfile.write(audio, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000, subtype="FLOAT")
    checkpoint_path = "" if empty == "--checkpoint" else str(small_checkpoint(tmp_path / "small.pt"))
    with pytest.raises(SystemExit) as refused:
        transcribe.main(["--checkpoint", checkpoint_path, "--device", "cpu", str(audio), *([""] * (empty == "audio"))])
    assert refused.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith(f"error: argument {empty}: an empty path (an unset shell variable?)\n"), err


def test_evaluate_reads_its_manifest_before_the_language_model(tmp_path, capsys):
    # A language model can take minutes to read: a mistyped --manifest was told only after it had been read.
    from trainer.evaluate import main

    unreadable = tmp_path / "words.arpa"
    unreadable.write_text("not a language model\n")
    assert main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu", "--lm",
                 str(unreadable), "--manifest", str(tmp_path / "typo.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: manifest {tmp_path / 'typo.jsonl'} does not exist\n"


def test_evaluate_checks_its_manifest_before_it_reads_the_checkpoint(tmp_path, capsys):
    # A large model's checkpoint takes minutes to read: a mistyped --manifest was told only after it.
    from trainer.evaluate import main

    not_a_checkpoint = tmp_path / "model.pt"
    not_a_checkpoint.write_text("not a checkpoint\n")
    assert main(["--checkpoint", str(not_a_checkpoint), "--device", "cpu", "--manifest",
                 str(tmp_path / "typo.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: manifest {tmp_path / 'typo.jsonl'} does not exist\n"


def test_evaluate_refuses_an_empty_manifest_file_in_one_line(tmp_path, capsys):
    """In the words trainer.check_overrides and the run give it, where it said 'no usable utterance in ...: skipped
    none, the manifest is empty'."""
    from trainer.evaluate import main

    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                 "--manifest", str(tmp_path / "empty.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: manifest {tmp_path / 'empty.jsonl'} is empty (0 bytes)\n"


def test_evaluate_help_says_what_the_tool_does(capsys):
    from trainer.evaluate import main
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    description = capsys.readouterr().out.split("\n\n")[1]
    # It read "Evaluation: corpus WER/CER, and `python -m trainer.evaluate` for a saved checkpoint."
    assert "decodes a manifest with a saved checkpoint and prints" in " ".join(description.split()), description


@pytest.mark.parametrize("tool", ["evaluate", "transcribe", "lm"])
def test_the_readme_names_every_flag_of_the_model_tools(tool, capsys):
    """README's Evaluation and transcription gives every flag the tools take: trainer.evaluate's --batch-size was in
    no document."""
    with pytest.raises(SystemExit):
        importlib.import_module(f"trainer.{tool}").main(["--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("### Evaluation and transcription\n")[1].split("\n## ")[0]
    assert set(re.findall(r"--[\w-]+", usage)) - {"--help"} - set(re.findall(r"--[\w-]+", section)) == set()


@pytest.mark.parametrize("short", [2, 1])
def test_an_epoch_that_decodes_none_of_the_test_set_says_so_whatever_left_each_out(tmp_path, short, caplog):
    """Audio found too short for its transcript when loaded is told apart from unreadable audio: a test set of such
    audio (alone or with unreadable files) got 'the test WER is over 0 of the test set's 2 utterances'."""
    import types

    from data.dataset import SpeechDataset
    from trainer.step import EpochTally
    from trainer.records import record_epoch

    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / "short.wav"), 2.0, "TWO", "x"),
                                          Utterance(str(tmp_path / "gone.flac"), 2.0, "SIX", "x")])
    eval_set = SpeechDataset([tmp_path / "m.jsonl"], build.features(compose_config([]).data), None, 2)
    counts = ErrorCounts(too_long_for_stride=short, unreadable=2 - short)
    with open(tmp_path / "metrics.jsonl", "w") as metrics:
        record_epoch(EpochTally(0, 0), counts, None, eval_set, 1, 1, 0.0, types.SimpleNamespace(add_scalar=print),
                     metrics)
    assert ("epoch 1: none of the test set's 2 utterances could be decoded (warned about above): no test WER"
            in caplog.text)
    assert "WER is over" not in caplog.text


@pytest.mark.parametrize("unreadable", [0, 1])
def test_an_epochs_metrics_line_counts_the_test_utterances_it_could_not_decode(tmp_path, unreadable, caplog):
    """metrics.jsonl's eval_unreadable is the count of test utterances the evaluation left out, absent where it left
    none: a line that left it out where one utterance was not decoded passed every test. The warning says the WER is
    over the one decoded, not that none was (a mutant that took one decoded for none passed too)."""
    import types

    from data.dataset import SpeechDataset
    from trainer.records import record_epoch
    from trainer.step import EpochTally

    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / "a.wav"), 2.0, "TWO", "x"),
                                          Utterance(str(tmp_path / "b.wav"), 2.0, "SIX", "x")])
    eval_set = SpeechDataset([tmp_path / "m.jsonl"], build.features(compose_config([]).data), None, 2)
    counts = ErrorCounts(word_errors=1, words=2 - unreadable, char_errors=1, chars=6 - 3 * unreadable,
                         unreadable=unreadable)
    with open(tmp_path / "metrics.jsonl", "w") as metrics:
        record_epoch(EpochTally(0, 0), counts, None, eval_set, 1, 1, 0.0,
                     types.SimpleNamespace(add_scalar=lambda *args: None), metrics)
    [line] = [json.loads(text) for text in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line.get("eval_unreadable") == (unreadable or None), line
    assert "could be decoded" not in caplog.text
    assert ("epoch 1: the test WER is over 1 of the test set's 2 utterances" in caplog.text) == bool(unreadable)


def test_evaluate_skipped_to_stdout_leaves_stdout_to_the_list(tmp_path, monkeypatch, capsys):
    # --skipped /dev/stdout | jq: the WER line came after the list on stdout, which then held a line that is no JSON.
    from trainer.evaluate import main

    soundfile.write(tmp_path / "a.wav", 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / "a.wav"), 1.0, "YES", "a"),
                                          Utterance(str(tmp_path / "b.wav"), 1.0, "YES.", "b")])
    stdout_file = tmp_path / "stdout.txt"
    with open(stdout_file, "w") as stdout:  # what a shell's `> stdout.txt` gives; /dev/stdout is then that file
        monkeypatch.setattr(sys, "stdout", stdout)
        assert main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu", "--manifest",
                     str(tmp_path / "m.jsonl"), "--skipped", str(stdout_file)]) == 0
    assert [json.loads(line)["audio_filepath"] for line in stdout_file.read_text().splitlines()] == [
        str(tmp_path / "b.wav")]
    assert capsys.readouterr().err.startswith("WER ")


def test_evaluate_skipped_to_a_reader_that_stopped_early_ends_it_quietly(tmp_path):
    # `--skipped /dev/stdout | head`: the list was written inside the catch of the model's and inputs' errors, which
    # printed "error: [Errno 32] Broken pipe: '/dev/stdout'" with exit code 2, where --out's table ends the tool
    # quietly.
    soundfile.write(tmp_path / "a.wav", 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / "a.wav"), 1.0, "YES", "a"),
                                          Utterance(str(tmp_path / "b.wav"), 1.0, "YES.", "b")])
    evaluate = shlex.join([sys.executable, "-m", "trainer.evaluate", "--checkpoint",
                           str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu", "--manifest",
                           str(tmp_path / "m.jsonl"), "--skipped", "/dev/stdout"])
    piped = subprocess.run(["bash", "-c", f"{evaluate} | true; exit ${{PIPESTATUS[0]}}"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=120)
    assert piped.returncode == 1 and "error" not in piped.stderr, piped.stderr


def test_evaluate_with_stdout_closed_gives_its_wer_on_stderr(tmp_path, monkeypatch, capsys):
    # `python -m trainer.evaluate ... >&-` (a cron job): Python gives a closed stdout as None, print() dropped the WER
    # line into it, and the tool ended with exit code 0 and no result.
    from trainer.evaluate import main

    soundfile.write(tmp_path / "a.wav", 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / "a.wav"), 1.0, "YES", "a")])
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu", "--manifest",
                 str(tmp_path / "m.jsonl")]) == 0
    assert capsys.readouterr().err.splitlines()[-1].startswith("WER ")
