"""A run's directory and what a run records there: its lock, links to nothing, run names and sweep job folders,
jobs.jsonl, metrics.jsonl and TensorBoard events on a full disk, and which errors are one line."""
import contextlib
import errno
import json
import logging
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO_ROOT, without_root_privilege
from trainer import run_directory
import trainer.__main__ as trainer_main
from trainer.__main__ import user_error_message
from trainer.distributed import DistEnv
from trainer.environment import command_line, device_name, source_commit, versions
from trainer.records import record_job
from trainer.resume import recorded_run_id
from trainer.run_directory import LONG_VALUE, MAX_FOLDER_NAME, hold_run_directory, job_folder


def test_a_run_directory_is_free_once_its_job_is_killed_though_its_children_live_on(tmp_path):
    """Data-loading workers are forked with the lock's file open: an flock, which they shared, stayed held until they
    noticed their parent had died, and a job restarted at once was refused, naming a dead process. The refusal names
    the job that holds it alone, not those before it (with the lock's file left uncleared, every test passed)."""
    with hold_run_directory(tmp_path, is_main=True):  # an earlier job's, which left its line in the lock's file
        pass
    script = ("import os, sys, time\n"
              "from pathlib import Path\n"
              "from trainer.run_directory import hold_run_directory\n"
              "with hold_run_directory(Path(sys.argv[1]), is_main=True):\n"
              "    if os.fork() == 0:\n"
              "        time.sleep(120)\n"
              "        os._exit(0)\n"
              "    print('held', flush=True)\n"
              "    time.sleep(120)\n")
    job = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        assert job.stdout.readline() == "held\n"
        with pytest.raises(ValueError, match=rf"{tmp_path} is in use by another job \(pid {job.pid} on "
                                             rf"{re.escape(socket.gethostname())}\): .*; wait for it to end, or give "
                                             r"this run another run_name \(RUN_NAME in the launch scripts\)$"):
            with hold_run_directory(tmp_path, is_main=True):
                pass
        job.kill()  # the job alone: its forked child holds the lock's file still
        job.wait()
        with hold_run_directory(tmp_path, is_main=True):
            pass
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()


def test_only_rank_0_holds_the_run_directory_the_other_ranks_pass_its_lock_and_make_nothing(tmp_path):
    """Every rank enters hold_run_directory: one past rank 0 that took the lock too was refused by rank 0's, on a
    node that shares the run directory, and made the folder on one that does not; no test that runs without mpiexec
    failed."""
    script = ("import sys\n"
              "from pathlib import Path\n"
              "from trainer.run_directory import hold_run_directory\n"
              "with hold_run_directory(Path(sys.argv[1]), is_main=True):\n"
              "    print('held', flush=True)\n"
              "    sys.stdin.read()\n")
    rank_0 = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert rank_0.stdout.readline() == "held\n"
        lock_line = (tmp_path / ".lock").read_text()
        with hold_run_directory(tmp_path, is_main=False):
            pass
        assert (tmp_path / ".lock").read_text() == lock_line
    finally:
        rank_0.communicate("")
    with hold_run_directory(tmp_path / "not on this node", is_main=False):
        pass
    assert not (tmp_path / "not on this node").exists()


@pytest.mark.parametrize("folder, written", [("checkpoints", "its checkpoints"),
                                             ("tensorboard", "its TensorBoard events")])
def test_a_run_folder_that_is_a_symbolic_link_to_nothing_is_refused_before_training(folder, written, tmp_path):
    """Linked to a scratch disk that is not mounted: the first checkpoint failed after an epoch's work, saying 'File
    exists', and TensorBoard's writer in a traceback."""
    (tmp_path / folder).symlink_to(tmp_path / "unmounted")
    with pytest.raises(ValueError) as error:
        with hold_run_directory(tmp_path, is_main=True):
            pass
    assert str(error.value) == (f"{tmp_path / folder} is a symbolic link to {tmp_path / 'unmounted'}, which does not "
                                f"exist: the run writes {written} there")


def test_run_folders_linked_to_a_disk_that_is_there_are_taken(tmp_path):
    """Linked to a scratch disk that is mounted: a link is refused only where it leads to nothing."""
    for folder in ("checkpoints", "tensorboard"):
        (tmp_path / "scratch" / folder).mkdir(parents=True)
        (tmp_path / "run" / folder).parent.mkdir(exist_ok=True)
        (tmp_path / "run" / folder).symlink_to(tmp_path / "scratch" / folder)
    with hold_run_directory(tmp_path / "run", is_main=True):
        pass


@pytest.mark.parametrize("folder, written", [("checkpoints", "its checkpoints"),
                                             ("tensorboard", "its TensorBoard events")])
def test_a_file_in_place_of_a_run_folder_is_refused_before_training(folder, written, tmp_path):
    """A file named tensorboard (or a pipe) in the run directory ended the run in a traceback of TensorBoard's
    os.makedirs, 'File exists', exit code 1, as a file named checkpoints did before it was refused here."""
    (tmp_path / folder).write_text("")
    with pytest.raises(ValueError) as error:
        with hold_run_directory(tmp_path, is_main=True):
            pass
    assert str(error.value) == f"{tmp_path / folder} is not a folder: the run writes {written} there"


@pytest.mark.parametrize("link", ["runs", "runs/name"])
def test_a_run_directory_under_a_symbolic_link_to_nothing_names_the_link_and_its_target(link, tmp_path, capsys):
    """runs/ (or the run's own folder) linked to a scratch disk that is not mounted: mkdir said only 'File exists'."""
    (tmp_path / link).parent.mkdir(exist_ok=True)
    (tmp_path / link).symlink_to(tmp_path / "unmounted")
    with pytest.raises(SystemExit) as exit_info:
        run_directory.make_or_exit(str(tmp_path / "runs" / "name"))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"error: cannot make the run directory {tmp_path / 'runs' / 'name'}: "
                                       f"{tmp_path / link} is a symbolic link to {tmp_path / 'unmounted'}, which does "
                                       "not exist\n")


@pytest.mark.parametrize("file", ["runs", "runs/name"])
def test_a_file_in_the_way_of_the_run_directory_is_named(file, tmp_path, capsys):
    """A file named runs (or named as the run): mkdir said only 'Not a directory' (or 'File exists') of the run
    directory, not which file was in its way."""
    (tmp_path / file).parent.mkdir(exist_ok=True)
    (tmp_path / file).write_text("")
    with pytest.raises(SystemExit) as exit_info:
        run_directory.make_or_exit(str(tmp_path / "runs" / "name"))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"error: cannot make the run directory {tmp_path / 'runs' / 'name'}: "
                                       f"{tmp_path / file} is a file, not a folder\n")


