"""SpeechDataset: what it drops, what it returns, and how samples are collated."""
import json
import logging
import os
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from torch.utils.data import DataLoader

from conftest import REPO_ROOT, raw_control_characters
from data.dataset import (
    LONGER_THAN_MAX_DURATION, TOO_LONG_FOR_STRIDE, UNREADABLE, Sample, SpeechDataset, Unusable, collate,
    min_ctc_frames,
)
from data.features import FeatureExtractor, SpecAugment
from data.manifest import Utterance, write_manifest
from data.sampler import BucketBatchSampler
from data.text import encode

RATE = 16000


def write_noise(path, seconds):
    samples = np.random.default_rng(0).uniform(-0.1, 0.1, round(seconds * RATE)).astype(np.float32)
    soundfile.write(path, samples, RATE)


@pytest.fixture
def manifest(tmp_path):
    """Two good utterances, then one of each bad-input case (kept ones first, dataset order = manifest order)."""
    write_noise(tmp_path / "good1.wav", 1.0)
    write_noise(tmp_path / "good2.flac", 0.5)
    (tmp_path / "corrupt.flac").write_bytes(b"not audio at all" * 64)
    write_noise(tmp_path / "empty.wav", 0.0)
    write_noise(tmp_path / "short.wav", 0.1)
    utterances = [
        Utterance(str(tmp_path / "good1.wav"), 1.0, "HELLO", "a"),
        Utterance(str(tmp_path / "good2.flac"), 0.5, "hi  there", "a"),  # normalised, not dropped
        Utterance(str(tmp_path / "corrupt.flac"), 1.0, "A", "b"),
        Utterance(str(tmp_path / "empty.wav"), 0.0, "A", "b"),
        # The manifest claims 3 s, so only reading the audio shows 0.1 s cannot hold 10 characters.
        Utterance(str(tmp_path / "short.wav"), 3.0, "ABCDEFGHIJ", "b"),
        Utterance(str(tmp_path / "blank_text.wav"), 1.0, "  ", "c"),
        Utterance(str(tmp_path / "foreign.wav"), 1.0, "CAFÉ 42", "c"),
        Utterance(str(tmp_path / "crammed.wav"), 0.1, "THIS IS FAR TOO LONG", "c"),
        Utterance(str(tmp_path / "unfilled.wav"), 0, "NO DURATION", "c"),
        Utterance(str(tmp_path / "lecture.wav"), 30.0, "LONG", "c"),
    ]
    path = tmp_path / "m.jsonl"
    write_manifest(path, utterances)
    return path


def make_dataset(manifest, **kwargs):
    return SpeechDataset([manifest], FeatureExtractor("spectrogram"), time_stride=2, max_duration=20, **kwargs)


def test_min_ctc_frames_counts_a_blank_between_repeated_characters():
    assert min_ctc_frames(encode("HELLO")) == 6
    assert min_ctc_frames(encode("AAA")) == 5
    assert min_ctc_frames([]) == 0


def test_construction_drops_and_counts_each_unusable_transcript(manifest, caplog):
    with caplog.at_level(logging.WARNING):
        dataset = make_dataset(manifest)
    assert len(dataset) == 5
    assert dataset.skipped == Counter(
        {
            "empty transcript": 1,
            "characters outside the alphabet": 1,
            "too long for stride": 1,
            "duration 0": 1,
            "longer than max_duration": 1,
        }
    )
    for name in ("blank_text.wav", "foreign.wav", "crammed.wav"):
        assert name in caplog.text
    assert "unfilled.wav: its manifest gives a duration of 0 s" in caplog.text
    assert "outside the alphabet: ['2', '4', 'É']" in caplog.text
    assert dataset.durations == [1.0, 0.5, 1.0, 0.0, 3.0]


