"""Reading and writing JSONL manifests."""
import errno
import io
import json
import os
import subprocess
import sys
import threading
import unicodedata
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from data.manifest import (MAX_LINE_BYTES, Utterance, print_paths_printable, printable, read_manifest,
                           write_manifest)


def test_write_then_read_gives_the_same_utterances(tmp_path):
    utterances = [
        Utterance(str(tmp_path / "a.flac"), 1.25, "HELLO WORLD", "spk1"),
        Utterance(str(tmp_path / "b c.wav"), 0.5, "DON'T", "spk2"),
        # Persian's zero-width non-joiner is a format character too, but no control: such a name stays.
        Utterance(str(tmp_path / "\u0645\u06cc\u200c\u0631\u0648\u0645 caf\u00e9.wav"), 0.5, "A", "spk3"),
    ]
    path = tmp_path / "nested" / "m.jsonl"
    write_manifest(path, utterances)
    assert read_manifest(path) == utterances
    assert [p.name for p in path.parent.iterdir()] == ["m.jsonl"]  # no partial file left behind
    assert "caf\u00e9.wav" in path.read_text(encoding="utf-8")  # as UTF-8, not "\\u00e9": grep finds the name


def test_a_failed_write_names_the_manifest_and_leaves_no_partial_file(tmp_path):
    """A full disk, played by a file size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write fails)."""
    path = tmp_path / "m.jsonl"
    script = (
        "import resource\n"
        "from data.manifest import Utterance, write_manifest\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        f"write_manifest({str(path)!r}, [Utterance('/a.flac', 1.25, 'HELLO', 'spk1')] * 1000)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert result.stderr.rstrip().endswith(f"OSError: [Errno {errno.EFBIG}] File too large: '{path}'"), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_is_a_symbolic_link_to_nothing_is_named_with_its_target(tmp_path):
    """A manifest folder on a scratch disk that is not mounted: mkdir finds the link and calls it a file that exists."""
    (tmp_path / "scratch").symlink_to(tmp_path / "unmounted" / "disk")
    for folder in (tmp_path / "scratch", tmp_path / "scratch" / "an4"):  # the link itself, or a folder under it
        with pytest.raises(ValueError) as error:
            write_manifest(folder / "m.jsonl", [])
        assert str(error.value) == (f"{tmp_path / 'scratch'} is a symbolic link to {tmp_path / 'unmounted' / 'disk'}, "
                                    "which does not exist: cannot write the manifest m.jsonl there")


def test_relative_audio_paths_resolve_against_the_manifest_folder(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    path.parent.mkdir()
    records = [
        {"audio_filepath": "wav/a.flac", "duration": 1, "text": "A", "speaker": "s"},
        {"audio_filepath": "/abs/b.flac", "duration": 2.5, "text": "B"},  # NeMo style: no speaker
        {"audio_filepath": "/abs/c.flac", "duration": 2, "text": "C", "speaker": 12, "offset": 0},
        {"audio_filepath": "/abs/d.flac", "duration": 2, "text": "D", "speaker": None, "offset": None},
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records) + "\n")
    assert read_manifest(path) == [
        Utterance(str(tmp_path / "sub" / "wav" / "a.flac"), 1.0, "A", "s"),
        Utterance("/abs/b.flac", 2.5, "B", ""),
        Utterance("/abs/c.flac", 2.0, "C", "12"),
        Utterance("/abs/d.flac", 2.0, "D", ""),
    ]


def test_relative_audio_paths_resolve_against_the_folder_the_manifest_is_named_in(tmp_path, monkeypatch):
    """Read, a relative path is absolute (Utterance.audio_filepath), whatever the working folder becomes after: a
    manifest named relative to the working folder, its folder taken as the working folder's. A symbolic link to a
    manifest in another folder takes its audio from the link's folder, as README's Manifests section says."""
    (tmp_path / "corpus" / "wav").mkdir(parents=True)
    (tmp_path / "corpus" / "m.jsonl").write_text('{"audio_filepath": "wav/a.flac", "duration": 1.0, "text": "A"}\n')
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "m.jsonl").symlink_to(tmp_path / "corpus" / "m.jsonl")
    monkeypatch.chdir(tmp_path)
    assert [u.audio_filepath for u in read_manifest("corpus/m.jsonl")] == [str(tmp_path / "corpus" / "wav" / "a.flac")]
    assert [u.audio_filepath for u in read_manifest("links/m.jsonl")] == [str(tmp_path / "links" / "wav" / "a.flac")]