def test_a_run_directory_mkdir_refuses_is_named_once(tmp_path, capsys):
    """A run_name longer than a file system takes: mkdir's error names the folder it could not make, the run directory
    itself here, which the line names already."""
    directory = str(tmp_path / "runs" / ("x" * 256))
    with pytest.raises(SystemExit) as exit_info:
        run_directory.make_or_exit(directory)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: cannot make the run directory {directory}: File name too long\n"


def test_a_run_directory_with_a_link_in_place_of_its_lock_or_log_is_refused_and_the_linked_files_stay(tmp_path):
    """A run directory copied from elsewhere (tar, cp -a) may hold links where the run writes in place: its .lock,
    opened and emptied for the job's pid, and Hydra's log, appended to, emptied and wrote into the files they linked
    to, outside the run directory (a ~/.bashrc). Refused before Hydra opens its log, in one line naming the link."""
    run_dir, outside = tmp_path / "run", {name: tmp_path / f"outside{name}" for name in (".lock", "__main__.log")}
    run_dir.mkdir()
    for name, target in outside.items():
        target.write_text("the user's own\n")
        (run_dir / name).symlink_to(target)
    result = subprocess.run([sys.executable, "-m", "trainer", "experiment=cpu_demo", f"hydra.run.dir={run_dir}",
                             "data.an4_source=null", f"data.train_manifests=[{tmp_path / 'none.jsonl'}]",
                             f"data.eval_manifest={tmp_path / 'none.jsonl'}"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert [target.read_text() for target in outside.values()] == ["the user's own\n"] * 2
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"error: {run_dir / '.lock'} is a symbolic link to {outside['.lock']}: the run writes "
                             ".lock in place, so it would write that file instead; remove the link\n")


def test_a_sweep_job_folder_with_a_link_in_place_of_its_jobs_record_is_refused_before_any_job_runs(tmp_path):
    from trainer.check_overrides import refusal

    job_dir = tmp_path / "experiment=cpu_demo,seed=2"  # job_folder's name for it
    job_dir.mkdir(parents=True)
    (job_dir / "jobs.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    assert refusal(["experiment=cpu_demo", "seed=1,2", f"hydra.sweep.dir={tmp_path}"], sweep=True) == (
        f"sweep job 1 (seed=2): {job_dir / 'jobs.jsonl'} is a symbolic link to {tmp_path / 'elsewhere.jsonl'}: the run "
        "writes jobs.jsonl in place, so it would write that file instead; remove the link")


@pytest.mark.parametrize("sweep", [False, True])
def test_check_overrides_refuses_a_run_directory_with_a_link_in_place_of_a_file_it_writes(sweep, tmp_path):
    """As the trainer's callback refuses it, before the launch scripts' build and their ranks' start."""
    from trainer.check_overrides import refusal

    name = "multirun.yaml" if sweep else ".lock"
    (tmp_path / name).symlink_to(tmp_path.parent / "elsewhere")
    overrides = ["experiment=cpu_demo", *(["seed=1,2", f"hydra.sweep.dir={tmp_path}"] if sweep else
                                          [f"hydra.run.dir={tmp_path}"])]
    assert refusal(overrides, sweep) == (f"{tmp_path / name} is a symbolic link to {tmp_path.parent / 'elsewhere'}: "
                                         f"the run writes {name} in place, so it would write that file instead; "
                                         "remove the link")


def test_a_link_in_place_of_a_skip_list_is_refused(tmp_path):
    """The training job writes its skip lists to where a link leads (data.files.write_out, as a tool's output file):
    a run directory copied with skipped_train.jsonl -> a file outside had that file replaced by the list."""
    from trainer.run_directory import run_file_refusal

    (tmp_path / "skipped_test.jsonl").symlink_to("/dev/null")  # a device: written through, it changes no file
    assert run_file_refusal(tmp_path) is None
    (tmp_path / "skipped_train.jsonl").symlink_to(tmp_path.parent / "notes.txt")
    assert run_file_refusal(tmp_path) == (f"{tmp_path / 'skipped_train.jsonl'} is a symbolic link to "
                                          f"{tmp_path.parent / 'notes.txt'}: the run writes skipped_train.jsonl in "
                                          "place, so it would write that file instead; remove the link")


def test_a_link_to_a_stream_in_place_of_a_log_or_the_jobs_record_is_taken(tmp_path, monkeypatch):
    """Written through, a character device or this process's own stderr changes no file: the full-disk tests' links
    to /dev/full, a log sent to /dev/stderr, a pipe under `| tee`. Refused, they stopped those runs."""
    from trainer.run_directory import run_file_refusal

    reader, writer = os.pipe()
    with os.fdopen(reader, "rb"), os.fdopen(writer, "w") as stderr:
        monkeypatch.setattr(sys, "stderr", stderr)
        (tmp_path / "jobs.jsonl").symlink_to("/dev/full")
        (tmp_path / "__main__.log").symlink_to(f"/dev/fd/{writer}")  # /dev/stderr, as this process sees it
        assert run_file_refusal(tmp_path) is None
        (tmp_path / "train.log").symlink_to(tmp_path / "pipe-to-be")  # nothing there: writing would make a file
        assert run_file_refusal(tmp_path).startswith(f"{tmp_path / 'train.log'} is a symbolic link to ")


@pytest.mark.parametrize("name", [".lock", "jobs.jsonl", "multirun.yaml", "__main__.log", "skipped_test.jsonl"])
def test_a_pipe_in_place_of_a_file_the_run_writes_in_place_is_refused(name, tmp_path):
    """Opening a pipe waits for a reader: a run directory holding one (mkfifo; tar and cp -a copy it) where the run
    opens its lock, jobs.jsonl or Hydra's log waited for ever, a first SIGTERM and all; one at .lock was refused as
    'cannot write in the run directory (None)'. A link to a pipe that is not this process's own stream, likewise."""
    from trainer.run_directory import run_file_refusal

    run_dir, pipe = tmp_path / "run", tmp_path / "pipe"
    run_dir.mkdir()
    os.mkfifo(run_dir / name)
    assert run_file_refusal(run_dir) == (f"{run_dir / name} is a pipe: the run writes {name} in place, and would "
                                         "wait for ever for a reader of the pipe; remove it")
    (run_dir / name).unlink()
    os.mkfifo(pipe)
    (run_dir / name).symlink_to(pipe)
    assert run_file_refusal(run_dir) == (f"{run_dir / name} (a symbolic link to {pipe}) is a pipe: the run writes "
                                         f"{name} in place, and would wait for ever for a reader of the pipe; "
                                         "remove it")


@pytest.mark.parametrize("name", [".lock", "jobs.jsonl", "multirun.yaml", "__main__.log", "skipped_train.jsonl"])
def test_a_folder_in_place_of_a_file_the_run_writes_in_place_is_refused(name, tmp_path):
    """A folder named __main__.log ended the run in a traceback of Hydra's logging set-up, exit code 1; one named .lock
    was refused as 'cannot write in the run directory DIR (Is a directory)'."""
    from trainer.run_directory import run_file_refusal

    (tmp_path / name).mkdir()
    assert run_file_refusal(tmp_path) == (f"{tmp_path / name} is a folder: the run writes {name} in place, as a file; "
                                          "remove or rename the folder")


def test_a_run_directory_with_a_pipe_in_place_of_its_log_is_refused_in_one_line(tmp_path):
    """Hydra opens the log before the trainer's code runs: the run waited there for ever, and a SIGTERM, kept until
    training would begin, did not end it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / "__main__.log")
    result = subprocess.run([sys.executable, "-m", "trainer", "experiment=cpu_demo", f"hydra.run.dir={run_dir}",
                             "data.an4_source=null", f"data.train_manifests=[{tmp_path / 'none.jsonl'}]",
                             f"data.eval_manifest={tmp_path / 'none.jsonl'}"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"error: {run_dir / '__main__.log'} is a pipe: the run writes __main__.log in place, and "
                             "would wait for ever for a reader of the pipe; remove it\n")


def test_a_run_directory_that_exists_but_cannot_be_written_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Hydra's log file failed first, in a traceback of 32 lines and exit code 1. The tests run as root, whom
    permissions do not stop, so the system's answer is played: a read-only file system gives the same."""
    run_directory.make_or_exit(str(tmp_path))
    monkeypatch.setattr(run_directory.os, "access", lambda path, mode: False)
    with pytest.raises(SystemExit) as exit_info:
        run_directory.make_or_exit(str(tmp_path))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: cannot write in the run directory {tmp_path}\n"


def test_a_folder_in_place_of_the_run_lock_is_refused_naming_it(tmp_path):
    """A folder named .lock (a copy's leftover) was refused as 'cannot write in the run directory DIR (Is a
    directory)', which named neither the lock nor anything to remove."""
    (tmp_path / ".lock").mkdir()
    with pytest.raises(ValueError) as error:
        with hold_run_directory(tmp_path, is_main=True):
            pass
    assert str(error.value) == f"cannot write in the run directory {tmp_path} (Is a directory: {tmp_path / '.lock'})"


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_training(tmp_path, monkeypatch):
    """Else the first checkpoint failed, an epoch's work in. As root, whom permissions do not stop, the system's answer
    is played, as for the run directory above."""
    (tmp_path / "checkpoints").mkdir()
    monkeypatch.setattr(run_directory.os, "access", lambda path, mode: Path(path) != tmp_path / "checkpoints")
    with pytest.raises(ValueError) as error:
        with hold_run_directory(tmp_path, is_main=True):
            pass
    assert str(error.value) == (f"{tmp_path / 'checkpoints'} cannot be written by this job (its permissions, or a "
                                f"read-only file system): the run writes its checkpoints in {tmp_path / 'checkpoints'}")


def test_metrics_the_disk_cannot_hold_stay_as_they_were_and_the_error_is_one_line(tmp_path):
    """A resumed run rewrites metrics.jsonl with the lines its checkpoint covers; a full disk, played by a file size
    limit (the write fails with EFBIG), leaves the file as it was and no temporary file, and the error names it."""
    path = tmp_path / "metrics.jsonl"
    written = "".join(json.dumps({"step": step, "epoch": 0, "loss": 1.0}) + "\n" for step in range(1, 41))
    path.write_text(written)
    script = (
        "import resource\n"
        "from pathlib import Path\n"
        "from trainer.__main__ import user_error_message\n"
        "from trainer.records import open_metrics\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "try:\n"
        f"    open_metrics(Path({str(path)!r}), {{'epoch': 0, 'step': 30}})\n"
        "except OSError as error:\n"
        f"    print(user_error_message(error, Path({str(tmp_path)!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith(f"cannot write {path}: File too large; "), result.stderr
    assert (f" MiB free in {tmp_path}, and this process may write files of at most 100 bytes (ulimit -f); checkpoints "
            "are written whole or not at all") in result.stdout
    assert path.read_text() == written and [file.name for file in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_tensorboard_events_the_disk_cannot_hold_are_one_error_in_the_main_thread_and_no_thread_traceback(tmp_path):
    script = (
        "import resource\n"
        "from trainer.records import tensorboard_writer\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (300, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        f"writer = tensorboard_writer({str(tmp_path)!r}, None)\n"
        "try:\n"
        "    for step in range(1000):\n"
        "        writer.add_scalar('loss', 1.0, step)\n"
        "        writer.flush()\n"
        "except OSError as error:\n"
        "    print(error.errno)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout == f"{errno.EFBIG}\n" and result.stderr == "", result.stderr


WRITES_DURING_A_RUN = {  # each record the run appends to as it trains, written past a file size limit of 300 bytes
    "jobs.jsonl": ("record_job(run_dir / 'jobs.jsonl', 'x' * 400, 0, DistEnv(0, 1, torch.device('cpu')), "
                   "resumed=False)"),
    "metrics.jsonl": ("metrics = open_metrics(run_dir / 'metrics.jsonl', None)\n"
                      "    for step in range(100):\n"
                      "        append_metrics(metrics, {'step': step, 'epoch': 1, 'loss': 1.0})"),
    "tensorboard": ("writer = tensorboard_writer(run_dir / 'tensorboard', None)\n"
                    "    for step in range(1000):\n"
                    "        writer.add_scalar('loss', 1.0, step)\n"
                    "        writer.flush()"),
}


@pytest.mark.parametrize("written", WRITES_DURING_A_RUN)
def test_a_record_the_disk_cannot_hold_mid_run_is_named_in_the_error_line(written, tmp_path):
    """A full disk, played by a file size limit (the write fails with EFBIG): a failed write() names no file, and the
    run ended on 'cannot write: File too large' for jobs.jsonl, a metrics.jsonl line and TensorBoard's events."""
    script = (
        "import resource\n"
        "from pathlib import Path\n"
        "import torch\n"
        "from trainer.__main__ import user_error_message\n"
        "from trainer.distributed import DistEnv\n"
        "from trainer.records import append_metrics, open_metrics, record_job, tensorboard_writer\n"
        f"run_dir = Path({str(tmp_path)!r})\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (300, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "try:\n"
        f"    {WRITES_DURING_A_RUN[written]}\n"
        "except OSError as error:\n"
        "    print(user_error_message(error, run_dir))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith(f"cannot write {tmp_path / written}: File too large; "), result.stdout
    # The disk has space: the limit is what refused the write.
    assert ", and this process may write files of at most 300 bytes (ulimit -f); " in result.stdout, result.stdout


REFUSED_WRITES = {  # a run record whose folder no longer takes it, and what the error line names
    "jobs.jsonl made read-only": ("chmod 444 jobs.jsonl", "record_job(run_dir / 'jobs.jsonl', 'x', 0, "
                                  "DistEnv(0, 1, torch.device('cpu')), resumed=True)", "jobs.jsonl",
                                  "Permission denied"),
    "the run folder made read-only": ("chmod 555 .", "open_metrics(run_dir / 'metrics.jsonl', None)", "metrics.jsonl",
                                      "Permission denied"),
    "tensorboard made read-only": ("mkdir tensorboard && chmod 555 tensorboard",
                                   "tensorboard_writer(run_dir / 'tensorboard', None)", "tensorboard",
                                   "Permission denied"),
    "tensorboard removed as the run goes on": (
        "true", "writer = tensorboard_writer(run_dir / 'tensorboard', None)\n"
                "    shutil.rmtree(run_dir / 'tensorboard')\n"
                "    writer.add_scalar('loss', 1.0, 1)\n"
                "    writer.flush()", "tensorboard", "No such file or directory"),
}


@pytest.mark.parametrize("refused", REFUSED_WRITES)
def test_a_record_that_cannot_be_written_is_named_as_a_write_in_one_line(refused, tmp_path):
    """A record made unwritable (permissions, a read-only file system, its folder removed) said 'cannot open
    b'.../tensorboard/events.out.tfevents...'', or '[Errno 2] No such file or directory', where the run writes it."""
    made_so, write, written, reason = REFUSED_WRITES[refused]
    (tmp_path / "jobs.jsonl").write_text("")
    subprocess.run(made_so, shell=True, cwd=tmp_path, check=True)
    script = (
        "import shutil\n"
        "from pathlib import Path\n"
        "import torch\n"
        "from trainer.__main__ import user_error_message\n"
        "from trainer.distributed import DistEnv\n"
        "from trainer.records import open_metrics, record_job, tensorboard_writer\n"
        f"run_dir = Path({str(tmp_path)!r})\n"
        "try:\n"
        f"    {write}\n"
        "except OSError as error:\n"
        "    print(user_error_message(error, run_dir))\n"
    )
    result = subprocess.run(without_root_privilege([sys.executable, "-c", script]), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    tmp_path.chmod(0o755)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    # The resume the stop line words: train.resume=auto alone, the default config, is refused (check_resumable).
    assert result.stdout == (f"cannot write {tmp_path / written}: {reason}; checkpoints are written whole or not at "
                             "all, so once it can be written train.resume=auto under the same run_name (RUN_NAME in "
                             "the launch scripts) and overrides continues from the last one\n")


def test_only_what_the_user_fixes_is_a_one_line_error():
    assert user_error_message(ValueError("model.depth must be a positive integer"), Path("r")) == (
        "model.depth must be a positive integer")
    assert user_error_message(OSError(errno.EDQUOT, "Disk quota exceeded", "r/config.yaml"), Path("r")).startswith(
        "cannot write r/config.yaml: Disk quota exceeded")
    sweep = "the same sweep (its -m and overrides) with train.resume=auto under the same run_name, sw,"
    assert user_error_message(OSError(errno.EDQUOT, "Disk quota exceeded", "r/config.yaml"), Path("r"),
                              sweep).endswith(f"so once there is space {sweep} continues from the last one")
    # A file named in the config that cannot be opened (a manifest: no permission, a name too long) got a traceback.
    assert user_error_message(PermissionError(errno.EACCES, "Permission denied", "m.jsonl"), Path("r")) == (
        "cannot open m.jsonl: Permission denied")
    with pytest.raises(OSError) as too_long:
        open("x" * 300)
    assert user_error_message(too_long.value, Path("r")) == f"cannot open {'x' * 300}: File name too long"
    # An interpolation that does not resolve (a typo in an override or an experiment file) was three lines.
    with pytest.raises(ValueError) as unresolved:
        OmegaConf.select(OmegaConf.create({"model": {"hidden": "${nope}"}}), "model.hidden")
    assert user_error_message(unresolved.value, Path("r")) == "model.hidden: Interpolation key 'nope' not found"
    # One in a list, which OmegaConf names no key of: not "None: Interpolation key...".
    with pytest.raises(ValueError) as in_a_list:
        list(OmegaConf.create({"data": {"train_manifests": ["${nope}"]}}).data.train_manifests)
    assert user_error_message(in_a_list.value, Path("r")) == "Interpolation key 'nope' not found"
    assert user_error_message(OSError(errno.EIO, "Input/output error"), Path("r")) is None  # a fault: its traceback
    # One naming no file would read "cannot open None: ...", nothing the user could fix: a fault too.
    assert user_error_message(PermissionError(errno.EACCES, "Permission denied"), Path("r")) is None
    assert user_error_message(RuntimeError("CUDA error"), Path("r")) is None


@pytest.mark.parametrize("leaving, launched, mpi_started, aborted_with", [
    (SystemExit(2), True, False, 2), (SystemExit("a message"), True, False, 1), (SystemExit(0), True, False, None),
    (SystemExit(None), True, False, None), (SystemExit(2), False, False, None), (SystemExit(2), True, True, None)],
    ids=["refused", "message", "zero", "none", "no-mpi", "mpi-started"])
def test_a_rank_leaving_before_mpi_ends_the_job_with_its_exit_code_only_where_others_wait_in_mpi_init(
        monkeypatch, leaving, launched, mpi_started, aborted_with):
    """The multi-rank tests reach only Hydra's refusal (exit 2): sys.exit("message") ends the job 1, as Python ends
    the process, and a rank that leaves well, or outside mpiexec, or once MPI has started, ends nothing."""
    aborted, watched = [], []

    @contextlib.contextmanager
    def watching(timeout_s, rank):
        watched.append(timeout_s)
        yield
        watched.append("ended")

    monkeypatch.setattr(trainer_main.launch_ranks, "launched_by_mpi", lambda: launched)
    monkeypatch.setattr(trainer_main.distributed, "abort_job", lambda code: aborted.append((code, list(watched))))
    monkeypatch.setattr(trainer_main.distributed, "ended_past", watching)
    if mpi_started:
        monkeypatch.setitem(sys.modules, "mpi4py.MPI", object())
    else:
        monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    trainer_main.end_job_before_mpi(leaving, ["train.epoch=3", "distributed.timeout_s=7"])
    assert aborted == ([] if aborted_with is None else [(aborted_with, [7.0])])  # MPI's start under its watchdog


@pytest.mark.parametrize("overrides, timeout_s", [
    ([], 300.0), (["distributed.timeout_s=5"], 5.0), (["++distributed.timeout_s=2.5", "x=1"], 2.5),
    (["distributed.timeout_s=5", "distributed.timeout_s=9"], 9.0), (["distributed.timeout_s=-1"], 300.0),
    (["distributed.timeout_s=nan"], 300.0), (["distributed.timeout_s=1e10"], 300.0),
    (["distributed.timeout_s=5,10"], 300.0), (["distributed.timeout_s"], 300.0), (["distributed.timeout_sx=5"], 300.0),
    (["distributed.timeout_s=5", "distributed.timeout_s=oops"], 300.0)])
def test_a_rank_leaving_before_mpi_reads_its_timeout_from_the_command_line(overrides, timeout_s):
    """Its config may not have loaded (Hydra refused an override): a value the config would refuse, or a sweep's list,
    gives the default, which is conf/train.yaml's."""
    assert OmegaConf.load(REPO_ROOT / "conf" / "train.yaml").distributed.timeout_s == 300.0
    assert trainer_main.timeout_on_the_command_line(overrides) == timeout_s


def test_a_rank_other_than_0_tags_its_log_lines_once_though_each_job_of_a_sweep_sets_it_up_again():
    """The sweep's multi-rank test asks for "[rank 1] rank 1 of 2" in rank 1's lines, which a second tag before it,
    one per job, would pass."""
    factory = logging.getLogRecordFactory()
    levels = {name: logging.getLogger(name).level for name in ("", "hydra", "trainer.distributed")}
    try:
        trainer_main.leave_the_log_to_rank_0(0)
        assert logging.getLogRecordFactory()("x", logging.INFO, "f", 1, "line", None, None).msg == "line"
        for _ in range(2):  # the first job, then the second
            trainer_main.leave_the_log_to_rank_0(3)
        assert logging.getLogRecordFactory()("x", logging.INFO, "f", 1, "line", None, None).msg == "[rank 3] line"
        assert logging.getLogger().level == logging.getLogger("hydra").level == logging.WARNING
        assert logging.getLogger("trainer.distributed").level == logging.INFO
    finally:
        logging.setLogRecordFactory(factory)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_results_record_the_commit_and_the_command_as_typed(tmp_path):
    commit = source_commit()
    assert re.fullmatch(r"[0-9a-f]{12}(\+changes)?", commit), commit
    # Each a record of a CPU job holds, and no GPU's (their versions are those of libraries a CPU job does not use).
    assert versions(torch.device("cpu")) == {"python": platform.python_version(), "torch": torch.__version__,
                                             "commit": commit}
    assert source_commit(tmp_path) is None  # no git checkout there
    # An installed copy inside a checkout (pip install . into its .venv) is not that checkout's code: it gave the
    # checkout's commit.
    checkout, installed = tmp_path / "checkout", tmp_path / "checkout" / ".venv" / "site-packages"
    (installed / "trainer").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "trainer" / "environment.py", installed / "trainer")
    (checkout / ".gitignore").write_text(".venv/\n")
    for command in (["init", "-q"], ["add", ".gitignore"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit",
                                                              "-qm", "first"]):
        subprocess.run(["git", "-C", str(checkout), *command], check=True, capture_output=True)
    assert source_commit(installed) is None
    code = "from trainer.environment import command_line; print(command_line())"
    printed = subprocess.run([sys.executable, "-c", code, "two words"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
    assert printed == f"python -c '{code}' 'two words'"


def checkout_of_this_file(tmp_path: Path) -> Path:
    """A git checkout whose one commit holds trainer/environment.py, as source_commit looks for it."""
    checkout = tmp_path / "checkout"
    (checkout / "trainer").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "trainer" / "environment.py", checkout / "trainer")
    for command in (["init", "-q"], ["add", "."],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one"]):
        subprocess.run(["git", "-C", str(checkout), *command], check=True, capture_output=True)
    return checkout


def test_reading_the_commit_leaves_the_checkouts_index_alone(tmp_path):
    """Every rank of every job asks git for the commit; `git status` rewrote a checkout's index whose files' times had
    changed, holding .git/index.lock meanwhile: a user's `git commit` at that moment failed, and a job killed outright
    (a scheduler's SIGKILL to its process group) left the lock behind, failing every later git command there."""
    checkout = checkout_of_this_file(tmp_path)
    index = checkout / ".git" / "index"
    os.utime(checkout / "trainer" / "environment.py", ns=(1, 1))  # same content, other times: a stale index entry
    before = index.read_bytes()
    assert re.fullmatch(r"[0-9a-f]{12}", source_commit(checkout))
    assert index.read_bytes() == before


def test_the_commit_is_marked_changed_by_an_edited_tracked_file_only(tmp_path):
    """A run's jobs.jsonl and the benchmarks' results say which code ran: an edit left unmarked names a commit that
    did not run, and an untracked file (a notes file, a run's output outside runs/) marking every run "+changes"
    makes the mark mean nothing."""
    checkout = checkout_of_this_file(tmp_path)
    (checkout / "notes.txt").write_text("untracked\n")
    assert re.fullmatch(r"[0-9a-f]{12}", source_commit(checkout))
    with open(checkout / "trainer" / "environment.py", "a") as edited:
        edited.write("# edited\n")
    assert re.fullmatch(r"[0-9a-f]{12}\+changes", source_commit(checkout))


def test_each_job_of_a_run_adds_where_it_ran_and_a_fresh_run_starts_anew(tmp_path, caplog):
    path = tmp_path / "jobs.jsonl"
    env = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))
    path.write_text('{"from_step": 0, "device": "an earlier run"}\n')
    with caplog.at_level("INFO", logger="trainer.records"):
        record_job(path, "run-a", 0, env, resumed=False)
        record_job(path, "run-a", 40, env, resumed=True)
    jobs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(job["run_id"], job["from_step"], job["world_size"]) for job in jobs] == [("run-a", 0, 1), ("run-a", 40, 1)]
    assert recorded_run_id(tmp_path) == "run-a" and recorded_run_id(tmp_path / "elsewhere") is None
    assert all(job["device"].startswith("CPU") and job["torch"] == torch.__version__ for job in jobs), jobs
    assert all(job["command"] == command_line() for job in jobs), jobs
    assert "this job: from step 40, world size 1, rank 0 on CPU" in caplog.text


def test_the_run_id_is_the_last_jobs_where_a_run_from_before_run_ids_went_on_under_one(tmp_path):
    """A run from before run ids, resumed, records its new id in the job it appends: a copy of a checkpoint written
    since is that run's, where the first job's line, without an id, would call it another run's and refuse it."""
    path = tmp_path / "jobs.jsonl"
    path.write_text('{"from_step": 0, "device": "a job from before run ids"}\n')
    record_job(path, "run-a", 40, DistEnv(rank=0, world_size=1, device=torch.device("cpu")), resumed=True)
    assert recorded_run_id(tmp_path) == "run-a"


def test_a_job_after_one_that_left_half_a_line_in_jobs_jsonl_records_itself_and_the_run_id_whole(tmp_path):
    # The next job's line was glued to the torn one: the run's id was then read as None, and that job was lost.
    path = tmp_path / "jobs.jsonl"
    env = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))
    record_job(path, "run-a", 0, env, resumed=False)
    with open(path, "a") as jobs:
        jobs.write('{"run_id": "run-a", "from_st')
    assert recorded_run_id(tmp_path) == "run-a"
    record_job(path, "run-a", 40, env, resumed=True)
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[-1])["from_step"] == 40, lines
    assert recorded_run_id(tmp_path) == "run-a"
    # A fresh run starts the file anew, with no line break first for the torn line it replaces (a mutant wrote one).
    with open(path, "a") as jobs:
        jobs.write('{"run_id": "run-a", "from_st')
    record_job(path, "run-b", 0, env, resumed=False)
    assert [json.loads(line)["run_id"] for line in path.read_text().split("\n")[:-1]] == ["run-b"]


def test_a_cpu_rank_names_its_thread_count_in_words_that_agree():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # a rank of two on a 2-core machine: it read "(1 threads per rank)"
        assert device_name(torch.device("cpu")).endswith(" (1 thread per rank)")
        torch.set_num_threads(2)
        assert device_name(torch.device("cpu")).endswith(" (2 threads per rank)")
    finally:
        torch.set_num_threads(threads)


def test_a_gpu_rank_is_named_by_its_gpu(monkeypatch):
    # Only a CUDA test checked it: a mutant that named the CPU in a GPU job's records passed wherever there is no GPU.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert device_name(torch.device("cuda", 0)) == "NVIDIA H100 80GB HBM3"


def test_a_sweep_exits_2_where_every_failure_was_a_user_error_else_1(monkeypatch, capsys):
    monkeypatch.setattr(trainer_main, "_failed_sweep_jobs", [])
    assert trainer_main.sweep_exit_code() == 0
    trainer_main._failed_sweep_jobs.append(("sweep job 0 (runs/a): bad value", 2))
    assert trainer_main.sweep_exit_code() == 2
    trainer_main._failed_sweep_jobs.append(("sweep job 3 (runs/b): RuntimeError: x (its traceback is above)", 1))
    assert trainer_main.sweep_exit_code() == 1
    assert "failed: sweep job 3 (runs/b): RuntimeError" in capsys.readouterr().err


def test_a_stop_before_training_names_what_the_run_directory_holds_and_the_sweep_jobs_that_failed(
        tmp_path, monkeypatch, caplog, capsys):
    """A second Ctrl-C once a checkpoint is written, or a signal as a resumed run starts: the line names last.pt, and a
    sweep's the jobs that failed before. The tests that stop a run so had none written and ran no sweep: mutants that
    always said no checkpoint was written, or named no failed job, passed them all."""
    monkeypatch.setattr(trainer_main, "_failed_sweep_jobs", [("sweep job 0 (runs/a): bad value", 2)])
    last = tmp_path / "checkpoints" / "last.pt"
    for written in (False, True):
        if written:
            last.parent.mkdir()
            last.write_bytes(b"")
        caplog.clear()
        with pytest.raises(SystemExit) as stopped:
            trainer_main.stop_now("interrupted by Ctrl-C", signal.SIGINT, tmp_path)
        assert stopped.value.code == 128 + signal.SIGINT
        held = f"{last} holds the run as of its last checkpoint" if written else "no checkpoint of this run was written"
        assert caplog.messages == [f"interrupted by Ctrl-C; {held}"]
        assert capsys.readouterr().err == "failed: sweep job 0 (runs/a): bad value\n"


def test_a_sweep_job_folder_is_one_folder_of_a_legal_length_named_by_its_overrides():
    assert job_folder("data.eval_manifest=m/a.jsonl,model.cell=gru") == "data.eval_manifest=m_a.jsonl,model.cell=gru"
    long = ",".join(f"data.train_manifests=[/corpus/{index:03d}.jsonl]" for index in range(20))
    name = job_folder(long)
    assert "/" not in name and len(name.encode()) == MAX_FOLDER_NAME and name.startswith("data.train_manifests=[")
    assert job_folder(long) == name and job_folder(long.replace("019", "020")) != name  # stable, and apart
    # Long paths give way to digests before the name is cut, so the keys a sweep varies stay in it.
    paths = "data.eval_manifest=/tmp/" + "x" * 150 + "/test.jsonl,data.train_manifests=[/tmp/" + "x" * 150 + "/a.jsonl]"
    name = job_folder(f"{paths},model.backend=reference,model.cell=gru")
    assert name.startswith("data.eval_manifest=#") and name.endswith(",model.backend=reference,model.cell=gru"), name
    assert len(name.encode()) <= MAX_FOLDER_NAME and job_folder(f"{paths.replace('a.jsonl', 'b.jsonl')},model.cell=gru"
                                                                ) != job_folder(f"{paths},model.cell=gru")
    # A value of LONG_VALUE characters stays as it is, one longer gives way (at < LONG_VALUE a mutant passed).
    kept, digested = "k" * LONG_VALUE, "d" * (LONG_VALUE + 1)
    name = job_folder(f"data.eval_manifest=/tmp/{'x' * 250}/t.jsonl,model.note={kept},run_name={digested}")
    assert name.startswith("data.eval_manifest=#") and f",model.note={kept},run_name=#" in name, name
    # A name of MAX_FOLDER_NAME bytes stays as it is, one a byte longer has its long value digested (a threshold 10
    # bytes higher cut that one, losing the key a sweep varies).
    at_the_limit = "data.eval_manifest=/" + "x" * (MAX_FOLDER_NAME - 43) + "/t.jsonl,model.cell=gru"
    assert len(at_the_limit) == MAX_FOLDER_NAME and job_folder(at_the_limit) == at_the_limit.replace("/", "_")
    assert re.fullmatch(r"data\.eval_manifest=#[0-9a-f]{12},model\.cell=gru",
                        job_folder(at_the_limit.replace("=/", "=/x")))


def test_run_names_hydra_parses_as_numbers_are_names_too(capsys):
    from trainer.run_directory import check_run_name

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True)
    for name in (1.5, 2024, "2024-06-01", "exp.v2", "a b"):
        cfg.run_name = name
        check_run_name(cfg)  # returns: runs/1.5 is one folder of runs/
    for name in (None, True, "", "  ", "..", "a/b", "a\\b"):
        cfg.run_name = name
        with pytest.raises(SystemExit) as refused:  # any exit passed, an exit 0 without a word too
            check_run_name(cfg)
        assert refused.value.code == 2 and capsys.readouterr().err == (
            f"error: run_name={name!r} must name one folder of runs/: a name, not empty, null or true/false, not dots "
            "alone, no / or \\\n"), name