def test_an_audio_file_listed_again_is_kept_once_and_the_repeats_counted_in_one_warning(manifest, tmp_path, caplog):
    write_noise(tmp_path / "other.wav", 1.0)
    again = [
        Utterance(str(tmp_path / "other.wav"), 1.0, "NEW", "d"),
        Utterance(str(tmp_path / "good1.wav"), 1.0, "HELLO", "a"),  # listed in the first manifest too
        Utterance(str(tmp_path / "other.wav"), 1.0, "NEW AGAIN", "d"),  # listed above, under another transcript
        Utterance(str(tmp_path / "foreign.wav"), 1.0, "CAFE", "c"),  # left out of the first for its transcript
    ]
    write_manifest(tmp_path / "again.jsonl", again)
    with caplog.at_level(logging.WARNING):
        dataset = SpeechDataset([manifest, manifest, tmp_path / "again.jsonl"], FeatureExtractor("spectrogram"),
                                time_stride=2, max_duration=20)
    names = [Path(utterance.audio_filepath).name for utterance in dataset.utterances]
    assert names == ["good1.wav", "good2.flac", "corrupt.flac", "empty.wav", "short.wav", "other.wav", "foreign.wav"]
    assert dataset.utterances[5].text == "NEW"  # the first listing is the one kept
    assert len(dataset.targets) == len(dataset.durations) == len(dataset) == 7
    assert dataset.skipped["audio listed before"] == 5 + 2
    repeats = [record.getMessage() for record in caplog.records if "listed before" in record.getMessage()]
    assert repeats == [f"skipping 7 utterances whose audio file is listed before (the first: {tmp_path / 'good1.wav'})"]
    twice = SpeechDataset([manifest, manifest], FeatureExtractor("spectrogram"), time_stride=2, max_duration=20)
    assert twice.fingerprint() == make_dataset(manifest).fingerprint()  # the same training set


def test_a_repeat_whose_own_transcript_cannot_train_is_counted_as_a_repeat_and_not_named(tmp_path, caplog):
    """A later listing of a kept file under an empty or unspellable transcript: its warning, "skipping FILE: its
    transcript is empty", said a file was left out that trains under its first listing."""
    write_noise(tmp_path / "a.wav", 1.0)
    listings = [("a.wav", "YES"), ("a.wav", ""), ("a.wav", "CAFÉ")]
    (tmp_path / "m.jsonl").write_text("".join(f'{{"audio_filepath": "{name}", "duration": 1.0, "text": "{text}"}}\n'
                                              for name, text in listings), encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        dataset = SpeechDataset(tmp_path / "m.jsonl", FeatureExtractor("spectrogram"))
    assert [utterance.text for utterance in dataset.utterances] == ["YES"]
    assert dataset.skipped == Counter({"audio listed before": 2})
    assert [record.getMessage() for record in caplog.records] == [
        f"skipping 2 utterances whose audio file is listed before (the first: {tmp_path / 'a.wav'})"]


def test_a_corpus_with_many_unusable_names_a_few_of_each_reason_and_lists_every_one(tmp_path, caplog):
    """A punctuated corpus ("YES.") left out 104 of 200 utterances with one warning each: a LibriSpeech-size one with a
    few % unusable buried the log in thousands of lines before training. Past the first 5 of a reason, the log counts
    them, and the list file names every one."""
    write_noise(tmp_path / "good.wav", 1.0)
    punctuated = [f"said{number}.wav" for number in range(8)]
    listings = [("good.wav", "YES"), *((name, "YES.") for name in punctuated), ("blank.wav", "")]
    (tmp_path / "m.jsonl").write_text("".join(f'{{"audio_filepath": "{name}", "duration": 1.0, "text": "{text}"}}\n'
                                              for name, text in listings), encoding="utf-8")
    skip_list = tmp_path / "skipped.jsonl"
    with caplog.at_level(logging.WARNING):
        dataset = SpeechDataset(tmp_path / "m.jsonl", FeatureExtractor("spectrogram"), skip_list=skip_list)
    dataset.write_skip_list()
    assert dataset.skipped == Counter({"characters outside the alphabet": 8, "empty transcript": 1})
    assert [record.getMessage() for record in caplog.records] == [
        *(f"skipping {tmp_path / name}: its transcript has characters outside the alphabet: ['.']"
          for name in punctuated[:5]),
        f"skipping {tmp_path / 'blank.wav'}: its transcript is empty",
        f"skipping 3 more utterances (characters outside the alphabet); every one left out is listed in {skip_list}"]
    listed = [json.loads(line) for line in skip_list.read_text().splitlines()]
    assert [(Path(entry["audio_filepath"]).name, entry["reason"]) for entry in listed] == [
        *((name, "characters outside the alphabet") for name in punctuated), ("blank.wav", "empty transcript")]
    assert listed[-1]["detail"] == "its transcript is empty"

    caplog.clear()
    with caplog.at_level(logging.WARNING):  # nowhere to list them
        SpeechDataset(tmp_path / "m.jsonl", FeatureExtractor("spectrogram")).write_skip_list()  # as trainer.evaluate
    assert [record.getMessage() for record in caplog.records if "more" in record.getMessage()] == [
        "skipping 3 more utterances (characters outside the alphabet); not named one by one"]  # said once

    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / "good.wav"), 1.0, "YES", "a")])  # mended
    SpeechDataset(tmp_path / "m.jsonl", FeatureExtractor("spectrogram"), skip_list=skip_list).write_skip_list()
    assert not skip_list.exists()  # it would name files no longer left out


