"""Turn a speech corpus into JSONL manifests (see data.manifest) with absolute audio paths.

    python -m data.prepare an4 --source DIR --out DIR          # writes an4_train.jsonl and an4_test.jsonl
    python -m data.prepare librispeech --source DIR --out DIR [--name NAME]   # writes NAME.jsonl

AN4 layout (CMU Sphinx): etc/an4_{train,test}.fileids and .transcription, line N of one matching line N of
the other, audio at wav/<fileid>.flac, .wav or .sph. LibriSpeech layout: any tree of SPEAKER/CHAPTER folders,
linked ones too, each with SPEAKER-CHAPTER.trans.txt of `ID TEXT` lines and ID.flac beside it; a folder that cannot be
listed, or a link to nothing, is skipped with a warning naming it.

Utterances whose audio is missing, whose header cannot be read, or whose path is not UTF-8 (a manifest is UTF-8) or
holds a control character are skipped and counted, the first 5 of each reason named in a warning, every one listed in
NAME.skipped.jsonl beside the manifest (audio that is damaged past its header is found when training reads it). An
utterance with an empty transcript is written as it is: the dataset leaves it out, names it and counts it. A split
left with no utterance is an error naming its fileids or source folder and how many were skipped and why; its manifest
is not written, an earlier one left as it was.
"""
if __name__ == "__main__":  # first: the imports below take seconds (torch), in which a signal printed a
    # traceback (Ctrl-C) or ended the tool without a word (SIGTERM)
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()

import argparse
import logging
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

from data.audio import AudioError, audio_header
from data.cli import (PROGRESS_LINE_S, Terminated, input_path, shows_a_progress_bar, signals_raise,
                      stdout_failures_end_the_tool, stopped_line)
from data.dataset import SkipWarnings, count_reasons
from data.files import came_of_writing, write_error_line
from data.manifest import (Utterance, control_character, print_paths_printable, printable, read_manifest,
                           write_manifest)
from data.text import counted, normalize_text

logger = logging.getLogger(__name__)

AN4_SPLITS = ("train", "test")
AN4_AUDIO_SUFFIXES = (".flac", ".wav", ".sph")

# "<s> YES </s> (an251-fash-b)" in train, "RUBOUT G M E F THREE NINE (an406-fcaw-b)" in test.
_AN4_LINE = re.compile(r"^\s*(?:<s>)?(?P<text>.*?)(?:</s>)?\s*\((?P<id>[^()]+)\)\s*$")


def prepare_an4(source: str | Path, out: str | Path) -> dict[str, Path]:
    """Write an4_train.jsonl and an4_test.jsonl into `out`, unless they are already newer than their sources.

    Returns: {"train": path, "test": path}.
    Raises: FileNotFoundError naming a missing folder or file; ValueError naming the file and line of a
    transcription that does not match its fileids, naming a source whose path is not UTF-8, or naming the fileids of
    a split with no usable utterance (see _write).
    """
    source, out = an4_source_folder(source), Path(out)
    manifests = {}
    for split in AN4_SPLITS:
        fileids = _require(source / "etc" / f"an4_{split}.fileids")
        transcription = _require(source / "etc" / f"an4_{split}.transcription")
        manifest = manifests[split] = an4_manifest(out, split)
        if _an4_manifest_current(manifest, source, fileids, transcription):
            logger.info("%s is up to date", manifest)
            continue
        skip_warnings = _skip_warnings(manifest)
        utterances = _an4_utterances(source, fileids, transcription, skip_warnings)
        _write(f"an4 {split}", str(fileids), manifest, utterances, skip_warnings)
    return manifests


def an4_manifest(out: str | Path, split: str) -> Path:
    """The manifest prepare_an4 writes in `out` for `split` (one of AN4_SPLITS)."""
    return Path(out) / f"an4_{split}.jsonl"


def an4_source_folder(source: str | Path) -> Path:
    """AN4's folder, resolved; FileNotFoundError where it is missing, no folder or holds no etc/, ValueError where its
    path is not UTF-8. Its files unread: trainer.check_overrides asks it before a job starts."""
    source = _require_utf8(_require(Path(source).resolve(), folder=True))
    if not (source / "etc").is_dir():  # a folder above AN4's (the one its tarball unpacked into), most often
        raise FileNotFoundError(f"{source} holds no etc/ folder: AN4's source is the folder holding its etc/ and wav/")
    return source


