"""JSONL manifests: one utterance a line, {"audio_filepath", "duration", "text", "speaker"}.

The format is NeMo's, so manifests written elsewhere load too; there `speaker` may be absent. NeMo's `offset` (a
segment of a longer file) is refused rather than ignored: the whole file would be read under the segment's transcript.

Here too is what the readers of manifests and their audio paths share: numbered_lines, which reads lines of a bounded
length (trainer.lm's text too); file_identity, which tells two names of one file from two files; control_character,
which finds what a path printed on a line may not hold; printable, which writes a path or transcript read from a file
for a message, and print_paths_printable, which has a stream print a path that is not UTF-8 in escapes.
"""
import codecs
import json
import os
import unicodedata
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO

from data.files import write_whole
from data.values import is_int, is_real

# Seconds; a larger duration is a mistake (a day is 86400 s), and past about 1e304 it overflows a sample count.
MAX_DURATION = 1e6
# Bytes; far past any line of a manifest (an hour's transcript is some 50 kB) or of a language model.
MAX_LINE_BYTES = 2**20
# Of a line that lacks a required field, the keys named in the error: a line of a manifest holds five or so.
MAX_KEYS_NAMED = 8
# Unicode's Bidi_Control characters: printed, they reorder the text after them on the line (U+202E writes it backwards).
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


@dataclass(frozen=True)
class Utterance:
    audio_filepath: str  # absolute once read
    duration: float  # seconds
    text: str
    speaker: str


def read_manifest(path: str | os.PathLike, audio_needed: bool = True) -> list[Utterance]:
    """Read a JSONL manifest; relative audio paths are taken relative to the manifest's folder.

    `audio_needed=False` (transcripts alone are wanted) takes a pipe's relative audio paths too, relative to its
    folder as a file's are (/dev/fd for `<(...)`, which holds none of them).

    Raises FileNotFoundError when `path` does not exist, ValueError naming it where check_manifest_path refuses it
    (a folder, an empty file), and ValueError naming the file and line number for a line that is not UTF-8 or longer
    than MAX_LINE_BYTES, or not a JSON object with a string `audio_filepath` (no control character in it, and
    absolute where `path` is a pipe and `audio_needed`) and `text`, a `duration` from 0 to MAX_DURATION, a `speaker`
    (where given) that is a string or an integer, no half of a UTF-16 surrogate pair in those strings, and no `offset`
    other than 0. A byte-order mark before the first line is skipped.
    """
    path = Path(path)
    check_manifest_path(path)
    # A pipe's folder (/dev/fd for <(...)) holds no audio: relative paths would each be "no such audio file" there.
    audio_folder = path.parent.absolute() if path.is_file() or not audio_needed else None
    utterances = []
    with path.open("rb") as lines:
        for line_number, raw in numbered_lines(lines, path):
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not UTF-8 (byte {error.start} of the line: "
                                 f"{error.reason})") from None
            if line.strip():
                utterances.append(_parse_line(line, path, line_number, audio_folder))
    return utterances


def check_manifest_path(path: Path) -> None:
    """FileNotFoundError or ValueError naming a manifest path that read_manifest cannot read: nothing there, a folder,
    a file this process may not open, or an empty file. Its lines unread: trainer.check_overrides asks it of every
    manifest before a job starts, a large corpus's too."""
    if path.is_dir():
        raise ValueError(f"manifest {path} is a folder, not a file")
    if not path.exists():  # not is_file(): a pipe (evaluate --manifest <(...)) reads as well
        raise FileNotFoundError(f"manifest {path} does not exist")
    if path.is_file():  # only a file: opening a pipe would wait for a writer, and take what it writes
        try:
            path.open("rb").close()
        except OSError as error:  # no permission (to the file or a folder on its way)
            raise ValueError(f"cannot open manifest {path}: {error.strerror or error}") from None
        # A step that wrote nothing there (a filter that matched no line, a copy to a full disk): the run started
        # every rank to find it held no utterance. A pipe's size is 0 whatever it holds.
        if path.stat().st_size == 0:
            raise ValueError(f"manifest {path} is empty (0 bytes)")


