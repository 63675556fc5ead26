"""Corpus preparation: AN4 and LibriSpeech layouts to JSONL manifests, and its errors."""
import errno
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile

from conftest import REPO_ROOT, raw_control_characters, within_seconds, without_root_privilege
from data.manifest import Utterance, read_manifest
from data.prepare import main, prepare_an4, prepare_librispeech

RATE = 16000


def write_audio(path: Path, seconds: float, **format_args) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    noise = np.random.default_rng(0).uniform(-0.1, 0.1, round(seconds * RATE)).astype(np.float32)
    soundfile.write(path, noise, RATE, **format_args)


def write_librispeech_chapter(speaker_folder: Path, chapter: str, text: str) -> None:
    """SPEAKER/CHAPTER with one half-second utterance, SPEAKER-CHAPTER-0000, saying `text`."""
    utterance = f"{speaker_folder.name}-{chapter}"
    (speaker_folder / chapter).mkdir(parents=True)
    (speaker_folder / chapter / f"{utterance}.trans.txt").write_text(f"{utterance}-0000 {text}\n")
    write_audio(speaker_folder / chapter / f"{utterance}-0000.flac", 0.5)


@pytest.fixture
def tiny_an4(tmp_path) -> Path:
    """An AN4-shaped corpus: each audio format, two speakers, one train utterance without audio."""
    root = tmp_path / "an4"
    etc = root / "etc"
    etc.mkdir(parents=True)
    (etc / "an4_train.fileids").write_text(
        "an4_clstk/fash/an251-fash-b\nan4_clstk/fash/an253-fash-b\nan4_clstk/mgah/cen1-mgah-b\n"
        "an4_clstk/mgah/cen2-mgah-b\n"
    )
    (etc / "an4_train.transcription").write_text(
        "<s> YES </s> (an251-fash-b)\n<s> go  on </s> (an253-fash-b)\n"
        "<s> SIX TWO </s> (cen1-mgah-b)\n<s> NO AUDIO </s> (cen2-mgah-b)\n"
    )
    (etc / "an4_test.fileids").write_text("an4test_clstk/fcaw/an406-fcaw-b\n")
    (etc / "an4_test.transcription").write_text("RUBOUT G M E F THREE NINE (an406-fcaw-b)\n")
    wav = root / "wav"
    write_audio(wav / "an4_clstk/fash/an251-fash-b.flac", 1.0)
    write_audio(wav / "an4_clstk/fash/an253-fash-b.wav", 0.5)
    write_audio(wav / "an4_clstk/mgah/cen1-mgah-b.sph", 0.75, format="NIST", subtype="PCM_16")
    write_audio(wav / "an4test_clstk/fcaw/an406-fcaw-b.flac", 2.0)
    return root


def test_an4_manifests_have_clean_text_speakers_durations_and_absolute_paths(tiny_an4, tmp_path, caplog):
    out = tmp_path / "manifests"
    with caplog.at_level(logging.INFO):
        main(["an4", "--source", str(tiny_an4), "--out", str(out)])
    wav = tiny_an4 / "wav"
    assert read_manifest(out / "an4_train.jsonl") == [
        Utterance(str(wav / "an4_clstk/fash/an251-fash-b.flac"), 1.0, "YES", "fash"),
        Utterance(str(wav / "an4_clstk/fash/an253-fash-b.wav"), 0.5, "GO ON", "fash"),
        Utterance(str(wav / "an4_clstk/mgah/cen1-mgah-b.sph"), 0.75, "SIX TWO", "mgah"),
    ]
    assert read_manifest(out / "an4_test.jsonl") == [
        Utterance(str(wav / "an4test_clstk/fcaw/an406-fcaw-b.flac"), 2.0, "RUBOUT G M E F THREE NINE", "fcaw")
    ]
    written = [json.loads(line) for line in (out / "an4_train.jsonl").read_text().splitlines()]
    assert all(Path(record["audio_filepath"]).is_absolute() for record in written)
    assert "skipping " + str(wav / "an4_clstk/mgah/cen2-mgah-b") in caplog.text
    assert "wrote 3 utterances" in caplog.text and "skipped 1 without usable audio" in caplog.text


def test_an4_audio_that_is_not_audio_is_skipped_and_named(tiny_an4, tmp_path, caplog):
    corrupt = tiny_an4 / "wav" / "an4_clstk/mgah/cen2-mgah-b.flac"
    corrupt.write_bytes(b"not audio at all" * 64)
    with caplog.at_level(logging.INFO):
        main(["an4", "--source", str(tiny_an4), "--out", str(tmp_path / "manifests")])
    assert f"skipping {corrupt}: cannot read audio (" in caplog.text
    assert "wrote 3 utterances" in caplog.text and "skipped 1 without usable audio" in caplog.text


def test_the_log_line_gives_the_hours_of_audio_written(tiny_an4, tmp_path, caplog):
    """The figure that tells a corpus half-read from a whole one: the tiny corpus' seconds give "0.00 h" however they
    are summed, so its train audio is made 3 minutes long here, unevenly, for a sum that no other count gives."""
    train = tiny_an4 / "wav" / "an4_clstk"
    for name, seconds in [("fash/an251-fash-b.flac", 90), ("fash/an253-fash-b.wav", 72)]:
        write_audio(train / name, seconds)
    write_audio(train / "mgah/cen1-mgah-b.sph", 18, format="NIST", subtype="PCM_16")
    with caplog.at_level(logging.INFO):
        main(["an4", "--source", str(tiny_an4), "--out", str(tmp_path / "manifests")])
    assert "an4 train: wrote 3 utterances (0.05 h) to " in caplog.text