def prepare_librispeech(source: str | Path, out: str | Path, name: str | None = None) -> Path:
    """Write NAME.jsonl (NAME defaults to the source folder's name, e.g. dev-clean) from every *.trans.txt.

    Raises: FileNotFoundError naming the source when it is missing or holds no *.trans.txt file; ValueError naming
    it when its path is not UTF-8 or its transcripts list no usable utterance (see _write).
    """
    source = _require_utf8(_require(Path(source).resolve(), folder=True))
    transcripts = _librispeech_transcripts(source)
    if not transcripts:
        raise FileNotFoundError(f"no *.trans.txt transcript files under {source}")
    manifest = Path(out) / f"{(name or source.name).removesuffix('.jsonl')}.jsonl"
    utterances, skip_warnings = [], _skip_warnings(manifest)
    # Every utterance's audio header is read: LibriSpeech's 960 hours are 281k files, minutes of work.
    logger.info("reading the %s under %s", counted(len(transcripts), "chapter"), source)
    on_terminal = shows_a_progress_bar(sys.stderr)
    last_line = time.perf_counter()
    for number, transcript in enumerate(tqdm(transcripts, desc=source.name, unit=" chapters", disable=not on_terminal)):
        if not on_terminal and time.perf_counter() - last_line >= PROGRESS_LINE_S:  # a SLURM or nohup log
            last_line = time.perf_counter()
            logger.info("read %d of %d chapters", number, len(transcripts))
        utterances += _chapter_utterances(transcript, skip_warnings)
    _write(f"librispeech {source.name}", f"the *.trans.txt files under {source}", manifest, utterances, skip_warnings)
    return manifest


def _librispeech_transcripts(source: Path) -> list[Path]:
    """Every *.trans.txt under `source`, sorted. Linked folders are followed (a subset made of links to speakers'
    folders, which Path.rglob does not enter), each folder read once however many links lead to it. A folder that
    cannot be listed and a link to nothing (a speaker's folder on a disk not mounted) are skipped with a warning
    naming them: os.walk passed over both without a word, leaving their utterances out of the manifest."""
    transcripts, folders_read = [], set()
    for folder, subfolders, files in os.walk(source, followlinks=True, onerror=_warn_unlistable_folder):
        if os.path.realpath(folder) in folders_read:  # a second link to it, or a link up the tree
            subfolders.clear()
            continue
        folders_read.add(os.path.realpath(folder))
        subfolders.sort()  # which of two links to one folder is read: the first by name
        for name in files:
            if name.endswith(".flac"):  # a missing one is named where its utterance is skipped
                continue
            path = Path(folder) / name
            if not path.exists():  # os.walk lists a link to nothing among the files, whatever it once led to
                logger.warning("skipping %s: a symbolic link to %s, which does not exist", printable(path),
                               printable(os.readlink(path)))
            elif name.endswith(".trans.txt") and not path.is_file():
                # A corpus from elsewhere may hold a pipe or a link to a device there: read whole, a link to /dev/zero
                # took all the memory and a pipe waited for a writer for ever.
                logger.warning("skipping %s: not a file (a pipe, a device)", printable(path))
            elif name.endswith(".trans.txt"):
                transcripts.append(path)
    return sorted(transcripts)


def _warn_unlistable_folder(error: OSError) -> None:
    logger.warning("skipping %s: cannot list the folder (%s)", printable(error.filename), error.strerror)


def _chapter_utterances(transcript: Path, skip_warnings: SkipWarnings) -> list[Utterance]:
    """The utterances of one LibriSpeech chapter's SPEAKER-CHAPTER.trans.txt; those skipped told to `skip_warnings`."""
    utterances = []
    # Lines end at "\n" only: str.splitlines would also end one at U+0085 or U+2028 inside a transcript.
    for line in _read_utf8(transcript).split("\n"):
        if not line.strip():
            continue
        utterance_id, text = (line.split(maxsplit=1) + [""])[:2]  # a tab after the id separates it too
        audio_stem = transcript.parent / utterance_id
        utterance = _utterance(audio_stem, (".flac",), normalize_text(text), utterance_id.split("-")[0],
                               skip_warnings)
        if utterance is not None:
            utterances.append(utterance)
    return utterances


