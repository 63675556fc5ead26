"""Where a job runs, for the run directory's jobs.jsonl and the benchmarks' results: the device, the versions (the
code's commit among them) and the command; and the GPU benchmarks' refusal where there is no GPU."""
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from data.text import counted

REPO_ROOT = Path(__file__).resolve().parent.parent


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({counted(torch.get_num_threads(), 'thread')} per rank)"


def refuse_without_gpu(tool: str) -> bool:
    """Whether no CUDA GPU is visible, having then said so as `tool`'s error; its caller exits 2, as for a usage
    error."""
    if torch.cuda.is_available():
        return False
    print(f"error: {tool} needs a CUDA GPU, and none is visible", file=sys.stderr)
    return True


def versions(device: torch.device) -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__, "commit": source_commit()}
    if device.type == "cuda":
        found.update(
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    return found


def source_commit(root: Path = REPO_ROOT) -> str | None:
    """The git commit the code is at, with "+changes" where its tracked files differ from it; None outside a git
    checkout (or without git), and where the checkout around `root` does not track this code: an installed copy in
    a .venv inside a checkout ran other code than that checkout's commit."""
    try:
        def git(*arguments):
            # --no-optional-locks: status would otherwise refresh the checkout's index under .git/index.lock, which a
            # user's own git command meanwhile fails on and a job killed outright leaves behind.
            return subprocess.run(["git", "--no-optional-locks", "-C", str(root), *arguments], capture_output=True,
                                  text=True, check=True, timeout=30).stdout.strip()

        git("ls-files", "--error-unmatch", "--", "trainer/environment.py")  # this file, tracked at root
        commit = git("rev-parse", "--short=12", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}+changes" if changed else commit


def command_line() -> str:
    """The command that started this process, as typed (`python -m benchmarks.rnn_kernels ...`; sys.argv would name
    the module's file instead)."""
    return shlex.join(["python", *sys.orig_argv[1:]])