def test_an4_audio_whose_header_claims_what_loading_refuses_is_skipped_and_named(tiny_an4, tmp_path, caplog):
    """A manifest never lists a duration the manifest reader would refuse (a FLAC written to a pipe leaves its length
    unknown, which libsndfile gives as 2^63 - 1 frames) or a file loading would skip anyway (no samples)."""
    unknown_length = tiny_an4 / "wav" / "an4_clstk/fash/an251-fash-b.flac"
    flac = bytearray(unknown_length.read_bytes())
    flac[21] &= 0xF0  # STREAMINFO's 36-bit sample count: 0, unknown
    flac[22:26] = bytes(4)
    unknown_length.write_bytes(bytes(flac))
    empty = tiny_an4 / "wav" / "an4_clstk/fash/an253-fash-b.wav"
    soundfile.write(empty, np.zeros(0, np.float32), RATE)
    with caplog.at_level(logging.INFO):
        main(["an4", "--source", str(tiny_an4), "--out", str(tmp_path / "manifests")])
    assert (f"skipping {unknown_length}: its header gives no length, as a FLAC written to a pipe leaves it: encode it "
            "again into a file\n") in caplog.text
    assert f"skipping {empty}: audio holds no samples" in caplog.text
    assert [u.text for u in read_manifest(tmp_path / "manifests" / "an4_train.jsonl")] == ["SIX TWO"]


def test_a_corpus_with_many_files_missing_names_a_few_and_lists_every_one_beside_the_manifest(tmp_path, caplog):
    """LibriSpeech's 281k utterances with a few % of their audio missing gave one warning each, thousands of lines:
    past the first 5 of a reason the log counts them, and NAME.skipped.jsonl beside the manifest names every one. A
    corpus prepared again with none left out removes it."""
    source = tmp_path / "dev-clean"
    write_librispeech_chapter(source / "84", "121123", "GO ON")
    chapter = source / "84" / "121123"
    missing = [f"84-121123-{number:04d}" for number in range(1, 8)]
    with (chapter / "84-121123.trans.txt").open("a") as transcript:
        transcript.writelines(f"{utterance} NO AUDIO\n" for utterance in missing)
    with caplog.at_level(logging.INFO):
        manifest = prepare_librispeech(source, tmp_path / "out")
    skip_list = tmp_path / "out" / "dev-clean.skipped.jsonl"
    assert caplog.records[-1].getMessage().endswith("; skipped 7 without usable audio")  # utterances, not reasons
    assert [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING] == [
        *(f"skipping {chapter / utterance}: no .flac file" for utterance in missing[:5]),
        f"skipping 2 more utterances (no audio file); every one left out is listed in {skip_list}"]
    assert [json.loads(line) for line in skip_list.read_text().splitlines()] == [
        {"audio_filepath": str(chapter / utterance), "reason": "no audio file", "detail": "no .flac file"}
        for utterance in missing]
    assert len(read_manifest(manifest)) == 1

    (chapter / "84-121123.trans.txt").write_text("84-121123-0000 GO ON\n")
    prepare_librispeech(source, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["dev-clean.jsonl"]


def test_an4_split_with_no_usable_audio_exits_2_naming_its_fileids_and_why(tiny_an4, tmp_path, caplog, capsys):
    """Every file of a split left out wrote a manifest of 0 bytes, logged "wrote 0 utterances" and exited 0: the
    trainer then refused the manifest as empty, which did not say why. Nothing is written, an earlier manifest kept."""
    wav = tiny_an4 / "wav" / "an4_clstk"
    (wav / "fash/an251-fash-b.flac").unlink()
    (wav / "fash/an253-fash-b.wav").write_bytes(b"not audio at all" * 64)
    (wav / "mgah/cen1-mgah-b.sph").unlink()
    fresh, earlier = tmp_path / "fresh", tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "an4_train.jsonl").write_text(json.dumps({"audio_filepath": "/a.flac", "duration": 1.0, "text": "A"}))
    for out in (fresh, earlier):
        caplog.clear()
        with caplog.at_level(logging.WARNING), pytest.raises(SystemExit) as exit_info:
            main(["an4", "--source", str(tiny_an4), "--out", str(out)])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == (f"python -m data.prepare: error: no usable utterance in {tiny_an4}/etc/"
                                           "an4_train.fileids: skipped 3 utterances (no audio file), 1 utterance "
                                           "(unreadable)\n")
        assert f"skipping {wav}/mgah/cen1-mgah-b: no .flac / .wav / .sph file" in caplog.text  # each still named
        assert f"skipping {wav}/fash/an253-fash-b.wav: cannot read audio (" in caplog.text
    assert not fresh.exists() or list(fresh.iterdir()) == []
    assert [u.audio_filepath for u in read_manifest(earlier / "an4_train.jsonl")] == ["/a.flac"]
    assert list(earlier.iterdir()) == [earlier / "an4_train.jsonl"]