def _an4_manifest_current(manifest: Path, source: Path, fileids: Path, transcription: Path) -> bool:
    """Whether `manifest` is newer than its etc files and lists the audio files of this source folder that exist
    now, less those whose header still cannot be read: a corpus moved or copied elsewhere, or audio added, removed or
    mended since, builds it again."""
    if not _newer_than(manifest, [fileids, transcription]):
        return False
    try:
        listed = {utterance.audio_filepath for utterance in read_manifest(manifest)}
    except ValueError:  # not a manifest this code wrote
        return False
    stems = [source / "wav" / fileid for fileid in _read_utf8(fileids).split()]
    present = {str(audio) for stem in stems if (audio := _audio_file(stem, AN4_AUDIO_SUFFIXES)) is not None}
    return listed <= present and not any(_header_readable(Path(audio)) for audio in present - listed)


def _an4_utterances(source: Path, fileids: Path, transcription: Path, skip_warnings: SkipWarnings) -> list[Utterance]:
    """The utterances of one AN4 split; those skipped told to `skip_warnings`."""
    ids = _read_utf8(fileids).split()
    lines = [(number, line) for number, line in enumerate(_read_utf8(transcription).split("\n"), start=1)
             if line.strip()]
    if len(ids) != len(lines):
        raise ValueError(f"{fileids} has {len(ids)} ids but {transcription} has {len(lines)} transcripts")
    utterances = []
    for fileid, (line_number, line) in zip(ids, lines):
        match = _AN4_LINE.match(line)
        if match is None or match["id"] != Path(fileid).name:
            raise ValueError(f"{transcription}:{line_number}: expected 'TEXT ({printable(Path(fileid).name)})', "
                             f"got {line!r}")
        # The fileid's folder is the speaker: an4_clstk/fash/an251-fash-b -> fash.
        speaker = Path(fileid).parent.name
        utterance = _utterance(source / "wav" / fileid, AN4_AUDIO_SUFFIXES, normalize_text(match["text"]), speaker,
                               skip_warnings)
        if utterance is not None:
            utterances.append(utterance)
    return utterances


def _skip_warnings(manifest: Path) -> SkipWarnings:
    """Where the utterances left out of `manifest` are told: every one listed beside it, in NAME.skipped.jsonl."""
    return SkipWarnings(logger, Counter(), manifest.with_name(f"{manifest.stem}.skipped.jsonl"))


def _utterance(audio_stem: Path, suffixes: tuple[str, ...], text: str, speaker: str,
               skip_warnings: SkipWarnings) -> Utterance | None:
    """The utterance whose audio is `audio_stem` + the first suffix that exists, or None (told to `skip_warnings`,
    which names the file and counts it by reason) when there is no such file, its path is not UTF-8 or holds a
    control character, or its header cannot be read."""
    audio = _audio_file(audio_stem, suffixes)
    if audio is None:
        skip_warnings.warn(audio_stem, "no audio file", f"no {' / '.join(suffixes)} file")
        return None
    if not _is_utf8(audio):
        skip_warnings.warn(audio, "path not UTF-8", "its path is not UTF-8, which a manifest cannot hold (rename it)")
        return None
    if (control := control_character(str(audio))) is not None:  # the manifest's reader refuses it
        skip_warnings.warn(audio, "control character in path", f"its path holds the control character {control!r} "
                           f"(U+{ord(control):04X}), which would break or reorder the lines naming it (rename it)")
        return None
    try:
        duration = audio_header(audio).duration
    except AudioError as error:
        skip_warnings.warn(audio, "unreadable", str(error).removeprefix(f"{printable(audio)}: "))
        return None
    return Utterance(str(audio), duration, text, speaker)


def _audio_file(audio_stem: Path, suffixes: tuple[str, ...]) -> Path | None:
    """`audio_stem` + the first suffix that names a file, or None."""
    candidates = (audio_stem.with_name(audio_stem.name + suffix) for suffix in suffixes)
    return next((path for path in candidates if path.is_file()), None)