def read_through_a_pipe(tmp_path, records: list[dict], **kwargs) -> list[Utterance]:
    """read_manifest(**kwargs) of `records` written into a named pipe, as `<(...)` gives one."""
    pipe = tmp_path / "fifo"
    os.mkfifo(pipe)
    writer = threading.Thread(target=pipe.write_text, args=("".join(json.dumps(record) + "\n" for record in records),))
    writer.start()
    try:
        return read_manifest(pipe, **kwargs)
    finally:
        # A reader that refused the pipe without opening it left the writer waiting for one, and the test hung where
        # it should fail: opened here, without waiting for a writer, the pipe lets the writer finish.
        unblocking = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
        writer.join()
        os.close(unblocking)
        pipe.unlink()


def test_a_manifest_may_be_a_pipe(tmp_path):
    records = [{"audio_filepath": "/abs/a.flac", "duration": 1.0, "text": "A"}]
    assert read_through_a_pipe(tmp_path, records) == [Utterance("/abs/a.flac", 1.0, "A", "")]


def test_a_relative_audio_path_in_a_piped_manifest_is_refused_naming_the_line(tmp_path):
    # <(...) is read from /dev/fd, which holds no audio: every utterance was skipped as "no such audio file" there.
    records = [{"audio_filepath": "/abs/a.flac", "duration": 1.0, "text": "A"},
               {"audio_filepath": "wav/b.flac", "duration": 1.0, "text": "B"}]
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'fifo'}:2: 'audio_filepath' 'wav/b.flac' is relative, and a "
                       "manifest read from a pipe has no folder to take it from: give absolute paths, or the manifest "
                       "as a file$"):
        read_through_a_pipe(tmp_path, records)
    # trainer.lm counts the transcripts alone
    assert [u.text for u in read_through_a_pipe(tmp_path, records, audio_needed=False)] == ["A", "B"]


def test_a_file_without_line_breaks_is_refused_without_reading_it_whole(tmp_path):
    # A disk image, or /dev/zero given by mistake: read as one line, it took the memory until a MemoryError traceback.
    (tmp_path / "zeros.img").write_bytes(b"\0" * (2**20 + 1))
    for path in (tmp_path / "zeros.img", "/dev/zero"):
        with pytest.raises(ValueError, match=rf"^{path}:1: a line longer than 1,048,576 bytes: not a text file$"):
            read_manifest(path)


def test_a_line_of_max_line_bytes_is_read_and_one_a_byte_longer_is_refused(tmp_path):
    """The limit counts a line's bytes with its line break: a line of MAX_LINE_BYTES bytes is a manifest's line."""
    def line_of(size: int) -> str:
        start = '{"audio_filepath": "a.wav", "duration": 1.0, "text": "'
        return start + "A" * (size - len(start) - len('"}\n')) + '"}\n'
    good = json.dumps({"audio_filepath": "a.wav", "duration": 1.0, "text": "A"}) + "\n"
    path = tmp_path / "m.jsonl"
    path.write_text(good + line_of(MAX_LINE_BYTES))
    assert len(path.read_bytes()) == len(good) + MAX_LINE_BYTES and len(read_manifest(path)) == 2
    path.write_text(good + line_of(MAX_LINE_BYTES + 1))
    with pytest.raises(ValueError, match=rf"^{path}:2: a line longer than 1,048,576 bytes: not a text file$"):
        read_manifest(path)


def test_missing_manifest_names_the_file(tmp_path):
    # Exact: open()'s own "[Errno 2] No such file or directory: '.../nope.jsonl'" names the file too.
    with pytest.raises(FileNotFoundError) as error:
        read_manifest(tmp_path / "nope.jsonl")
    assert str(error.value) == f"manifest {tmp_path / 'nope.jsonl'} does not exist"
    (tmp_path / "manifests").mkdir()
    with pytest.raises(ValueError) as error:
        read_manifest(tmp_path / "manifests")
    assert str(error.value) == f"manifest {tmp_path / 'manifests'} is a folder, not a file"