@pytest.mark.parametrize("sweep", [False, True])
def test_a_run_name_that_reads_hydras_node_passes_the_check(sweep, monkeypatch):
    """run_name=${hydra:runtime.choices.experiment} names the run after its experiment, as Hydra resolves it for the
    run's folder: the check resolved it before Hydra's node was readable and refused it, exit 2."""
    from hydra.core.hydra_config import HydraConfig

    from trainer.check_overrides import refusal

    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # as in a new process: an earlier test's stays set
    assert refusal(["experiment=cpu_demo", "run_name=${hydra:runtime.choices.experiment}"], sweep) is None


def test_checking_a_jobs_config_leaves_the_callers_config_as_it_was():
    """The check deleted the hydra node from the config it was given, which its caller may read after it."""
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=cpu_demo"], return_hydra_config=True)
    before = OmegaConf.to_yaml(cfg)
    run_directory.check_job_config(cfg, Path(cfg.hydra.run.dir))
    assert OmegaConf.to_yaml(cfg) == before


def test_checking_a_jobs_inputs_checks_the_checkpoints_in_its_folder(an4_source, tmp_path):
    """check_job_config's `inputs` are all the files a job reads, the checkpoints in its folder included: its two
    callers checked those apart, after it, each its own way."""
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=cpu_demo", f"data.an4_source={an4_source}",
                                                      f"data.manifest_dir={tmp_path / 'manifests'}"],
                      return_hydra_config=True)
    run_directory.check_job_config(cfg, tmp_path, inputs=True)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"")
    run_directory.check_job_config(cfg, tmp_path)  # the callback's check, on every rank, leaves them to the run
    with pytest.raises(ValueError, match="already holds a run"):
        run_directory.check_job_config(cfg, tmp_path, inputs=True)