def test_the_count_past_the_named_ones_names_the_skip_list_only_once_it_is_written(tmp_path, caplog):
    """A training job writes its skip list only once it goes on: a resume refused (another model.hidden) said "skipping
    3 more utterances ...; every one left out is listed in runs/NAME/skipped_train.jsonl", which still held the
    earlier job's 7 files, not this attempt's 8."""
    write_noise(tmp_path / "good.wav", 1.0)
    listings = [("good.wav", "YES"), *((f"said{number}.wav", "YES.") for number in range(8))]
    (tmp_path / "m.jsonl").write_text("".join(f'{{"audio_filepath": "{name}", "duration": 1.0, "text": "{text}"}}\n'
                                              for name, text in listings), encoding="utf-8")
    skip_list = tmp_path / "skipped.jsonl"
    skip_list.write_text("an earlier job's list\n")
    with caplog.at_level(logging.WARNING):
        dataset = SpeechDataset(tmp_path / "m.jsonl", FeatureExtractor("spectrogram"), skip_list=skip_list)
    assert [record.getMessage().split(":")[0] for record in caplog.records] == [
        f"skipping {tmp_path / f'said{number}.wav'}" for number in range(5)]  # a job refused here says no more
    assert skip_list.read_text() == "an earlier job's list\n"
    dataset.write_skip_list()
    assert caplog.records[-1].getMessage() == (
        f"skipping 3 more utterances (characters outside the alphabet); every one left out is listed in {skip_list}")
    assert len(skip_list.read_text().splitlines()) == 8


def test_a_skip_list_that_is_a_pipe_or_a_link_to_one_is_written_into_never_renamed_over_or_removed(tmp_path):
    """trainer.evaluate --skipped /dev/stdout, a link to a pipe or terminal: the list was renamed over the link (as
    root, /dev/stdout became a file of the list, the pipe's reader waiting for ever) and, with none left out, the link
    was removed."""
    write_noise(tmp_path / "good.wav", 1.0)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"audio_filepath": "good.wav", "duration": 1.0, "text": "YES"}\n'
                        '{"audio_filepath": "said.wav", "duration": 1.0, "text": "YES."}\n', encoding="utf-8")
    pipe, link = tmp_path / "pipe", tmp_path / "stdout"
    os.mkfifo(pipe)
    link.symlink_to(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # the other end, as `| gzip` holds it
    try:
        SpeechDataset(manifest, FeatureExtractor("spectrogram"), skip_list=link).write_skip_list()
        assert link.is_symlink() and stat.S_ISFIFO(os.stat(pipe).st_mode)
        assert json.loads(os.read(reader, 4096))["audio_filepath"] == str(tmp_path / "said.wav")

        write_manifest(manifest, [Utterance(str(tmp_path / "good.wav"), 1.0, "YES", "a")])  # none left out
        SpeechDataset(manifest, FeatureExtractor("spectrogram"), skip_list=link).write_skip_list()
        assert link.is_symlink() and stat.S_ISFIFO(os.stat(pipe).st_mode)
        SpeechDataset(manifest, FeatureExtractor("spectrogram"), skip_list=pipe).write_skip_list()  # named itself
        assert stat.S_ISFIFO(os.stat(pipe).st_mode)
    finally:
        os.close(reader)


def test_a_skip_list_that_is_a_link_to_a_file_is_kept_and_its_file_emptied_where_none_is_left_out(tmp_path):
    """The link (a run's list kept on a shared disk) stays, and the file it leads to no longer names files since
    mended."""
    write_noise(tmp_path / "good.wav", 1.0)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / "good.wav"), 1.0, "YES", "a")])
    listed, link = tmp_path / "lists" / "skipped.jsonl", tmp_path / "skipped.jsonl"
    listed.parent.mkdir()
    listed.write_text('{"audio_filepath": "said.wav", "reason": "unreadable", "detail": "an earlier job\'s"}\n')
    link.symlink_to(listed)
    SpeechDataset(tmp_path / "m.jsonl", FeatureExtractor("spectrogram"), skip_list=link).write_skip_list()
    assert link.is_symlink() and listed.read_text() == ""