def test_printable_names_each_path_by_escapes_no_other_path_writes_the_same_way(tmp_path):
    """A name holding the four characters \\x1b was quoted as the one holding ESC, and one holding \\xff as the one
    whose byte is not UTF-8: a warning could name the wrong one of two files. A backslash is doubled, as repr does."""
    escape, backslashed = "a\x1b[2J.wav", "a\\x1b[2J.wav"
    not_utf8, spelled_out = Path(os.fsdecode(b"b\xff.wav")), Path("b\\xff.wav")
    assert printable(escape) == "a\\x1b[2J.wav" and printable(backslashed) == "a\\\\x1b[2J.wav"
    assert printable(not_utf8) == "b\\xff.wav" and printable(spelled_out) == "b\\\\xff.wav"
    assert printable(Path(os.fsdecode(b"b\x80.wav"))) == "b\\x80.wav"  # the lowest byte that is not UTF-8 alone
    assert printable("c\ud800.wav") == "c\\ud800.wav"  # a lone surrogate a JSON manifest may hold
    # Each category it names: a control (NEL), format characters (U+202E, the soft hyphen), the line and paragraph
    # separators.
    assert printable("d\x85\u202e\xad\u2028\u2029.wav") == "d\\x85\\u202e\\xad\\u2028\\u2029.wav"
    assert printable(tmp_path / "plain d.wav") == str(tmp_path / "plain d.wav")


def test_a_stream_prints_each_byte_of_a_name_that_is_not_utf8_once_in_escapes_whatever_its_encoding():
    """print_paths_printable: a Cyrillic name in CP1251 is bytes UTF-8 refuses one after another, each written once.
    An ASCII stream (PYTHONIOENCODING=ascii) refuses a name's "é" in the same run as the bytes beside it: that run
    was written by backslashreplace, which named the bytes "\\udccf", as if the stream printed paths as Python holds
    them."""
    name = os.fsdecode("/d/café".encode() + b"\xcf\xf0\xe8.wav")
    for encoding, printed in [("utf-8", "/d/café\\xcf\\xf0\\xe8.wav\n".encode()),
                              ("ascii", b"/d/caf\\xe9\\xcf\\xf0\\xe8.wav\n")]:
        written = io.BytesIO()
        stream = io.TextIOWrapper(written, encoding=encoding)
        print_paths_printable(stream)
        print(name, file=stream, flush=True)
        assert written.getvalue() == printed, encoding


def test_an_empty_manifest_file_is_refused_by_its_size(tmp_path):
    """A 0-byte manifest passed trainer.check_overrides, then every rank started to find no utterance in it. A pipe's
    size is 0 whatever it holds, and blank lines are the reader's to skip: neither is refused."""
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(ValueError) as error:
        read_manifest(tmp_path / "empty.jsonl")
    assert str(error.value) == f"manifest {tmp_path / 'empty.jsonl'} is empty (0 bytes)"
    assert read_through_a_pipe(tmp_path, []) == []
    (tmp_path / "blank.jsonl").write_text("\n \n")
    assert read_manifest(tmp_path / "blank.jsonl") == []