@pytest.mark.parametrize("sweep, refusal", [
    ([], "train.global_batch_size=3: "),
    (["-m", "seed=1,2"], "sweep job 0 (seed=1): train.global_batch_size=3: "),
])
def test_check_overrides_refuses_a_global_batch_the_rank_count_does_not_divide(sweep, refusal, capsys):
    """As every rank of a job of that many would refuse it: the check knew no rank count, and passed it."""
    from trainer.check_overrides import main

    overrides = [*sweep, "experiment=cpu_demo", "train.global_batch_size=3"]
    assert main(["--world-size", "3", *overrides]) == 0
    assert capsys.readouterr() == ("", "")  # a command it passes prints nothing (its --help and README say so)
    assert main(["--world-size", "2", *overrides]) == 2
    assert capsys.readouterr().err == (f"error: {refusal}global_batch_size 3 must be a positive multiple of "
                                       "world_size 2\n")


@pytest.mark.parametrize("overrides, refusal", [
    (["data.features.kind=mel", "data.features.n_mels=115"], "data.features: n_mels=115 at 16000 Hz and window_ms=20 "
     "(an FFT of 512 points) gives mel bands that hold no FFT bin, features that never change: at most 114 bands "
     "work there"),
    (["data.features.hop_ms=30"], "data.features: hop_ms=30 is longer than window_ms=20"),
    (["data.augment.enabled=true", "data.augment.masks.freq_mask=41"], "data.augment.masks.freq_mask=41 must be at "
     "most the 40 features of a frame (data.features.kind=mel): a wider mask can zero them all"),
])
def test_check_overrides_refuses_features_the_run_would_refuse(overrides, refusal, capsys):
    """README, What is checked before a job starts: a value the trainer refuses is refused before the build and the
    ranks' start. Feature settings that cannot work together passed the check, then every rank refused them."""
    from trainer.check_overrides import main

    assert main(["experiment=cpu_demo", *overrides]) == 2
    assert capsys.readouterr().err == f"error: {refusal}\n"