def test_a_skip_list_written_to_stdout_under_a_shells_append_keeps_what_the_file_held(tmp_path):
    """trainer.evaluate --skipped /dev/stdout >> log.txt: the list was written beside the file /dev/stdout led to and
    renamed over it, losing what `>>` appended to, where `--out /dev/stdout` already wrote through the stream."""
    write_noise(tmp_path / "good.wav", 1.0)
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "good.wav", "duration": 1.0, "text": "YES"}\n'
                                      '{"audio_filepath": "said.wav", "duration": 1.0, "text": "YES."}\n')
    log = tmp_path / "log.txt"
    log.write_text("an earlier line\n")
    build = ("import sys; from data.dataset import SpeechDataset; from data.features import FeatureExtractor; "
             "print('before', flush=True); "
             "SpeechDataset(sys.argv[1], FeatureExtractor('spectrogram'), skip_list='/dev/stdout').write_skip_list(); "
             "print('after')")
    with open(log, "a") as stdout:
        subprocess.run([sys.executable, "-c", build, str(tmp_path / "m.jsonl")], cwd=REPO_ROOT, stdout=stdout,
                       check=True, timeout=120)
    first, before, listed, after = log.read_text().splitlines()
    assert (first, before, after) == ("an earlier line", "before", "after")
    assert json.loads(listed)["audio_filepath"] == str(tmp_path / "said.wav")


def test_warnings_quote_paths_and_transcripts_from_a_manifest_in_escapes(tmp_path, caplog):
    """The manifest's reader refuses a path with a terminal's escape or a line break, but not the other format
    characters: a soft hyphen or a zero-width one, printed raw, is invisible, and "skipping a.wav" named a file that
    is there and trains."""
    write_noise(tmp_path / "a.wav", 1.0)
    (tmp_path / "c\u2060.wav").symlink_to(tmp_path / "a.wav")
    (tmp_path / "m.jsonl").write_text(
        '{"audio_filepath": "a.wav", "duration": 1.0, "text": "YES"}\n'
        '{"audio_filepath": "a\\u200b.wav", "duration": 1.0, "text": "NO"}\n'
        '{"audio_filepath": "b\\u00ad.wav", "duration": 1.0, "text": "\\u001b[2J\\u0007YES\\u202e"}\n'
        '{"audio_filepath": "c\\u2060.wav", "duration": 1.0, "text": "YES"}\n', encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        dataset = SpeechDataset(tmp_path / "m.jsonl", FeatureExtractor("spectrogram"))
        dataset.warn_once([dataset[1]])
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        f"skipping {tmp_path}/b\\xad.wav: its transcript has characters outside the alphabet: "
        "['\\x07', '\\x1b', '2', '[', '\\u202e']",
        f"skipping 1 utterance whose audio file is listed before (the first: {tmp_path}/c\\u2060.wav)",
        f"skipping {tmp_path}/a\\u200b.wav: no such audio file",
    ]
    assert not any(raw_control_characters(message) for message in messages)


def test_an_audio_file_listed_again_through_another_folder_is_a_repeat(tmp_path):
    """Manifests in two folders naming one file relative to each (corpora that share files): the second listing's
    path goes through `..`, and would otherwise train the file twice an epoch."""
    write_noise(tmp_path / "shared.wav", 1.0)
    (tmp_path / "other").mkdir()
    (tmp_path / "top.jsonl").write_text('{"audio_filepath": "shared.wav", "duration": 1.0, "text": "A"}\n')
    (tmp_path / "other" / "m.jsonl").write_text('{"audio_filepath": "../shared.wav", "duration": 1.0, "text": "A"}\n')
    dataset = SpeechDataset([tmp_path / "top.jsonl", tmp_path / "other" / "m.jsonl"], FeatureExtractor("spectrogram"))
    assert len(dataset) == 1
    assert dataset.skipped == Counter({"audio listed before": 1})


def test_an_audio_file_listed_again_through_a_link_is_a_repeat_and_a_link_to_another_file_is_not(tmp_path):
    """A symbolic or hard link to a listed file reads the same utterance, and would train it twice an epoch; a path
    whose `..` leaves a linked folder names another file, however alike the names look."""
    write_noise(tmp_path / "a.wav", 1.0)
    (tmp_path / "symbolic.wav").symlink_to("a.wav")
    (tmp_path / "hard.wav").hardlink_to(tmp_path / "a.wav")
    (tmp_path / "elsewhere" / "inner").mkdir(parents=True)
    write_noise(tmp_path / "elsewhere" / "a.wav", 0.5)
    (tmp_path / "linked").symlink_to(tmp_path / "elsewhere" / "inner")
    # A file that cannot be examined is compared by name, `..` folded, and is unusable when read: two such names, two
    # files.
    listings = ["a.wav", "symbolic.wav", "hard.wav", "linked/../a.wav", "missing.wav", "./missing.wav",
                "gone/../missing.wav", "absent.wav"]
    (tmp_path / "m.jsonl").write_text("".join(f'{{"audio_filepath": "{name}", "duration": 1.0, "text": "A"}}\n'
                                              for name in listings))
    dataset = SpeechDataset(tmp_path / "m.jsonl", FeatureExtractor("spectrogram"))
    assert [utterance.audio_filepath for utterance in dataset.utterances] == [
        str(tmp_path / "a.wav"), str(tmp_path / "linked/../a.wav"), str(tmp_path / "missing.wav"),
        str(tmp_path / "absent.wav")]
    assert dataset.skipped == Counter({"audio listed before": 4})
    assert len(dataset[1].features) == 51  # elsewhere/a.wav's 0.5 s, not a.wav's 1 s