@pytest.mark.parametrize(
    "bad_line, complaint",
    [
        ("{not json", r"not valid JSON \(Expecting property name enclosed in double quotes\)$"),
        ("[1, 2]", "expected a JSON object"),
        ('{"audio_filepath": "a.wav", "text": "A"}', "'duration'"),
        ('{"audio_filepath": "a.wav", "duration": "1.0", "text": "A"}', "'duration'"),
        ('{"audio_filepath": "a.wav", "duration": true, "text": "A"}', "'duration' must be .*, got True"),
        ('{"audio_filepath": "a.wav", "duration": 1000000.5, "text": "A"}', "'duration' must be .*, got 1000000.5"),
        ('{"audio_filepath": "a.wav", "duration": -1, "text": "A"}', "'duration'"),
        ('{"audio_filepath": "a.wav", "duration": NaN, "text": "A"}', "'duration'"),
        ('{"audio_filepath": "a.wav", "duration": Infinity, "text": "A"}', "'duration'"),
        ('{"audio_filepath": "a.wav", "duration": 1e999, "text": "A"}', "'duration'"),
        ('{"audio_filepath": "a.wav", "duration": 1' + "0" * 400 + ', "text": "A"}', "'duration'"),
        ('{"audio_filepath": "a.wav", "duration": 1e305, "text": "A"}',
         "'duration' must be .* to 1e\\+06, got 1e\\+305"),
        ('{"audio_filepath": "a.wav", "duration": 1' + "0" * 5000 + ', "text": "A"}', "not readable JSON .*digits"),
        ('{"audio_filepath": "a.wav", "duration": 1.0, "text": ' + "[" * 100_000 + "]" * 100_000 + "}",
         "nested too deeply"),
        ('{"audio_filepath": "a.wav", "duration": 1.0, "offset": 2.5, "text": "A"}', "'offset' 2.5 .* not supported"),
        ('{"audio_filepath": "a.wav", "duration": 1.0, "offset": -1.0, "text": "A"}', "'offset' -1.0 .* not supported"),
        ('{"audio_filepath": "a.wav", "duration": 1.0, "offset": false, "text": "A"}',
         "'offset' False .* not supported"),  # JSON's false is no number here, 0 though it compares
        ('{"duration": 1.0, "text": "A"}', "'audio_filepath'"),
        ('{"audio_filepath": "", "duration": 1.0, "text": "A"}', "'audio_filepath' must be a non-empty string, got ''"),
        ('{"audio_filepath": 7, "duration": 1.0, "text": "A"}', "'audio_filepath' must be a non-empty string, got 7"),
        ('{"audio_filepath": "a.wav", "duration": 1.0, "text": 7}', "'text'"),
        # A line without a field says so and shows the keys it has (another toolkit's "transcript"), where it was
        # told its text was None; a field given as null is still a value of the wrong type.
        ('{"audio_filepath": "a.wav", "duration": 1.0}',
         r"no 'text' field \(the line's keys: 'audio_filepath', 'duration'\)$"),
        ('{"audio_filepath": "a.wav", "duration": 1.0, "transcript": "A"}',
         r"no 'text' field \(the line's keys: 'audio_filepath', 'duration', 'transcript'\)$"),
        ('{"path": "a.wav", "duration": 1.0, "text": "A"}', r"no 'audio_filepath' field \(the line's keys: 'path', "),
        ('{"audio_filepath": "a.wav", "text": "A"}', r"no 'duration' field"),
        ("{}", r"no 'audio_filepath' field \(the line's keys: none\)$"),
        ('{"\\u001b[2J": 1}', r"no 'audio_filepath' field \(the line's keys: '\\x1b\[2J'\)$"),
        ("{" + ", ".join(f'"k{i}": {i}' for i in range(10)) + "}", r"keys: 'k0', .*, 'k7' and 2 more\)$"),
        ("{" + ", ".join(f'"k{i}": {i}' for i in range(8)) + "}", r"keys: 'k0', .*, 'k7'\)$"),  # not "and 0 more"
        ('{"audio_filepath": "a.wav", "duration": 1.0, "text": null}', "'text' must be a string, got None$"),
        ('{"audio_filepath": "a.wav", "duration": 1.0, "text": "A", "speaker": true}', "'speaker' must be a string or"),
        ('{"audio_filepath": "a.wav", "duration": 1.0, "text": "A", "speaker": [1]}', "'speaker' must be a string or"),
        # A speaker 1.0 would be another speaker than the 1 that names it elsewhere ("1.0", "1").
        ('{"audio_filepath": "a.wav", "duration": 1.0, "text": "A", "speaker": 1.0}', "'speaker' .*, got 1.0$"),
        ('{"audio_filepath": "a\\ud800.wav", "duration": 1.0, "text": "A"}', "'audio_filepath' holds '.ud800', half"),
        ('{"audio_filepath": "a.wav", "duration": 1.0, "text": "A\\udfff"}', "'text' holds '.udfff', half"),
        ('{"audio_filepath": "a.wav", "duration": 1.0, "text": "A", "speaker": "s\\udc80"}',
         "'speaker' holds '.udc80', half"),
        # Printed as they are, they broke the lines naming the file: a forged log line, a terminal's escape sequence,
        # a row of trainer.evaluate --out's table split in two or given a sixth column.
        ('{"audio_filepath": "a\\n[trainer][ERROR] - b.wav", "duration": 1.0, "text": "A"}',
         r"'audio_filepath' holds the control character '\\n' \(U\+000A\), which would break or reorder the lines "
         r"naming the file \(rename it\)$"),
        ('{"audio_filepath": "\\u001b[2J.wav", "duration": 1.0, "text": "A"}', r"control character '\\x1b'"),
        ('{"audio_filepath": "a\\tb.wav", "duration": 1.0, "text": "A"}', r"control character '\\t'"),
        ('{"audio_filepath": "a\\u0085b.wav", "duration": 1.0, "text": "A"}', r"control character '\\x85' \(U\+0085\)"),
        # Unicode's line and paragraph separators end a line as a newline does for an editor or a log viewer, and a
        # bidirectional control prints the rest of the line reordered (after U+202E, backwards).
        ('{"audio_filepath": "a\\u2028b.wav", "duration": 1.0, "text": "A"}', r"'\\u2028' \(U\+2028\)"),
        ('{"audio_filepath": "a\\u2029b.wav", "duration": 1.0, "text": "A"}', r"'\\u2029' \(U\+2029\)"),
        ('{"audio_filepath": "a\\u202eb.wav", "duration": 1.0, "text": "A"}', r"'\\u202e' \(U\+202E\)"),
        ('{"audio_filepath": "a\\u2066b.wav", "duration": 1.0, "text": "A"}', r"'\\u2066' \(U\+2066\)"),
        ('{"audio_filepath": "a\\u200fb.wav", "duration": 1.0, "text": "A"}', r"'\\u200f' \(U\+200F\)"),
    ],
)
def test_malformed_line_names_file_and_line_number(tmp_path, bad_line, complaint):
    path = tmp_path / "m.jsonl"
    good = json.dumps({"audio_filepath": "a.wav", "duration": 1.0, "text": "A"})
    path.write_text(f"{good}\n{bad_line}\n")
    with pytest.raises(ValueError, match=f"m.jsonl:2: .*{complaint}"):
        read_manifest(path)


