"""Writing a file whole or not at all, the one way every writer of the project does it (manifests, checkpoints, a run's
config.yaml and metrics.jsonl, the tools' and benchmarks' outputs), or into a stream where a tool's output file is one
(write_out: /dev/stdout, a pipe), and the user's words for a write that failed (a full disk among them: FULL_DISK,
space_left, file_size_limit): here in data, which imports no other part of the project, so that data.manifest and the
dataset's skip lists can use it too."""
import contextlib
import errno
import glob
import os
import resource
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_whole(target: Path, write_into: Callable[[BinaryIO], object]) -> None:
    """`write_into(file)` fills a new file beside `target`, which is put on disk and then renamed over it: a job killed,
    a disk filling up or the machine losing power meanwhile leaves `target` as it was, never cut short or empty. The
    new file is removed on any failure, a Ctrl-C included. An OSError names `target`, where a failed write() names no
    file."""
    temporary = temporary_beside(target)
    with errors_naming(target):
        try:
            # "x": a file of its own, never one of that name a crash left (or linked)
            with open(temporary, "xb") as file:
                write_into(file)
                file.flush()
                # Before the rename: file systems that delay writing (ext4, XFS) may put the rename on disk first, which
                # a power loss turns into an empty file at `target`; and a full disk may refuse only the delayed write.
                os.fsync(file.fileno())
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):  # a part-written file would keep the space a full disk lacks
                temporary.unlink(missing_ok=True)
            raise


@contextlib.contextmanager
def errors_naming(target: Path | str):
    """An OSError of a system call inside names `target`, and says it came of writing it (`written`): a failed write(),
    flush() or fsync() names no file, and the user's line (a full disk, a quota, ulimit -f) said 'cannot write: File too
    large' with no word of which."""
    try:
        yield
    except OSError as error:
        if error.errno is None:  # one a program words itself, not a system call's
            raise
        named = OSError(error.errno, error.strerror, str(target))
        named.written = True  # for the user's line: 'cannot write' the file, where a read's error says 'cannot open'
        raise named from error


def came_of_writing(error: OSError) -> bool:
    """Whether errors_naming named `error`: one of writing its file, not of reading one."""
    return getattr(error, "written", False)


def write_error_line(error: OSError) -> str:
    """The user's words for an error of writing: 'cannot write FILE: its reason', where Python's own give the errno's
    number and the file's repr."""
    written = f" {error.filename}" if error.filename else ""  # a failed write() of a stream names no file
    return f"cannot write{written}: {error.strerror}"


FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, a quota, a file size limit (ulimit -f)


def space_left(folder: Path, where: str) -> str:
    """'; N MiB free WHERE': the space left on `folder`'s file system, for the line of a write it may have refused for
    want of it; '' where the file system cannot say either."""
    try:
        return f"; {shutil.disk_usage(folder).free / 2**20:.1f} MiB free {where}"
    except OSError:
        return ""


def file_size_limit() -> str:
    """', and this process may write files of at most N bytes (ulimit -f)' where it has such a limit, else '': it fails
    a write on a disk with space, which a message giving the space left alone leaves unexplained."""
    size_limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if size_limit == resource.RLIM_INFINITY:
        return ""
    return f", and this process may write files of at most {size_limit:,} bytes (ulimit -f)"


def replace_whole(target: Path, text: str) -> None:
    """write_whole for text; a file name in `text` that is not UTF-8 (b"\\xff.wav", which Python holds as "\\udcff.wav")
    is written as its own bytes."""
    write_whole(target, lambda file: file.write(text.encode("utf-8", errors="surrogateescape")))


def write_out(path: str | Path, data: bytes) -> None:
    """`data` into `path`, the way a tool writes its output file: through this process's own stdout or stderr where
    `path` is the file it writes to, straight into a pipe or terminal (one renamed over or removed, its reader waited
    for ever and /dev/stdout was gone), else whole or not at all (write_whole; a link's target, not the link,
    replaced). An OSError names `path`; a BrokenPipeError is let through."""
    own_stream = standard_stream_writing_to(path)
    with errors_naming(path):
        if own_stream is not None:
            own_stream.flush()  # the tool's own lines before, in order
            own_stream.buffer.write(data)
            own_stream.buffer.flush()
        elif is_stream(path):
            with open(path, "wb") as stream:
                stream.write(data)
        else:
            write_whole(Path(path).resolve(), lambda file: file.write(data))


def is_stream(path: str | Path) -> bool:
    """Whether write_out writes into `path` as it is, with no going back: a pipe, a terminal, or this process's own
    stdout or stderr, not a file it can replace."""
    return standard_stream_writing_to(path) is not None or (Path(path).exists() and not Path(path).is_file())


def standard_stream_writing_to(path: str | Path):
    """sys.stdout or sys.stderr where `path` is the file it writes to (/dev/stdout under a shell's `> file` or
    `>> file`), else None. Such a file is written through the stream, at its position: renamed over, it lost what
    `>>` had appended to and the tool's lines after it; opened again, the stream's own lines wrote over it."""
    try:
        target = os.stat(path)
    except OSError:
        return None
    for stream in (stream for stream in (sys.stdout, sys.stderr) if stream is not None):  # None: closed as started
        try:
            if os.path.samestat(target, os.fstat(stream.fileno())):
                return stream
        except (OSError, ValueError):  # a stream without a file descriptor (io.UnsupportedOperation), or closed
            continue
    return None


def temporary_beside(target: Path) -> Path:
    """A name beside `target` that no other writer of it takes at the same time: the process id alone is shared by
    processes on two hosts writing to one shared file system (ranks in containers often have the same one)."""
    return target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def remove_leftover_temporaries(target: Path) -> None:
    """Removes the files that writers of `target` killed mid-write (SIGKILL, out of memory) left beside it. Only for a
    caller that knows no other process writes `target` now: the job holding a run directory, for its checkpoints."""
    for leftover in target.parent.glob(f".{glob.escape(target.name)}.*-*.tmp"):
        leftover.unlink(missing_ok=True)