@pytest.mark.parametrize("sample_rate", [RATE, 8000])
def test_a_transcript_is_kept_while_the_output_frames_hold_it_and_no_longer(tmp_path, sample_rate):
    """0.1 s is 11 frames at any rate (a 10 ms hop), 6 output frames at time stride 2: 6 characters fit, 7 do not, and
    a repeated character needs a blank between (AAB..., one more). Whether the manifest's duration or the audio is
    read, the count is the features' own, at the extractor's sample rate: 16 kHz audio for an 8 kHz model is read
    and its manifest duration counted at 8 kHz (counted at 16 kHz, 0.1 s made 21 frames and kept all four)."""
    fitting, too_long = ["ABCDEF", "AABCD"], ["ABCDEFG", "AABCDE"]
    for text in fitting + too_long:
        write_noise(tmp_path / f"{text}.wav", 0.1)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / f"{text}.wav"), 0.1, text, "a")
                                          for text in fitting + too_long])
    dataset = SpeechDataset([tmp_path / "m.jsonl"], FeatureExtractor("spectrogram", sample_rate=sample_rate),
                            time_stride=2)
    assert [utterance.text for utterance in dataset.utterances] == fitting
    assert dataset.skipped == Counter({"too long for stride": 2})
    assert [dataset[index].features.shape for index in range(len(dataset))] == [(11, sample_rate // 100 + 1)] * 2


def test_a_manifests_duration_counts_its_samples_rounded_not_cut_short(tmp_path):
    """2.01 s is 32159.999999999996 samples in floating point: cut short, 32159 gave one frame fewer than the audio's
    202, and a transcript that fills its 68 output frames at time stride 3 was left out as too long."""
    write_noise(tmp_path / "a.wav", 2.01)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / "a.wav"), 2.01, "AB" * 34, "a")])
    dataset = SpeechDataset(tmp_path / "m.jsonl", FeatureExtractor("spectrogram"), time_stride=3)
    assert not dataset.skipped and len(dataset[0].features) == 202


def test_audio_up_to_a_second_past_max_duration_is_kept_and_no_longer(tmp_path):
    """A manifest's durations may be rounded or a little off: only audio more than a second past max_duration (20 s
    here) is unusable once read."""
    write_noise(tmp_path / "long.wav", 20.9)
    write_noise(tmp_path / "a_second_past.wav", 21.0)
    write_noise(tmp_path / "longer.wav", 21.1)
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(tmp_path / name), 20.0, "LONG", "a")
                                          for name in ("long.wav", "a_second_past.wav", "longer.wav")])
    dataset = make_dataset(tmp_path / "m.jsonl")
    assert [len(dataset[index].features) for index in range(2)] == [2091, 2101]
    assert dataset[2].counted_as == LONGER_THAN_MAX_DURATION


def test_a_manifest_with_no_usable_utterance_is_one_clear_error(tmp_path):
    write_manifest(tmp_path / "blank.jsonl", [Utterance(str(tmp_path / "a.wav"), 1.0, " ", "c")])
    with pytest.raises(ValueError,
                       match=r"no usable utterance in .*blank.jsonl: skipped 1 utterance \(empty transcript\)$"):
        make_dataset(tmp_path / "blank.jsonl")
    (tmp_path / "blank_lines.jsonl").write_text("\n\n")  # a 0-byte one is refused before (data.manifest)
    with pytest.raises(ValueError, match=r"blank_lines.jsonl: skipped none, the manifest is empty$"):
        make_dataset(tmp_path / "blank_lines.jsonl")