@pytest.mark.parametrize("corpus", ["an4", "librispeech"])
def test_a_split_that_lists_no_utterance_exits_2_naming_its_listing(tiny_an4, tmp_path, capsys, corpus):
    """An empty etc/an4_test.fileids, or *.trans.txt files holding no line, wrote a manifest of 0 bytes, exit 0."""
    if corpus == "an4":
        source, listing = tiny_an4, f"{tiny_an4}/etc/an4_test.fileids"
        for name in ("an4_test.fileids", "an4_test.transcription"):
            (tiny_an4 / "etc" / name).write_text("\n")
    else:
        source = tmp_path / "dev-clean"
        listing = f"the *.trans.txt files under {source}"
        write_librispeech_chapter(source / "84", "121123", "GO")
        (source / "84" / "121123" / "84-121123.trans.txt").write_text("\n")
    with pytest.raises(SystemExit) as exit_info:
        main([corpus, "--source", str(source), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"python -m data.prepare: error: no usable utterance in {listing}: "
                                       "none is listed there\n")
    assert not (tmp_path / "out" / f"{'an4_test' if corpus == 'an4' else 'dev-clean'}.jsonl").exists()


def test_an4_audio_in_more_than_one_format_is_listed_in_the_first_of_flac_wav_and_sph(tiny_an4, tmp_path):
    wav = tiny_an4 / "wav" / "an4_clstk"
    write_audio(wav / "fash/an253-fash-b.sph", 0.5, format="NIST", subtype="PCM_16")
    write_audio(wav / "mgah/cen1-mgah-b.wav", 0.75)
    write_audio(wav / "mgah/cen1-mgah-b.flac", 0.75)
    train = read_manifest(prepare_an4(tiny_an4, tmp_path / "out")["train"])
    assert [Path(utterance.audio_filepath).name for utterance in train] == [
        "an251-fash-b.flac", "an253-fash-b.wav", "cen1-mgah-b.flac"]


def test_an4_is_rewritten_only_when_a_source_is_newer(tiny_an4, tmp_path):
    manifests = prepare_an4(tiny_an4, tmp_path / "out")
    assert set(manifests) == {"train", "test"}
    train = manifests["train"]
    for source in (tiny_an4 / "etc").iterdir():
        os.utime(source, (1e9, 1e9))
    os.utime(train, (1e9, 1.2e9))  # newer than the sources
    prepare_an4(tiny_an4, tmp_path / "out")
    assert train.stat().st_mtime == 1.2e9
    # As old as a source is no newer: a file system of whole seconds gives an edit a second after the manifest its time.
    os.utime(tiny_an4 / "etc" / "an4_train.fileids", (1e9, 1.2e9))
    prepare_an4(tiny_an4, tmp_path / "out")
    assert train.stat().st_mtime != 1.2e9
    os.utime(train, (1e9, 1.2e9))
    os.utime(tiny_an4 / "etc" / "an4_train.transcription", (1e9, 1.3e9))
    prepare_an4(tiny_an4, tmp_path / "out")
    assert train.stat().st_mtime != 1.2e9


def test_an4_is_rewritten_when_the_corpus_moved_or_its_audio_changed(tiny_an4, tmp_path):
    out = tmp_path / "out"
    assert len(read_manifest(prepare_an4(tiny_an4, out)["train"])) == 3
    moved = tmp_path / "moved"
    shutil.copytree(tiny_an4, moved)  # etc files keep older times than the manifests
    assert all(Path(u.audio_filepath).is_relative_to(moved) for u in read_manifest(prepare_an4(moved, out)["train"]))
    write_audio(moved / "wav" / "an4_clstk/mgah/cen2-mgah-b.flac", 0.5)  # the missing audio arrives
    assert len(read_manifest(prepare_an4(moved, out)["train"])) == 4
    (moved / "wav" / "an4_clstk/fash/an251-fash-b.flac").unlink()
    assert len(read_manifest(prepare_an4(moved, out)["train"])) == 3


def test_an4_manifest_newer_than_its_sources_that_does_not_read_as_one_is_written_again(tiny_an4, tmp_path):
    # A manifest cut short (a copy onto a full disk) or edited by hand into no manifest: prepare stopped on it.
    train = prepare_an4(tiny_an4, tmp_path / "out")["train"]
    utterances = read_manifest(train)
    train.write_text('{"audio_filepath": "wav/an4_clstk/fash/an2')
    for source in (tiny_an4 / "etc").iterdir():
        os.utime(source, (1e9, 1e9))
    os.utime(train, (1e9, 1.2e9))  # newer than the sources
    assert read_manifest(prepare_an4(tiny_an4, tmp_path / "out")["train"]) == utterances


def test_an4_is_not_rewritten_for_audio_still_unreadable_and_is_once_it_is_mended(tiny_an4, tmp_path, caplog):
    unreadable = tiny_an4 / "wav" / "an4_clstk/mgah/cen2-mgah-b.flac"
    unreadable.write_bytes(b"not audio at all" * 64)
    train = prepare_an4(tiny_an4, tmp_path / "out")["train"]
    os.utime(train, (2e9, 2e9))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        prepare_an4(tiny_an4, tmp_path / "out")
    assert train.stat().st_mtime == 2e9 and f"{train} is up to date" in caplog.text
    assert "skipping" not in caplog.text
    write_audio(unreadable, 0.5)
    assert len(read_manifest(prepare_an4(tiny_an4, tmp_path / "out")["train"])) == 4


def test_an4_spelt_another_way_lists_the_same_paths_and_is_not_rewritten(tiny_an4, tmp_path, monkeypatch):
    # A relative source with ".." (from a folder that may go away) lists its audio by their plain absolute paths, so
    # the manifests stay valid and current whichever way the folder is named.
    out = tmp_path / "out"
    train = prepare_an4(tiny_an4, out)["train"]
    os.utime(train, (2e9, 2e9))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert prepare_an4(Path("..") / "an4", out)["train"] == train
    assert train.stat().st_mtime == 2e9
    assert all(Path(u.audio_filepath).is_relative_to(tiny_an4) and ".." not in u.audio_filepath
               for u in read_manifest(train))
    out.joinpath("an4_train.jsonl").unlink()
    prepare_an4(Path("..") / "an4", out)
    assert all(".." not in u.audio_filepath for u in read_manifest(train))


def test_an4_etc_files_may_start_with_a_byte_order_mark(tiny_an4, tmp_path):
    for name in ("an4_test.fileids", "an4_test.transcription"):
        path = tiny_an4 / "etc" / name
        path.write_text("\ufeff" + path.read_text(), encoding="utf-8")
    assert len(read_manifest(prepare_an4(tiny_an4, tmp_path / "out")["test"])) == 1


def test_an4_transcript_for_another_fileid_names_file_and_line(tiny_an4, tmp_path):
    (tiny_an4 / "etc" / "an4_test.transcription").write_text("RUBOUT (an999-fcaw-b)\n")
    with pytest.raises(ValueError, match=r"an4_test.transcription:1: .*an406-fcaw-b"):
        prepare_an4(tiny_an4, tmp_path / "out")


def test_an4_transcription_line_numbers_count_blank_lines(tiny_an4, tmp_path):
    (tiny_an4 / "etc" / "an4_test.transcription").write_text("\n\nRUBOUT (an999-fcaw-b)\n")
    with pytest.raises(ValueError, match=r"an4_test.transcription:3: .*an406-fcaw-b"):
        prepare_an4(tiny_an4, tmp_path / "out")


def test_an4_transcripts_more_than_its_fileids_are_refused_naming_both_files(tiny_an4, tmp_path):
    """zip would pair the first ids with the first transcripts and leave the rest out of the manifest without a word."""
    (tiny_an4 / "etc" / "an4_test.transcription").write_text("RUBOUT (an406-fcaw-b)\nYES (an407-fcaw-b)\n")
    with pytest.raises(ValueError, match=r"an4_test.fileids has 1 ids but .*an4_test.transcription has 2 transcripts"):
        prepare_an4(tiny_an4, tmp_path / "out")


def test_an4_transcripts_fewer_than_its_fileids_are_refused_naming_both_files(tiny_an4, tmp_path):
    """A transcription cut short: zip would leave the last fileids out of the manifest without a word."""
    train = tiny_an4 / "etc" / "an4_train.transcription"
    train.write_text("\n".join(train.read_text().splitlines()[:-1]) + "\n")
    with pytest.raises(ValueError, match=r"an4_train.fileids has 4 ids but .*an4_train.transcription has 3 "
                                         "transcripts"):
        prepare_an4(tiny_an4, tmp_path / "out")


def test_real_an4(an4_source, tmp_path):
    manifests = prepare_an4(an4_source, tmp_path)
    train, test = read_manifest(manifests["train"]), read_manifest(manifests["test"])
    assert (len(train), len(test)) == (948, 130)
    assert (train[0].text, train[0].speaker) == ("YES", "fash")
    assert (test[0].text, test[0].speaker) == ("RUBOUT G M E F THREE NINE", "fcaw")
    assert all(0.5 < utterance.duration < 7 for utterance in train + test)
    assert (len({u.speaker for u in train}), len({u.speaker for u in test})) == (74, 10)


def test_librispeech_layout(tmp_path, caplog):
    source = tmp_path / "dev-clean"
    chapter = source / "84" / "121123"
    chapter.mkdir(parents=True)
    (chapter / "84-121123.trans.txt").write_text("84-121123-0000 GO DO YOU HEAR\n84-121123-0001 BUT IN LESS\n"
                                                 "84-121123-0002\n")  # an empty transcript: the dataset skips it
    write_audio(chapter / "84-121123-0000.flac", 1.5)
    write_audio(chapter / "84-121123-0002.flac", 0.5)
    other = source / "174" / "50561"
    other.mkdir(parents=True)
    (other / "174-50561.trans.txt").write_text("174-50561-0000 FORGOTTEN TOO THE NAME OF GILLIAN\n")
    write_audio(other / "174-50561-0000.flac", 0.25)
    (other / "notes.txt").write_text("read aloud in 2004\n")  # no *.trans.txt: not read as one
    with caplog.at_level(logging.INFO):
        main(["librispeech", "--source", str(source), "--out", str(tmp_path / "out")])
    assert read_manifest(tmp_path / "out" / "dev-clean.jsonl") == [
        Utterance(str(other / "174-50561-0000.flac"), 0.25, "FORGOTTEN TOO THE NAME OF GILLIAN", "174"),
        Utterance(str(chapter / "84-121123-0000.flac"), 1.5, "GO DO YOU HEAR", "84"),
        Utterance(str(chapter / "84-121123-0002.flac"), 0.5, "", "84"),
    ]
    assert "skipping " + str(chapter / "84-121123-0001") in caplog.text
    assert f"reading the 2 chapters under {source}" in caplog.text  # said before the long part
    main(["librispeech", "--source", str(source), "--out", str(tmp_path / "out"), "--name", "dev"])
    assert len(read_manifest(tmp_path / "out" / "dev.jsonl")) == 3
    main(["librispeech", "--source", str(source), "--out", str(tmp_path / "out"), "--name", "dev2.jsonl"])
    assert len(read_manifest(tmp_path / "out" / "dev2.jsonl")) == 3  # was written as dev2.jsonl.jsonl
    # A line breaks at "\n" only, a tab after the id separates it as a space does, and one of white space is none.
    (other / "174-50561.trans.txt").write_text("174-50561-0000\tFORGOTTEN\x85 TOO\n \t\r\n174-50561-0001 A\u2028B\n")
    manifest = prepare_librispeech(source, tmp_path / "out")
    assert [(u.audio_filepath, u.text) for u in read_manifest(manifest) if u.speaker == "174"] == [
        (str(other / "174-50561-0000.flac"), "FORGOTTEN TOO")]  # the whole line; \x85 is white space to Python
    (other / "174-50561.trans.txt").write_bytes(b"174-50561-0000 FORGOTTEN\n174-50561-0001 CAF\xc9\n")  # Latin-1
    with pytest.raises(ValueError, match="174-50561.trans.txt:2: not UTF-8"):
        prepare_librispeech(source, tmp_path / "out")


def test_librispeech_from_a_relative_source_lists_absolute_audio_paths(tmp_path, monkeypatch):
    # A manifest's relative path is read from the manifest's folder (--out), not the folder prepare ran in.
    write_librispeech_chapter(tmp_path / "dev-clean" / "84", "121123", "GO")
    monkeypatch.chdir(tmp_path)
    assert [u.audio_filepath for u in read_manifest(prepare_librispeech("dev-clean", "out"))] == [
        str(tmp_path / "dev-clean" / "84" / "121123" / "84-121123-0000.flac")]


def test_an_out_folder_that_is_not_utf8_is_named_as_its_skipped_audio_is(tmp_path):
    # Its "wrote" lines named b"\xff" as stderr's "\udcff", which names no byte, where the warning on audio of such a
    # path and the other tools name it "\xff".
    source = tmp_path / "dev-clean"
    write_librispeech_chapter(source / "84", "121123", "GO")
    out = bytes(tmp_path) + b"/out\xff"
    result = subprocess.run([sys.executable, "-m", "data.prepare", "librispeech", "--source", str(source), "--out",
                             out], cwd=Path(__file__).parents[1], capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f" to {tmp_path}/out\\xff/dev-clean.jsonl; ".encode() in result.stderr, result.stderr


def test_audio_whose_path_is_not_utf8_is_skipped_or_refused_naming_it(tiny_an4, tmp_path, caplog, capsys):
    source = tmp_path / "dev-clean"
    for speaker in ("84", "85"):
        write_librispeech_chapter(source / speaker, "121123", "GO")
    (source / "85").rename(source / os.fsdecode(b"\xff"))  # a name of bytes that no manifest line can hold
    with caplog.at_level(logging.WARNING):
        manifest = prepare_librispeech(source, tmp_path / "out")
    assert [u.audio_filepath for u in read_manifest(manifest)] == [str(source / "84/121123/84-121123-0000.flac")]
    assert (f"skipping {source}/\\xff/121123/85-121123-0000.flac: its path is not UTF-8, which a manifest cannot "
            "hold (rename it)") in caplog.text
    # Nor one holding a control character, which the manifest's reader refuses (it would break the lines naming it,
    # or with a bidirectional control, U+202E, print the rest of them backwards).
    escape = source / "84" / "121123" / "84-121123-0000\x1b[2J.flac"
    reversing = source / "84" / "121123" / "84-121123-0001\u202ecalf.flac"
    write_audio(escape, 0.5)
    write_audio(reversing, 0.5)
    (source / "84" / "121123" / "84-121123.trans.txt").write_text(
        "84-121123-0000\x1b[2J GO\n84-121123-0001\u202ecalf GO\n")
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as error:
        prepare_librispeech(source, tmp_path / "out")
    assert str(error.value) == (f"no usable utterance in the *.trans.txt files under {source}: skipped 2 utterances "
                                "(control character in path), 1 utterance (path not UTF-8)")
    assert [u.audio_filepath for u in read_manifest(manifest)] == [str(source / "84/121123/84-121123-0000.flac")]
    chapter = f"{source}/84/121123"
    assert (f"skipping {chapter}/84-121123-0000\\x1b[2J.flac: its path holds the control character '\\x1b' (U+001B), "
            "which would break or reorder the lines naming it (rename it)") in caplog.text
    assert (f"skipping {chapter}/84-121123-0001\\u202ecalf.flac: its path holds the control character '\\u202e' "
            "(U+202E), which would break or reorder the lines naming it (rename it)") in caplog.text
    latin1 = tmp_path / os.fsdecode(b"an4 \xe9t\xe9")
    tiny_an4.rename(latin1)
    for corpus in ("an4", "librispeech"):
        with pytest.raises(SystemExit) as exit_info:
            main([corpus, "--source", str(latin1), "--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == (f"python -m data.prepare: error: {tmp_path}/an4 \\xe9t\\xe9: the path is "
                                           "not UTF-8, which a manifest's audio paths must be (rename it)\n")


def test_an4_names_read_from_its_etc_files_are_quoted_in_escapes(tiny_an4, tmp_path, caplog, capsys):
    """A fileid is read from etc/*.fileids: one holding a terminal's escape cleared the screen where its missing audio
    was named, and a bidirectional control printed the rest of the line backwards."""
    etc = tiny_an4 / "etc"
    with (etc / "an4_train.fileids").open("a") as fileids:
        fileids.write("an4_clstk/fash/an9\x1b[2J\x07-fash-b\n")
    with (etc / "an4_train.transcription").open("a") as transcription:
        transcription.write("<s> GONE </s> (an9\x1b[2J\x07-fash-b)\n")
    with caplog.at_level(logging.WARNING):
        main(["an4", "--source", str(tiny_an4), "--out", str(tmp_path / "out")])
    missing = f"{tiny_an4}/wav/an4_clstk/fash/an9\\x1b[2J\\x07-fash-b"
    assert f"skipping {missing}: no .flac / .wav / .sph file" in caplog.text
    assert not raw_control_characters("".join(caplog.messages))
    (etc / "an4_test.fileids").write_text("an4test_clstk/fcaw/an406\u202e-fcaw-b\n")
    (etc / "an4_test.transcription").write_text("RUBOUT (an999-fcaw-b)\n")
    with pytest.raises(SystemExit):
        main(["an4", "--source", str(tiny_an4), "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert error.endswith("an4_test.transcription:1: expected 'TEXT (an406\\u202e-fcaw-b)', got "
                          "'RUBOUT (an999-fcaw-b)'\n"), error
    assert not raw_control_characters(error.removesuffix("\n"))


def test_librispeech_names_read_from_its_files_and_folders_are_quoted_in_escapes(tmp_path, caplog):
    """Utterance ids come from the *.trans.txt files, and links from the tree's listing: printed raw, one retitled
    the terminal (ESC ] 0 ; ... BEL) or wrote over the line naming it (a carriage return)."""
    source = tmp_path / "dev-clean"
    write_librispeech_chapter(source / "84", "121123", "GO")
    chapter = source / "84" / "121123"
    with (chapter / "84-121123.trans.txt").open("a") as transcript:
        transcript.write("84-121123-0009\x1b]0;pwned\x07 GONE\n")
    (source / "84" / "\r\x08gone").symlink_to(tmp_path / "unmounted\u202e")
    with caplog.at_level(logging.WARNING):
        main(["librispeech", "--source", str(source), "--out", str(tmp_path / "out")])
    assert f"skipping {chapter}/84-121123-0009\\x1b]0;pwned\\x07: no .flac file" in caplog.text
    assert (f"skipping {source}/84/\\r\\x08gone: a symbolic link to {tmp_path}/unmounted\\u202e, which does not "
            "exist") in caplog.text
    assert not raw_control_characters("".join(caplog.messages))


def test_the_log_words_a_count_of_one_in_the_singular(tmp_path, caplog):
    """A corpus of one chapter of one utterance: it said "reading the 1 chapters" and "wrote 1 utterances"."""
    source = tmp_path / "dev-clean"
    write_librispeech_chapter(source / "84", "121123", "GO")
    with caplog.at_level(logging.INFO):
        main(["librispeech", "--source", str(source), "--out", str(tmp_path / "out")])
    assert f"reading the 1 chapter under {source}" in caplog.text, caplog.text
    assert "librispeech dev-clean: wrote 1 utterance (0.00 h) to " in caplog.text, caplog.text


def test_an_out_that_cannot_be_written_exits_2_naming_it(tiny_an4, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["an4", "--source", str(tiny_an4), "--out", str(tmp_path / "a_file")])
    assert f"{tmp_path / 'a_file'} is a file, not a folder to write the manifest" in capsys.readouterr().err
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["an4", "--source", str(tmp_path / "a_file"), "--out", str(tmp_path / "out")])
    assert f"{tmp_path / 'a_file'} is not a folder" in capsys.readouterr().err and exit_info.value.code == 2


def test_an_out_under_a_file_exits_2_naming_the_file(tiny_an4, tmp_path, capsys):
    # A file further up than --out's own folder: "[Errno 20] Not a directory: '.../a_file/sub'" from data.prepare,
    # "cannot open .../a_file/sub: Not a directory" from the trainer, where --out a_file itself was named as a file.
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["an4", "--source", str(tiny_an4), "--out", str(tmp_path / "a_file" / "sub")])
    assert capsys.readouterr().err.endswith(f"error: {tmp_path / 'a_file'} is a file, not a folder to write the "
                                            "manifest sub/an4_train.jsonl into\n")
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    "corpus, missing",
    [("an4", "nowhere"), ("an4", "etc/an4_train.fileids"), ("librispeech", "nowhere"), ("librispeech", ".")],
)
def test_missing_source_exits_2_naming_the_path(tiny_an4, tmp_path, capsys, corpus, missing):
    if missing == "nowhere":
        source, named = tmp_path / "nowhere", tmp_path / "nowhere"
    elif missing == ".":
        source, named = tiny_an4, tiny_an4  # exists, but holds no *.trans.txt
    else:
        source, named = tiny_an4, tiny_an4 / missing
        named.unlink()
    with pytest.raises(SystemExit) as exit_info:
        main([corpus, "--source", str(source), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert str(named) in stderr and "Traceback" not in stderr
    if missing == ".":  # not "none is listed there", as if its transcripts held no line
        assert stderr.endswith(f"error: no *.trans.txt transcript files under {named}\n")


@pytest.mark.parametrize("corpus, empty", [("an4", "--out"), ("librispeech", "--source"), ("librispeech", "--out")])
def test_an_empty_path_is_refused_not_taken_for_the_current_folder(tiny_an4, tmp_path, monkeypatch, capsys, corpus,
                                                                   empty):
    """An unset shell variable (--out "$OUT") wrote the manifests into the current folder, exit 0; --source "" read
    every transcript under it (a home folder's, say)."""
    monkeypatch.chdir(tmp_path)
    librispeech = tmp_path / "19" / "198"  # a chapter in the current folder, which --source "" read
    librispeech.mkdir(parents=True)
    (librispeech / "19-198.trans.txt").write_text("19-198-0000 HELLO\n")
    arguments = {"--source": str(tiny_an4), "--out": str(tmp_path / "out"), empty: ""}
    before = sorted(tmp_path.iterdir())
    with pytest.raises(SystemExit) as exit_info:
        main([corpus, *(word for pair in arguments.items() for word in pair)])
    assert exit_info.value.code == 2
    assert f"error: argument {empty}: an empty path (an unset shell variable?)" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("name", ["", "ELSEWHERE/dev", "../dev", "sub/dev", "..", ".", ".jsonl"])
def test_a_name_that_is_not_a_file_name_in_out_is_refused(tmp_path, capsys, name):
    """--name "" (an unset shell variable) wrote the source folder's name, dev-clean.jsonl; an absolute name, or one
    holding a folder, wrote outside --out (../dev.jsonl, /x.jsonl), and ".." wrote "...jsonl"."""
    source = tmp_path / "dev-clean"
    write_librispeech_chapter(source / "84", "121123", "GO")
    (tmp_path / "elsewhere").mkdir()
    name = name.replace("ELSEWHERE", str(tmp_path / "elsewhere"))
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_info:
        main(["librispeech", "--source", str(source), "--out", str(tmp_path / "out"), "--name", name])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.splitlines()[-1] == ("python -m data.prepare librispeech: error: argument --name: " + (
        f"{name!r} is not a file name: NAME.jsonl is written into --out, which names its folder" if name else
        "an empty name (an unset shell variable?)"))
    assert sorted(tmp_path.rglob("*")) == before


def test_an4_source_one_folder_too_high_says_which_folder_it_wants(tiny_an4, tmp_path, capsys):
    """It said ".../etc/an4_train.fileids does not exist", not that the folder given holds AN4's folder."""
    with pytest.raises(SystemExit) as exit_info:
        main(["an4", "--source", str(tiny_an4.parent), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert (f"{tiny_an4.parent} holds no etc/ folder: AN4's source is the folder holding its etc/ and wav/"
            in capsys.readouterr().err)


def test_help_gives_the_layouts_read_and_the_manifests_written(capsys):
    """--help gave the docstring's first line alone: not which folders it reads or which files it writes."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    assert "python -m data.prepare an4 --source DIR --out DIR          # writes an4_train.jsonl and an4_test.jsonl" \
        in shown
    assert "etc/an4_{train,test}.fileids and .transcription" in shown and "SPEAKER-CHAPTER.trans.txt" in shown


def test_librispeech_speakers_linked_into_the_source_are_read_once_each(tmp_path):
    """A subset made of links to speakers' folders: each linked folder is read, and read once where two links (or a
    link and the folder itself) lead to it; a link back up the tree ends the walk there rather than looping."""
    elsewhere = tmp_path / "train-clean-100"
    for speaker in ("19", "26"):
        write_librispeech_chapter(elsewhere / speaker, "198", "NORTHANGER ABBEY")
    subset = tmp_path / "subset"
    write_librispeech_chapter(subset / "real" / "27", "124", "ABBEY")
    (subset / "19").symlink_to(elsewhere / "19", target_is_directory=True)
    (subset / "26").symlink_to(elsewhere / "26", target_is_directory=True)
    (subset / "26-again").symlink_to(elsewhere / "26", target_is_directory=True)
    (subset / "real" / "up").symlink_to(subset, target_is_directory=True)
    utterances = read_manifest(prepare_librispeech(subset, tmp_path / "out"))
    assert sorted(Path(utterance.audio_filepath).name for utterance in utterances) == [
        "19-198-0000.flac", "26-198-0000.flac", "27-124-0000.flac"]


def test_of_two_links_to_one_speakers_folder_the_first_by_name_is_read_whatever_order_the_folder_lists_in(
        tmp_path, monkeypatch):
    """The manifest's paths do not depend on the order in which the file system lists a folder (ext4's is by hash)."""
    elsewhere = tmp_path / "train-clean-100"
    write_librispeech_chapter(elsewhere / "26", "198", "NORTHANGER ABBEY")
    subset = tmp_path.resolve() / "subset"
    subset.mkdir()
    for name in ("26", "26-again"):
        (subset / name).symlink_to(elsewhere / "26", target_is_directory=True)
    walk = os.walk

    def walk_listing_last_name_first(*args, **kwargs):  # a file system that lists a folder's names in that order
        for folder, subfolders, files in walk(*args, **kwargs):
            subfolders.sort(reverse=True)
            yield folder, subfolders, files

    monkeypatch.setattr(os, "walk", walk_listing_last_name_first)
    utterances = read_manifest(prepare_librispeech(subset, tmp_path / "out"))
    assert [utterance.audio_filepath for utterance in utterances] == [str(subset / "26" / "198" / "26-198-0000.flac")]


def test_the_readmes_data_commands_prepare_every_manifest_they_train_on(tmp_path, monkeypatch):
    """The README prepared train-clean-100, then trained with manifests/dev-clean.jsonl as the test set, which none of
    its commands wrote: followed as written, the trainer stopped on a manifest that does not exist."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"^## Data\n\n```bash\n(.*?)```", readme, re.DOTALL | re.MULTILINE).group(1)
    commands = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
    monkeypatch.chdir(tmp_path)
    for command in commands:
        if command[:4] == ["python", "-m", "data.prepare", "librispeech"]:
            source = Path(command[command.index("--source") + 1])
            write_librispeech_chapter(source / "84", "121123", "GO DO YOU HEAR")
            main(command[3:])
    trained_on = [path for command in commands if command[:3] == ["python", "-m", "trainer"]
                  for key, _, value in (argument.partition("=") for argument in command[3:])
                  if key in ("data.train_manifests", "data.eval_manifest") for path in value.strip("[]").split(",")]
    assert len(trained_on) >= 2 and [path for path in trained_on if not Path(path).is_file()] == []


def test_a_librispeech_transcript_that_is_a_pipe_or_a_device_is_named_and_skipped_unread(tmp_path, caplog):
    """A corpus from elsewhere (tar keeps pipes and links) may hold a pipe, or a link to a device, as a chapter's
    *.trans.txt: read whole, a link to /dev/zero took all the memory and a pipe waited for a writer for ever."""
    source = tmp_path / "subset"
    for speaker in ("19", "26"):
        write_librispeech_chapter(source / speaker, "198", "ABBEY")
    pipe = source / "26" / "198" / "26-198.trans.txt"
    pipe.unlink()
    os.mkfifo(pipe)
    with caplog.at_level(logging.WARNING), within_seconds(10):
        utterances = read_manifest(prepare_librispeech(source, tmp_path / "out"))
    assert [Path(utterance.audio_filepath).name for utterance in utterances] == ["19-198-0000.flac"]
    assert f"skipping {pipe}: not a file (a pipe, a device)" in caplog.text


def test_librispeech_folders_that_cannot_be_read_are_named_not_passed_over(tmp_path, monkeypatch, caplog):
    """A link to a speaker's folder on a disk not mounted, and a folder the user may not list: os.walk passed over
    both without a word, and the manifest lacked their utterances with 'skipped 0'."""
    source = tmp_path / "subset"
    for speaker in ("19", "26", "27"):
        write_librispeech_chapter(source / speaker, "198", "ABBEY")
    (source / "40").symlink_to(tmp_path / "unmounted" / "40", target_is_directory=True)
    unlistable, scandir = source / "26", os.scandir

    def scandir_refusing_one(path):  # root, which runs the tests here, may list any folder: refuse as for a user
        if Path(path) == unlistable:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", scandir_refusing_one)
    with caplog.at_level(logging.WARNING):
        utterances = read_manifest(prepare_librispeech(source, tmp_path / "out"))
    assert [Path(utterance.audio_filepath).name for utterance in utterances] == ["19-198-0000.flac", "27-198-0000.flac"]
    assert f"skipping {source / '40'}: a symbolic link to {tmp_path / 'unmounted' / '40'}, which does not exist" \
        in caplog.text
    assert f"skipping {unlistable}: cannot list the folder (Permission denied)" in caplog.text


def test_ctrl_c_ends_prepare_in_one_line_leaving_the_manifest_as_it_was(tmp_path, monkeypatch, capsys):
    """Minutes into a large corpus, Ctrl-C ended it in a traceback from wherever it was reading."""
    source = tmp_path / "dev-clean"
    write_librispeech_chapter(source / "84", "121123", "GO")
    manifest = prepare_librispeech(source, tmp_path / "out")
    before = manifest.read_bytes()
    write_librispeech_chapter(source / "85", "121123", "GO")

    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr("data.prepare.audio_header", interrupted)
    try:
        main(["librispeech", "--source", str(source), "--out", str(tmp_path / "out")])
    except KeyboardInterrupt:  # not let through to pytest, which would take it as its own and end the session
        pytest.fail("Ctrl-C reached the caller, which Python ends in a traceback")
    except SystemExit as exit:
        assert exit.code == 130 and capsys.readouterr().err == "interrupted by Ctrl-C\n"
    else:
        pytest.fail("main went on after Ctrl-C")
    assert manifest.read_bytes() == before and os.listdir(tmp_path / "out") == ["dev-clean.jsonl"]


# `python -m data.prepare ARGS...` as the shell runs it, sent SIGTERM as it reads its first audio file.
TERMINATED_WHILE_READING = """
import os, runpy, signal, sys, time
import data.audio
def terminated(path):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
data.audio.audio_header = terminated
sys.argv = ["data.prepare", *sys.argv[1:]]
runpy.run_module("data.prepare", run_name="__main__", alter_sys=True)
"""


def test_sigterm_ends_prepare_in_one_line_leaving_the_manifest_as_it_was(tmp_path):
    """data.prepare ran outside run_tool, and SIGTERM (kill, a scheduler ending the job) ended it without a word."""
    source = tmp_path / "dev-clean"
    write_librispeech_chapter(source / "84", "121123", "GO")
    manifest = prepare_librispeech(source, tmp_path / "out")
    before = manifest.read_bytes()
    write_librispeech_chapter(source / "85", "121123", "GO")
    result = subprocess.run([sys.executable, "-c", TERMINATED_WHILE_READING, "librispeech", "--source", str(source),
                             "--out", str(tmp_path / "out")], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert (result.returncode, result.stderr.splitlines()[-1:]) == (143, ["terminated by SIGTERM"]), result.stderr
    assert manifest.read_bytes() == before and os.listdir(tmp_path / "out") == ["dev-clean.jsonl"]


def test_without_a_terminal_prepare_says_how_far_it_has_read(tmp_path, monkeypatch, caplog):
    """LibriSpeech's 281k files take minutes to read; under SLURM or nohup, with no progress bar, the log said
    nothing between its first line and its last."""
    source = tmp_path / "dev-clean"
    for speaker in ("84", "85", "86"):
        write_librispeech_chapter(source / speaker, "121123", "GO")
    monkeypatch.setattr("data.prepare.PROGRESS_LINE_S", 0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with caplog.at_level(logging.INFO):
        prepare_librispeech(source, tmp_path / "out")
    assert [record.getMessage() for record in caplog.records if record.getMessage().startswith("read ")] == [
        "read 0 of 3 chapters", "read 1 of 3 chapters", "read 2 of 3 chapters"]


def test_an_out_folder_that_cannot_be_written_is_said_as_a_write(tiny_an4, tmp_path):
    """It said 'error: [Errno 13] Permission denied: '.../an4_train.jsonl'', Python's words, not what was refused."""
    out = tmp_path / "out"
    out.mkdir(mode=0o555)
    result = subprocess.run(without_root_privilege([sys.executable, "-m", "data.prepare", "an4", "--source",
                                                    str(tiny_an4), "--out", str(out)]),
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-4000:]
    assert result.stderr.endswith(f"python -m data.prepare: error: cannot write {out / 'an4_train.jsonl'}: Permission "
                                  "denied\n"), result.stderr[-4000:]
    assert list(out.iterdir()) == []