def _header_readable(audio: Path) -> bool:
    try:
        audio_header(audio)
    except AudioError:
        return False
    return True


def _read_utf8(path: Path) -> str:
    """The file's text; a byte-order mark at its start is not part of it."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        raise ValueError(f"{printable(path)}:{line}: not UTF-8 ({error.reason})") from None


def _write(label: str, listing: str, manifest: Path, utterances: list[Utterance], skip_warnings: SkipWarnings) -> None:
    """Writes `manifest`, and beside it the list of those `skip_warnings` was told of; where no utterance is left,
    ValueError naming `listing` (what lists them) and how many were skipped by reason, nothing written: a manifest of 0
    bytes only failed the next step ("manifest PATH is empty"), which cannot say why, and an earlier one stays as it
    was."""
    skipped = skip_warnings.counts
    if not utterances:
        why = f"skipped {count_reasons(skipped)}" if skipped else "none is listed there"
        raise ValueError(f"no usable utterance in {listing}: {why}")
    write_manifest(manifest, utterances)
    skip_warnings.close()
    hours = sum(utterance.duration for utterance in utterances) / 3600
    logger.info(
        "%s: wrote %s (%.2f h) to %s; skipped %d without usable audio",
        label, counted(len(utterances), "utterance"), hours, manifest, skipped.total(),
    )


def _require(path: Path, folder: bool = False) -> Path:
    wanted = "folder" if folder else "file"
    if path.is_dir() if folder else path.is_file():
        return path
    if path.exists():  # FileNotFoundError all the same: what the caller needs is not there
        raise FileNotFoundError(f"{path} is not a {wanted}")
    raise FileNotFoundError(f"{wanted} {path} does not exist")


def _require_utf8(source: Path) -> Path:
    if not _is_utf8(source):
        raise ValueError(f"{printable(source)}: the path is not UTF-8, which a manifest's audio paths must be "
                         "(rename it)")
    return source


def _is_utf8(path: Path) -> bool:
    """Whether `path` can be written into a manifest: a name of other bytes reaches Python as surrogate escapes."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _newer_than(target: Path, sources: Iterable[Path]) -> bool:
    return target.is_file() and all(target.stat().st_mtime > source.stat().st_mtime for source in sources)


def _manifest_name(text: str) -> str:
    """NAME of --name NAME, a file name in --out: an empty one (an unset shell variable) was taken for no name, the
    source folder's, and one holding a folder (/x, ../x) wrote the manifest outside --out."""
    if not text:
        raise argparse.ArgumentTypeError("an empty name (an unset shell variable?)")
    if "/" in text or text.removesuffix(".jsonl") in ("", ".", ".."):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name: NAME.jsonl is written into --out, which "
                                         "names its folder")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    corpora = parser.add_subparsers(dest="corpus", required=True)
    an4 = corpora.add_parser("an4", help="CMU AN4 (etc/ and wav/ folders)")
    librispeech = corpora.add_parser("librispeech", help="a LibriSpeech-layout tree of *.trans.txt and .flac")
    librispeech.add_argument("--name", type=_manifest_name,
                             help="manifest name, NAME.jsonl (default: the source folder's name)")
    for corpus in (an4, librispeech):
        corpus.add_argument("--source", type=input_path, required=True, help="the corpus folder")
        corpus.add_argument("--out", type=input_path, required=True, help="folder for the manifests")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    signals_raise()  # until here they end the tool at once, as during its imports: there is nothing to keep yet
    try:
        if args.corpus == "an4":
            prepare_an4(args.source, args.out)
        else:
            prepare_librispeech(args.source, args.out, args.name)
    except (OSError, ValueError) as error:  # OSError: an --out that cannot be written (a file, no permission)
        parser.exit(2, f"{parser.prog}: error: {write_error_line(error) if came_of_writing(error) else error}\n")
    except (KeyboardInterrupt, Terminated) as stopped:
        # Minutes into a large corpus: the manifest being written is left as it was.
        line, code = stopped_line(stopped)
        parser.exit(code, f"{line}\n")


if __name__ == "__main__":
    print_paths_printable(sys.stdout, sys.stderr)  # an --out that is not UTF-8 named as its skipped audio is
    with stdout_failures_end_the_tool():
        main(sys.argv[1:])