def test_unreadable_empty_or_too_short_audio_is_unusable_and_warned_about_once(manifest, caplog):
    dataset = make_dataset(manifest)
    items = [dataset[index] for index in range(5)]
    assert [isinstance(item, Unusable) for item in items] == [False, False, True, True, True]
    assert [item.index for item in items] == [0, 1, 2, 3, 4]
    assert [item.counted_as for item in items[2:]] == [UNREADABLE, UNREADABLE, TOO_LONG_FOR_STRIDE]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        dataset.warn_once(items[2:])
        dataset.warn_once([dataset[2], dataset[3]])  # a later epoch: no second warning
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 3
    assert "corrupt.flac" in messages[0] and "empty.wav" in messages[1] and "no samples" in messages[1]
    assert "short.wav" in messages[2] and "6 output frames" in messages[2]
    # One frame is worded as one (it said "1 output frames").
    assert dataset._too_long_detail(1, [1, 2, 3]).startswith("the model has 1 output frame for it at time stride 2,")


def test_past_the_first_few_of_a_reason_audio_that_cannot_be_used_is_counted_not_named(tmp_path, caplog):
    """A corpus with thousands of files that cannot be decoded named each of them while training, on every rank."""
    write_noise(tmp_path / "good.wav", 1.0)
    write_noise(tmp_path / "short.wav", 0.1)
    corrupt = [f"corrupt{number}.flac" for number in range(8)]
    for name in corrupt:
        (tmp_path / name).write_bytes(b"not audio at all" * 64)
    write_manifest(tmp_path / "m.jsonl", [*(Utterance(str(tmp_path / name), 1.0, "YES", "a")
                                            for name in ("good.wav", *corrupt)),
                                          Utterance(str(tmp_path / "short.wav"), 3.0, "ABCDEFGHIJ", "b")])
    dataset = make_dataset(tmp_path / "m.jsonl")
    unusable = [dataset[index] for index in range(1, len(dataset))]
    with caplog.at_level(logging.WARNING):
        dataset.warn_once(unusable[:3])
        dataset.warn_once(unusable[3:])
        dataset.warn_once(unusable)  # a later epoch
    messages = [record.getMessage() for record in caplog.records]
    assert [message.split(":")[0] for message in messages[:5]] == [
        f"skipping {tmp_path / name}" for name in corrupt[:5]]
    assert messages[5:] == [
        "skipping more utterances (unreadable) without naming them; the counts of those left out include them",
        f"skipping {tmp_path / 'short.wav'}: the model has 6 output frames for it at time stride 2, fewer than the 10 "
        "its 10-character transcript needs"]


def test_loader_processes_warn_about_nothing_and_each_unusable_file_is_warned_about_once(manifest, caplog):
    dataset = make_dataset(manifest)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        # Loading, which loader processes do, warns about nothing: their log lines would not reach caplog here.
        assert [dataset[index] for index in range(len(dataset))] and not caplog.records
        for _ in range(2):  # two epochs, each with a new loader process and so a fresh copy of the dataset
            for batch in DataLoader(dataset, batch_size=5, collate_fn=collate, num_workers=1):
                dataset.warn_once(batch.unusable)
    assert sorted(record.getMessage().split(":")[0] for record in caplog.records) == [
        f"skipping {manifest.parent / name}" for name in ("corrupt.flac", "empty.wav", "short.wav")]


def test_audio_longer_than_its_manifest_says_or_with_overflowing_samples_is_unusable(tmp_path):
    write_noise(tmp_path / "good.wav", 1.0)
    write_noise(tmp_path / "lecture.wav", 25.0)
    soundfile.write(tmp_path / "loud.wav", np.array([3e38, -3e38] * 8000, np.float32), RATE, subtype="FLOAT")
    samples = np.zeros(RATE, np.float32)
    # Overflows the spectrum in some bins only: features that are finite in part. Downwards, its largest sample is
    # the one of largest magnitude.
    samples[8000:8002] = -3e38
    soundfile.write(tmp_path / "click.wav", samples, RATE, subtype="FLOAT")
    write_manifest(tmp_path / "m.jsonl", [
        Utterance(str(tmp_path / "good.wav"), 1.0, "A", "a"),
        Utterance(str(tmp_path / "lecture.wav"), 1.0, "A", "a"),  # 25 s, past max_duration, listed as 1 s
        Utterance(str(tmp_path / "loud.wav"), 1.0, "A", "a"),  # finite samples whose spectrum overflows
        Utterance(str(tmp_path / "click.wav"), 1.0, "A", "a"),
    ])
    dataset = make_dataset(tmp_path / "m.jsonl")
    items = [dataset[index] for index in range(4)]
    assert [isinstance(item, Unusable) for item in items] == [False, True, True, True]
    lecture, loud, click = (item.warning for item in items[1:])
    assert "lecture.wav: its audio lasts 25.0 s, more than max_duration (20 s); the manifest says 1.0 s" in lecture
    assert "loud.wav: its features are not finite (its largest sample is 3e+38)" in loud
    assert "click.wav: its features are not finite (its largest sample is 3e+38)" in click
    # Counted by reason in the training log's summary: the lecture as the choice max_duration makes, not a fault.
    assert [item.counted_as for item in items[1:]] == [LONGER_THAN_MAX_DURATION, UNREADABLE, UNREADABLE]


