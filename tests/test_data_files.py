"""Writing a file whole or not at all (data.files), which every writer of the project does through it."""
import errno
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from data import files


def test_the_file_is_written_whole_and_nothing_is_left_beside_it(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("earlier\n")
    files.write_whole(target, lambda file: file.write(b"new\n"))
    assert target.read_bytes() == b"new\n" and [path.name for path in tmp_path.iterdir()] == ["out.json"]


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_write_failing_part_way_leaves_the_earlier_file_whole_and_no_temporary(tmp_path, failure):
    target = tmp_path / "m.jsonl"
    target.write_text("earlier\n")

    def write_half(file):
        file.write(b"half a li")
        raise failure
    with pytest.raises(type(failure)) as raised:
        files.write_whole(target, write_half)
    assert target.read_text() == "earlier\n" and [path.name for path in tmp_path.iterdir()] == ["m.jsonl"]
    if isinstance(failure, OSError):  # a failed write() names no file
        assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(target))


def test_the_new_file_is_on_disk_before_it_is_renamed_over_the_target(tmp_path, monkeypatch):
    """Without it, a power loss after the rename can leave the target empty on file systems that delay writes. What
    is synced is the whole text: Python's buffer, not flushed first, reached the file only as it closed, unsynced."""
    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"),
                                                                os.fstat(fd).st_size)), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda source, target: (events.append(("replace", str(source))),
                                                               real_replace(source, target)))
    files.replace_whole(tmp_path / "config.yaml", "seed: 1\n")
    assert [event[0] for event in events] == ["fsync", "replace"] and events[0][1] == events[1][1], events
    assert events[0][2] == len("seed: 1\n"), events


def test_a_full_disk_leaves_the_earlier_file_whole_and_the_error_names_it(tmp_path):
    """A full disk, played by a file size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write fails)."""
    target = tmp_path / "out.json"
    target.write_text("earlier\n")
    script = (
        "import resource\n"
        "from pathlib import Path\n"
        "from data.files import replace_whole\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        f"replace_whole(Path({str(target)!r}), 'x' * 100_000)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.stderr.rstrip().endswith(f"OSError: [Errno {errno.EFBIG}] File too large: '{target}'"), result.stderr
    assert target.read_text() == "earlier\n" and [path.name for path in tmp_path.iterdir()] == ["out.json"]


def test_an_os_error_a_program_words_itself_is_left_as_it_is(tmp_path):
    """Only a system call's error (one with an errno) is named with the file: one without would read
    '[Errno None] None: FILE', its own words lost."""
    def refuse(file):
        raise OSError("the events writer stopped")
    with pytest.raises(OSError) as raised:
        files.write_whole(tmp_path / "events", refuse)
    assert str(raised.value) == "the events writer stopped" and list(tmp_path.iterdir()) == []


def test_two_writers_with_one_process_id_each_write_a_file_of_their_own(tmp_path, monkeypatch):
    """Ranks on two hosts (or in two containers) writing to one shared file system can have the same process id."""
    monkeypatch.setattr(os, "getpid", lambda: 7)
    target = tmp_path / "m.jsonl"

    def write_while_another_writes(file):
        file.write(b"first\n")
        files.replace_whole(target, "second\n")
    files.write_whole(target, write_while_another_writes)
    assert target.read_text() == "first\n" and [path.name for path in tmp_path.iterdir()] == ["m.jsonl"]


def test_a_link_at_the_temporary_name_is_not_written_through(tmp_path, monkeypatch):
    """Opened to be created ("x"), never one a crash left or someone linked: opened to be written ("w"), the link's
    target got the new text and the target became the link."""
    monkeypatch.setattr(os, "getpid", lambda: 7)
    monkeypatch.setattr(files.secrets, "token_hex", lambda size: "cafe")
    target, elsewhere = tmp_path / "m.jsonl", tmp_path / "elsewhere.txt"
    target.write_text("earlier\n")
    elsewhere.write_text("kept\n")
    (tmp_path / ".m.jsonl.7-cafe.tmp").symlink_to(elsewhere)
    with pytest.raises(FileExistsError):
        files.replace_whole(target, "new\n")
    assert (target.read_text(), elsewhere.read_text()) == ("earlier\n", "kept\n") and not target.is_symlink()


def test_leftovers_of_a_killed_writer_are_removed_and_nothing_else(tmp_path):
    target = tmp_path / "last.pt"
    leftover = files.temporary_beside(target)
    leftover.write_bytes(b"part of a checkpoint")
    for kept in ("last.pt", ".best.pt.1-ab.tmp", ".last.pt.tmp.keep", ".last.pt2.1-ab.tmp", "notes.txt"):
        (tmp_path / kept).write_text("")
    files.remove_leftover_temporaries(target)
    assert sorted(path.name for path in tmp_path.iterdir()) == [".best.pt.1-ab.tmp", ".last.pt.tmp.keep",
                                                               ".last.pt2.1-ab.tmp", "last.pt", "notes.txt"]
    bracketed = tmp_path / "step[1].pt"  # brackets that a glob pattern would take for a set of characters
    files.temporary_beside(bracketed).write_bytes(b"part of a checkpoint")
    files.remove_leftover_temporaries(bracketed)
    assert not any(path.name.startswith(".step[1].pt.") for path in tmp_path.iterdir())


def test_the_space_left_is_said_where_the_file_system_says_it_and_left_out_where_the_folder_is_gone(tmp_path):
    """The checkpoint's and the run records' full-disk lines both take it from here: one wording of the space left."""
    said = files.space_left(tmp_path, "on its file system")
    assert said.startswith("; ") and said.endswith(" MiB free on its file system"), said
    # In MiB as it says (other writers may change the free space a little meanwhile).
    assert float(said.split()[1]) == pytest.approx(shutil.disk_usage(tmp_path).free / 2**20, rel=0.01, abs=64), said
    assert files.space_left(tmp_path / "removed", f"in {tmp_path / 'removed'}") == ""