@pytest.mark.parametrize("sweep", [[], ["-m", "seed=1,2"]])
def test_check_overrides_refuses_a_manifest_the_run_cannot_open(sweep, tmp_path, capsys):
    """README, What is checked before a job starts: a missing manifest, or an empty one, passed the check, the build
    and every rank's start, then each rank failed reading it. Its words are the run's own (data.manifest's)."""
    from trainer.check_overrides import main

    manifest = tmp_path / "train.jsonl"
    manifest.write_text("not JSON\n")  # its lines are the run's to read: one it would refuse passes the check
    (tmp_path / "empty.jsonl").write_bytes(b"")  # its size is read: every rank started to find no utterance in it
    job = "sweep job 0 (seed=1): " if sweep else ""
    for eval_manifest, refusal in [
        (tmp_path / "absent.jsonl", f"manifest {tmp_path / 'absent.jsonl'} does not exist"),
        (tmp_path, f"manifest {tmp_path} is a folder, not a file"),
        (tmp_path / "empty.jsonl", f"manifest {tmp_path / 'empty.jsonl'} is empty (0 bytes)"),
    ]:
        assert main([*sweep, "data=manifest", f"data.train_manifests=[{manifest}]",
                     f"data.eval_manifest={eval_manifest}"]) == 2
        assert capsys.readouterr().err == f"error: {job}{refusal}\n"
    # Every training manifest is checked, the second of two too: a check of the test set's alone (or of the first
    # training manifest) passed each refusal above.
    absent = tmp_path / "absent.jsonl"
    assert main([*sweep, "data=manifest", f"data.train_manifests=[{manifest},{absent}]",
                 f"data.eval_manifest={manifest}"]) == 2
    assert capsys.readouterr().err == f"error: {job}manifest {absent} does not exist\n"
    assert main([*sweep, "data=manifest", f"data.train_manifests=[{manifest}]", f"data.eval_manifest={manifest}"]) == 0