def test_each_bidirectional_control_in_an_audio_path_is_refused(tmp_path):
    """Unicode's twelve Bidi_Control characters, by name: one left out of BIDI_CONTROLS printed the rest of a log line
    reordered."""
    names = ["ARABIC LETTER MARK", "LEFT-TO-RIGHT MARK", "RIGHT-TO-LEFT MARK", "LEFT-TO-RIGHT EMBEDDING",
             "RIGHT-TO-LEFT EMBEDDING", "POP DIRECTIONAL FORMATTING", "LEFT-TO-RIGHT OVERRIDE",
             "RIGHT-TO-LEFT OVERRIDE", "LEFT-TO-RIGHT ISOLATE", "RIGHT-TO-LEFT ISOLATE", "FIRST STRONG ISOLATE",
             "POP DIRECTIONAL ISOLATE"]
    path = tmp_path / "m.jsonl"
    for control in map(unicodedata.lookup, names):
        path.write_text(json.dumps({"audio_filepath": f"a{control}b.wav", "duration": 1.0, "text": "A"}) + "\n")
        with pytest.raises(ValueError, match=r"m.jsonl:1: 'audio_filepath' holds the control character .* "
                           rf"\(U\+{ord(control):04X}\)"):
            read_manifest(path)


def test_durations_at_the_ends_of_their_range_are_read_as_seconds(tmp_path):
    # 0 s is taken (the dataset skips and counts such an utterance, naming why); so is MAX_DURATION itself.
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"audio_filepath": "a.wav", "duration": duration, "text": "A"}) + "\n"
                            for duration in (0, 1000000)))
    durations = [utterance.duration for utterance in read_manifest(path)]
    assert durations == [0.0, 1e6] and all(type(duration) is float for duration in durations)


def test_a_line_that_is_not_utf8_is_named_and_a_byte_order_mark_is_skipped(tmp_path):
    good = json.dumps({"audio_filepath": "a.wav", "duration": 1.0, "text": "A"}).encode()
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + good.replace(b'"A"', b'"CAF\xc9"') + b"\n")  # Latin-1 E acute
    with pytest.raises(ValueError, match=r"m.jsonl:2: not UTF-8 \(byte 57 of the line: invalid continuation byte\)$"):
        read_manifest(path)
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + good + b"\n")
    assert [utterance.text for utterance in read_manifest(path)] == ["A", "A"]
    # Before a later line only where files were joined (`cat a.jsonl b.jsonl`): no longer a byte-order mark there, but
    # a character before the line's JSON.
    path.write_bytes(good + b"\n" + b"\xef\xbb\xbf" + good + b"\n")
    with pytest.raises(ValueError, match=r"m.jsonl:2: not valid JSON \(Unexpected UTF-8 BOM"):
        read_manifest(path)