def test_audio_longer_than_its_manifest_says_is_refused_from_its_header_without_being_decoded(tmp_path, monkeypatch):
    write_noise(tmp_path / "good.wav", 1.0)
    write_noise(tmp_path / "lecture.wav", 25.0)
    write_manifest(tmp_path / "m.jsonl", [
        Utterance(str(tmp_path / "good.wav"), 1.0, "A", "a"),
        Utterance(str(tmp_path / "lecture.wav"), 1.0, "A", "a"),  # 25 s, past max_duration, listed as 1 s
    ])
    dataset = make_dataset(tmp_path / "m.jsonl")
    decoded = []
    monkeypatch.setattr("data.dataset.load_audio", lambda path, *args, **kwargs: decoded.append(Path(path).name) or
                        torch.zeros(RATE))
    batch = collate([dataset[0], dataset[1]])
    # Decoding it took up to an hour of audio (and gigabytes resampled) every epoch in every loader process.
    assert decoded == ["good.wav"]
    assert "lecture.wav: its audio lasts 25.0 s, more than max_duration (20 s); the manifest says 1.0 s" in \
        batch.unusable[0].warning
    assert len(batch.indices) == 1 and batch.num_unusable_as(LONGER_THAN_MAX_DURATION) == 1 == batch.num_unusable


def test_an_items_audio_header_is_read_once(manifest, monkeypatch):
    # Read for the max_duration check and again by load_audio: two opens and parses of every file, every epoch.
    dataset = make_dataset(manifest)
    expected = dataset[0].features
    read = []
    info = soundfile.info
    monkeypatch.setattr(soundfile, "info", lambda file, *args: read.append(file) or info(file, *args))
    sample = dataset[0]
    assert len(read) == 1 and torch.equal(sample.features, expected)


def test_sample_holds_features_targets_and_index(manifest):
    sample = make_dataset(manifest)[1]
    assert sample.features.shape == (51, 161) and sample.features.dtype == torch.float32
    assert sample.targets.dtype == torch.int64 and sample.targets.tolist() == encode("HI THERE")
    assert sample.index == 1


def test_collate_pads_concatenates_and_counts_skipped(manifest):
    dataset = make_dataset(manifest)
    batch = collate([dataset[index] for index in range(5)])
    assert batch.features.shape == (2, 101, 161)
    assert batch.feature_lengths.tolist() == [101, 51]
    torch.testing.assert_close(batch.features[1, :51], dataset[1].features)
    assert bool((batch.features[1, 51:] == 0).all())
    assert batch.targets.tolist() == encode("HELLO") + encode("HI THERE")
    assert batch.target_lengths.tolist() == [5, 8]
    assert batch.indices.tolist() == [0, 1]
    assert batch.num_unusable == 3
    assert all(tensor.dtype == torch.int64 for tensor in (batch.feature_lengths, batch.targets, batch.target_lengths))
    # Made in the training process itself (train.num_workers=0), it stays out of /dev/shm, which a container may keep
    # small: only a worker's batch goes there.
    assert not batch.features.is_shared()


def test_collate_of_only_unusable_samples_is_an_empty_batch():
    batch = collate([Unusable(3, "skipping a"), Unusable(5, "skipping b")])
    assert batch.features.shape == (0, 0, 0) and batch.targets.numel() == 0 and batch.indices.numel() == 0
    assert batch.num_unusable == 2 and [item.index for item in batch.unusable] == [3, 5]


def with_a_file_size_limit_of_4_kib(worker_id: int) -> None:
    """A DataLoader's worker_init_fn: the worker's shared memory (files in /dev/shm) fails as a full /dev/shm does."""
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_a_batch_that_shared_memory_cannot_take_is_its_workers_error():
    """The queue's feeder thread moved the batch into shared memory as it sent it: its failure was printed there and
    the batch lost, and the training process waited for it until distributed.timeout_s, then blamed a stuck worker."""
    samples = [Sample(torch.ones(100, 40), torch.tensor([1]), index) for index in range(4)]  # 16 KB of features each
    loader = DataLoader(samples, batch_size=2, collate_fn=collate, num_workers=1, timeout=10,
                        worker_init_fn=with_a_file_size_limit_of_4_kib)
    with pytest.raises(RuntimeError, match="File too large") as failed:
        next(iter(loader))
    # torch's reraise keeps the error in its frame, which the error's traceback holds, as the traceback holds this
    # frame: cycles that kept the iterator, its worker and its pipes, until a later test's garbage collection.
    failed.value.__traceback__ = None
    del failed