def test_check_overrides_refuses_a_manifest_this_process_may_not_open(tmp_path):
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("")
    manifest.chmod(0)
    result = subprocess.run(without_root_privilege([
        sys.executable, "-m", "trainer.check_overrides", "data=manifest", f"data.train_manifests=[{manifest}]",
        f"data.eval_manifest={manifest}"]), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (2, f"error: cannot open manifest {manifest}: Permission denied\n")


def test_check_overrides_checks_the_an4_source_rather_than_the_manifests_it_writes(an4_source, tmp_path, capsys):
    """data=an4's first run writes its manifests from data.an4_source: a missing source failed every rank after the
    build (rank 0 preparing, the others at its barrier); the manifests, not written yet, are no refusal."""
    from trainer.check_overrides import main

    manifests = f"data.manifest_dir={tmp_path / 'manifests'}"
    assert main(["experiment=cpu_demo", f"data.an4_source={an4_source}", manifests]) == 0
    assert main(["experiment=cpu_demo", f"data.an4_source={tmp_path / 'no_an4'}", manifests]) == 2
    assert capsys.readouterr().err == (f"error: folder {tmp_path / 'no_an4'} does not exist (data.an4_source, AN4's "
                                       "folder; PRNN_AN4 sets its default)\n")
    # Another test set beside AN4's is read as it is: the run writes none there.
    assert main(["experiment=cpu_demo", f"data.an4_source={an4_source}", manifests,
                 f"data.eval_manifest={tmp_path / 'other.jsonl'}"]) == 2
    assert capsys.readouterr().err == f"error: manifest {tmp_path / 'other.jsonl'} does not exist\n"


@pytest.mark.parametrize("sweep", [[], ["-m", "seed=1,2"]])
def test_check_overrides_refuses_a_checkpoint_to_resume_from_that_is_not_there(sweep, an4_source, tmp_path, capsys):
    """train.resume=PATH to no file passed the check; every rank refused it after the build and its start."""
    from trainer.check_overrides import main

    absent = tmp_path / "last.pt"
    overrides = [*sweep, "experiment=cpu_demo", f"data.an4_source={an4_source}", f"train.resume={absent}"]
    assert main(overrides) == 2
    job = "sweep job 0 (seed=1): " if sweep else ""
    assert capsys.readouterr().err == f"error: {job}checkpoint not found: {absent} (train.resume)\n"
    absent.write_bytes(b"")  # its content is the run's to check
    assert main(overrides) == 0


@pytest.mark.parametrize("sweep", [False, True])
def test_check_overrides_refuses_a_fresh_run_over_the_checkpoints_its_directory_holds(sweep, an4_source, tmp_path,
                                                                                      monkeypatch, capsys):
    """RUN_NAME of a run that has checkpoints, without train.resume=auto: the check passed, then the build and every
    rank's start, and only then did the ranks refuse it. train.resume=auto continues it, and passes."""
    from trainer.check_overrides import main

    run_dir = tmp_path / "experiment=cpu_demo,seed=1" if sweep else tmp_path
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.pt").write_bytes(b"")
    monkeypatch.setenv("PRNN_AN4", str(an4_source))  # not an override, which would name the sweep's job folders
    overrides = [*(["-m", "seed=1,2", f"hydra.sweep.dir={tmp_path}"] if sweep else [f"hydra.run.dir={tmp_path}"]),
                 "experiment=cpu_demo"]
    assert main(overrides) == 2
    job = "sweep job 0 (seed=1): " if sweep else ""
    assert capsys.readouterr().err == (
        f"error: {job}{run_dir} already holds a run (last.pt in checkpoints/), which starting afresh would overwrite: "
        "continue it with train.resume=auto (or train.resume=PATH), or give this run another run_name (RUN_NAME in "
        "the launch scripts)\n")
    assert main([*overrides, "train.resume=auto"]) == 0


def test_check_overrides_refuses_another_config_flag_given_an_empty_value(capsys):
    """`--config-name "$CONFIG"` with the variable unset: the trainer looks for a primary config named '' on every rank,
    after the build. The tests gave these flags a name alone, and a mutant that refused only a non-empty value passed
    them all."""
    from trainer.check_overrides import main

    assert main(["--config-name", ""]) == 2
    assert capsys.readouterr().err == ("error: --config-name : the launch scripts and their check of the overrides "
                                       "take conf/train.yaml only; choose a recipe with experiment=NAME "
                                       "(conf/experiment/NAME.yaml)\n")


def test_check_overrides_refuses_cuda_graphs_over_cudnn(capsys):
    """Refused by every rank at its start on any device, after the build: a graph cannot capture cuDNN's layers."""
    from trainer.check_overrides import main

    assert main(["experiment=cpu_demo", "model.backend=cudnn", "train.cuda_graphs=true"]) == 2
    assert capsys.readouterr().err == ("error: train.cuda_graphs=true cannot run with model.backend=cudnn, whose "
                                       "packed sequences need their lengths on the host, which a graph cannot "
                                       "capture; use model.backend=persistent or train.cuda_graphs=false\n")


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_check_overrides_help_prints_its_usage(flag, capsys):
    """Hydra's parser only notes the flag: the tool printed nothing and exited 0, as if the overrides had passed."""
    from trainer.check_overrides import main

    assert main([flag]) == 0
    usage = "`python -m trainer.check_overrides [-m] [--world-size N] [overrides...]`: checks"
    assert capsys.readouterr().out.startswith(usage)


def test_check_overrides_refuses_a_bad_flag_in_one_line(capsys):
    """argparse printed its usage block, nine lines of Hydra's flags, before the line saying what it refused."""
    from trainer.check_overrides import main

    for arguments, refusal in [(["--foo", "seed=1"], "unrecognized arguments: --foo"),
                               (["--world-size", "0"], "argument --world-size: must be at least 1, not 0")]:
        with pytest.raises(SystemExit) as refused:
            main(arguments)
        assert refused.value.code == 2
        assert capsys.readouterr().err == f"error: {refusal}\n"


@pytest.mark.parametrize("arguments, asked", [
    (["--cfg", "job"], "--cfg job"), (["-c", "hydra", "seed=1"], "--cfg hydra"), (["--info"], "--info all"),
    (["-i", "searchpath"], "--info searchpath"), (["--hydra-help"], "--hydra-help"),
    (["--shell-completion"], "--shell-completion"),
])
def test_check_overrides_refuses_the_flags_that_print_instead_of_training(arguments, asked, capsys):
    """They passed the check, and a launch script's every rank printed the config (or Hydra's help) and ended."""
    from trainer.check_overrides import main

    assert main(arguments) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err == (f"error: {asked} prints and trains nothing, once on every rank a launch script starts; run "
                           f"python -m trainer {asked} OVERRIDES without the script\n")


def test_check_overrides_refuses_version_once_it_is_printed(capsys):
    from trainer.check_overrides import main

    with pytest.raises(SystemExit) as refused:
        main(["--version"])
    assert refused.value.code == 2
    printed = capsys.readouterr()
    assert printed.out.startswith("Hydra 1.3")
    assert printed.err == "error: --version prints and trains nothing, once on every rank a launch script starts\n"