def numbered_lines(file: BinaryIO, path: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
    """The lines of a binary file with their numbers, from 1; ValueError naming the file and line where one is longer
    than MAX_LINE_BYTES: a file without line breaks (a disk image, /dev/zero) would be read whole, until the memory
    ran out."""
    for line_number, raw in enumerate(iter(partial(file.readline, MAX_LINE_BYTES + 1), b""), start=1):
        if len(raw) > MAX_LINE_BYTES:
            raise ValueError(f"{path}:{line_number}: a line longer than {MAX_LINE_BYTES:,} bytes: not a text file")
        yield line_number, raw


def _parse_line(line: str, path: Path, line_number: int, audio_folder: Path | None) -> Utterance:
    where = f"{path}:{line_number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
    except ValueError as error:  # a number Python will not read (an integer of more than 4300 digits)
        raise ValueError(f"{where}: not readable JSON ({error})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply to read") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    _check_fields_present(record, where)
    audio_filepath, duration, text = record.get("audio_filepath"), record.get("duration"), record.get("text")
    if not isinstance(audio_filepath, str) or not audio_filepath:
        raise ValueError(f"{where}: 'audio_filepath' must be a non-empty string, got {audio_filepath!r}")
    if not (is_real(duration) and 0 <= duration <= MAX_DURATION):
        raise ValueError(f"{where}: 'duration' must be a number of seconds from 0 to {MAX_DURATION:g}, "
                         f"got {duration!r}")
    offset = record.get("offset")
    if offset is not None and not (is_real(offset) and offset == 0):
        raise ValueError(f"{where}: 'offset' {offset!r} (a segment of a longer file) is not supported; "
                         "cut the segment into a file of its own")
    if not isinstance(text, str):
        raise ValueError(f"{where}: 'text' must be a string, got {text!r}")
    speaker = _speaker(record, where)
    for key, value in (("audio_filepath", audio_filepath), ("text", text), ("speaker", speaker)):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:  # JSON's \ud800 escapes decode to lone surrogates
            raise ValueError(f"{where}: {key!r} holds {value[error.start]!r}, half of a UTF-16 surrogate pair, "
                             "which is no character") from None
    if (control := control_character(audio_filepath)) is not None:
        raise ValueError(f"{where}: 'audio_filepath' holds the control character {control!r} (U+{ord(control):04X}), "
                         "which would break or reorder the lines naming the file (rename it)")
    if audio_folder is None and not os.path.isabs(audio_filepath):
        raise ValueError(f"{where}: 'audio_filepath' {audio_filepath!r} is relative, and a manifest read from a pipe "
                         "has no folder to take it from: give absolute paths, or the manifest as a file")
    audio_path = Path(audio_filepath) if audio_folder is None else audio_folder / audio_filepath
    return Utterance(str(audio_path), float(duration), text, speaker)


def _check_fields_present(record: dict, where: str) -> None:
    """ValueError naming the first required field the line lacks and the keys it has: a manifest from another toolkit
    (`"transcript"`, `"path"`) was told its text was None, as if the line held `"text": null`."""
    missing = next((key for key in ("audio_filepath", "duration", "text") if key not in record), None)
    if missing is not None:
        keys = ", ".join(repr(key) for key in list(record)[:MAX_KEYS_NAMED])
        more = f" and {len(record) - MAX_KEYS_NAMED:,} more" if len(record) > MAX_KEYS_NAMED else ""
        raise ValueError(f"{where}: no {missing!r} field (the line's keys: {keys or 'none'}{more})")


def _speaker(record: dict, where: str) -> str:
    """The record's speaker as a string; NeMo-style manifests may leave it out or null, or number their speakers."""
    speaker = record.get("speaker")
    if speaker is None:
        return ""
    if is_int(speaker):
        return str(speaker)
    if not isinstance(speaker, str):
        raise ValueError(f"{where}: 'speaker' must be a string or an integer, got {speaker!r}")
    return speaker


def file_identity(path: str) -> tuple[int, int] | str:
    """What tells one audio file from another however a manifest names it: its device and inode, as
    os.path.samefile compares them (the same for a symbolic or hard link to it, or a path through `..`). A file that
    cannot be examined (missing: reading it names it) goes by its path with `..` folded."""
    try:
        status = os.stat(path)
    except OSError:
        return os.path.normpath(path)
    return status.st_dev, status.st_ino


def control_character(text: str) -> str | None:
    """The first control character of `text` (a newline, a tab, a terminal's escape, Unicode's line and paragraph
    separators, a bidirectional control), or None. Logs, the console and trainer.evaluate's table print audio paths as
    they are: one holding such a character would forge a log line, send the terminal an escape sequence, split a row
    or show the rest of its line reordered."""
    return next((char for char in text if unicodedata.category(char) in ("Cc", "Zl", "Zp") or char in BIDI_CONTROLS),
                None)


# Unicode's categories of what a message must not print as it is: control characters (ESC, CR, backspace, NUL, U+0085),
# format characters (the bidirectional controls, zero-width ones, the soft hyphen), lone surrogates and the line and
# paragraph separators.
_NOT_PRINTABLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def printable(text: str | os.PathLike) -> str:
    """`text`, a path or transcript read from a file (a manifest, a corpus's listing, a folder), as a message or log
    line may quote it: what it does not print as itself in escapes, as Python's repr writes them without its quotes
    ("\\x1b", "\\r", "\\u202e"), and a path's bytes that are not UTF-8 as "\\xff". Printed raw, one such character
    cleared the screen, wrote over the line the user reads, or named another file than the one skipped. A backslash is
    doubled, as repr doubles it: a name holding the four characters "\\x1b" is not the one holding ESC."""
    return "".join(_escape(char) if char == "\\" or unicodedata.category(char) in _NOT_PRINTABLE else char
                   for char in os.fspath(text))


def _escape(char: str) -> str:
    if "\udc80" <= char <= "\udcff":  # a byte of a name that is not UTF-8, as os.fsdecode holds b"\xff"
        return f"\\x{ord(char) - 0xdc00:02x}"
    return repr(char)[1:-1]


def _escape_as_printable_path(error: UnicodeError) -> tuple[str, int]:
    """A codec error handler: the bytes of a path that are not UTF-8 (which Python holds as surrogate escapes,
    "\\udcff") as printable writes them; other text it cannot encode as backslashreplace writes it."""
    if isinstance(error, UnicodeEncodeError):
        # printable's escapes for the bytes, then backslashreplace's for what is left: an ASCII stream refuses a
        # name's "é" in one run with the bytes beside it.
        escaped = printable(error.object[error.start : error.end])
        return escaped.encode("ascii", "backslashreplace").decode("ascii"), error.end
    return codecs.backslashreplace_errors(error)


codecs.register_error("printable_path", _escape_as_printable_path)


def print_paths_printable(*streams) -> None:
    """Has `streams` (a tool's stdout and stderr) print a path that is not UTF-8 as printable writes it: stderr's
    own "\\udcff" for b"\\xff" named no byte, and stdout's strict UTF-8 (en_US.UTF-8) ended the tool in a traceback.
    A stream the tool started without (`>&-`), which Python gives as None and print() skips, is left so."""
    for stream in streams:
        if stream is not None:
            stream.reconfigure(errors="printable_path")


def write_manifest(path: str | os.PathLike, utterances: list[Utterance]) -> None:
    """Write `utterances` as JSONL, creating the folder.

    The file appears complete or not at all (data.files.write_whole), so an interrupted run never leaves a
    truncated manifest that looks newer than its sources, and ranks preparing at once don't collide.
    """
    path = Path(path)
    # The nearest folder on the way that exists (a link to nothing does not: mkdir names it below). A file there, not
    # only as the manifest's own folder, ended in mkdir's "[Errno 20] Not a directory" naming another path.
    nearest = next(folder for folder in path.parents if folder.exists())
    if not nearest.is_dir():
        raise ValueError(f"{nearest} is a file, not a folder to write the manifest {path.relative_to(nearest)} into")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as error:  # a symbolic link to nothing on the way (a scratch disk not mounted)
        link = Path(error.filename)
        if not link.is_symlink():
            raise
        raise ValueError(f"{link} is a symbolic link to {os.readlink(link)}, which does not exist: cannot write the "
                         f"manifest {path.name} there") from None
    write_whole(path, lambda out: out.writelines(
        (json.dumps(asdict(utterance), ensure_ascii=False) + "\n").encode("utf-8") for utterance in utterances))