def test_augment_masks_the_training_features(manifest):
    plain = make_dataset(manifest)[0].features
    torch.manual_seed(0)
    augmented = make_dataset(manifest, augment=SpecAugment(freq_mask=30, time_mask=30))[0].features
    assert augmented.shape == plain.shape
    changed = augmented != plain
    assert changed.any() and bool((augmented[changed] == 0).all())


def test_augment_takes_any_integer_seed(manifest):
    """The masks' seed mixes seed, epoch and item into 64 bits: a date as the seed once overflowed them."""
    for seed in (20240101, 2**70, -1):
        dataset = make_dataset(manifest, augment=SpecAugment(freq_mask=30, time_mask=30), seed=seed)
        assert torch.equal(dataset[0].features, dataset[0].features)


def test_augment_masks_follow_seed_epoch_and_item(manifest):
    """Each (seed, epoch, item) draws its own masks, the same on every load, whatever the global generator holds."""
    def masks(seed, epoch, index):
        dataset = make_dataset(manifest, augment=SpecAugment(freq_mask=30, time_mask=30), seed=seed)
        dataset.set_epoch(epoch)
        torch.manual_seed(epoch * 7 + index)  # the global state must not matter
        return dataset[index].features == 0

    first = masks(1, 0, 0)
    assert torch.equal(first, masks(1, 0, 0))
    assert not torch.equal(first, masks(1, 1, 0)) and not torch.equal(first, masks(2, 0, 0))
    second = masks(1, 0, 1)
    # Another item of another length: compare its masked frequency bands, which any item has.
    assert not torch.equal(first.all(0), second.all(0))
    # Nor does the next epoch's item draw what the item after it did: seed, epoch and item summed gave it those masks.
    assert not torch.equal(masks(1, 1, 0).all(0), second.all(0))
    # Loading leaves the global generator where it was: with num_workers=0 it is the trainer's own.
    dataset = make_dataset(manifest, augment=SpecAugment(freq_mask=30, time_mask=30), seed=1)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    dataset[0]
    assert torch.equal(torch.rand(4), expected)


def test_the_fingerprint_tells_another_set_of_utterances_but_not_another_folder(manifest, tmp_path):
    dataset = make_dataset(manifest)
    kept = dataset.utterances
    assert dataset.fingerprint().startswith(f"{len(kept)} utterances, sha256 ")
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    second = kept[1]
    variants = {
        "moved": [Utterance(str(moved / Path(u.audio_filepath).name), u.duration, u.text, u.speaker) for u in kept],
        "reordered": [second, kept[0], *kept[2:]],
        "retimed": [kept[0], Utterance(second.audio_filepath, 0.6, second.text, second.speaker), *kept[2:]],
        "retold": [kept[0], Utterance(second.audio_filepath, second.duration, "HI THERE", second.speaker), *kept[2:]],
    }
    fingerprints = {}
    for name, utterances in variants.items():
        write_manifest(tmp_path / f"{name}.jsonl", utterances)
        fingerprints[name] = make_dataset(tmp_path / f"{name}.jsonl").fingerprint()
    assert fingerprints.pop("moved") == dataset.fingerprint()
    assert len({dataset.fingerprint(), *fingerprints.values()}) == 4, fingerprints


def test_a_time_stride_below_1_is_refused_naming_it(manifest):
    # Without the check, a stride of 0 failed at the first utterance, dividing by zero.
    with pytest.raises(ValueError, match=r"^time_stride must be at least 1, got 0$"):
        SpeechDataset([manifest], FeatureExtractor("spectrogram"), time_stride=0)


def test_a_lone_path_is_one_manifest(manifest):
    assert len(SpeechDataset(manifest, FeatureExtractor("mel"))) == 6  # no stride or length limit: 6 kept


def test_data_loader_with_bucket_sampler_and_a_worker(manifest):
    dataset = make_dataset(manifest)
    sampler = BucketBatchSampler(dataset.durations, global_batch_size=2)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=1)
    batches = list(loader)
    assert len(batches) == 2
    assert sorted(index for batch in batches for index in batch.indices.tolist()) == [0, 1]
    assert sum(batch.num_unusable for batch in batches) == 2  # the third bad one fell into the dropped remainder
