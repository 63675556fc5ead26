"""Shared pytest set-up: the `cuda` marker skips on machines without a GPU, the AN4 corpus and manifests cut from it,
the small trainer configuration the training runs use, the mpiexec that multi-rank jobs start under, how a test
finds a trainer's data-loading workers and whether a process still runs, how it runs a command that file permissions
hold for, as root too, the trainer's config composed as Hydra composes it, a small checkpoint of an untrained model,
bf16 autocast on the CPU and a model that notes whether it ran under it, Ctrl-C taken however pytest was started, a
deadline for a read that may wait for ever, and the benchmarks' JSON written outside the checkout."""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from data.manifest import read_manifest, write_manifest
from data.prepare import prepare_an4
from trainer import build, checkpoint
from trainer.cli import RESULTS_FOLDER_VARIABLE

REPO_ROOT = Path(__file__).resolve().parent.parent
# The test extra's MPICH installs mpiexec beside the interpreter, which need not be on PATH.
MPIEXEC = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (the `test` extra installs MPICH)")

# Trainer overrides for a small model that learns AN4 words on a CPU in minutes.
TINY = [
    "device=cpu", "model.depth=2", "model.hidden=128", "model.conv_channels=8", "model.backend=reference",
    "data.features.kind=mel", "data.features.n_mels=40", "train.amp=none", "train.num_workers=0",
    "train.progress_bar=false", "train.global_batch_size=8", "data.augment.enabled=false", "optim.warmup_steps=10",
]

# A benchmark run without --json writes a new file into benchmarks/results/ of the checkout: the tests' go to a folder
# of their own, removed at the end. Set here, as the tests are collected, not in a fixture: a test module's environment
# for its jobs (test_distributed.JOB_ENV) is copied from os.environ as the module is imported.
BENCHMARK_RESULTS = tempfile.mkdtemp(prefix="benchmark-results-")
os.environ[RESULTS_FOLDER_VARIABLE] = BENCHMARK_RESULTS


def pytest_unconfigure(config):
    shutil.rmtree(BENCHMARK_RESULTS, ignore_errors=True)


# As the trainer does on a CPU: oneDNN's convolution weight gradient corrupts memory on the model's small
# frequency maps (torch 2.14), so CPU tests use ATen's own convolution.
torch.backends.mkldnn.enabled = False

# The Ctrl-C tests press it as a terminal does for its foreground job. Started in the background (`make test &`, nohup,
# a CI runner), pytest inherits Ctrl-C ignored and hands that on to every trainer it starts, which then keeps
# ignoring it (data.cli.ctrl_c_ignored), so those tests waited for an answer that never came.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture
def no_tf32():
    """fp32 convolutions in fp32. cuDNN's default TF32 rounds them to 10 mantissa bits: padding that changes a shape
    and so cuDNN's algorithm moves the loss by ~1e-3, and gradients 1e-6 apart upstream reach the convolution
    weights' gradients 1e-5 to 1e-4 apart."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = saved


def find_an4() -> Path:
    """AN4 lives beside the checkout in ../shared/data/an4; on the device machine it is carried as .data/an4."""
    candidates = [Path(os.environ["PRNN_AN4"])] if "PRNN_AN4" in os.environ else []
    candidates += [REPO_ROOT / ".data" / "an4", REPO_ROOT.parent / "shared" / "data" / "an4"]
    for path in candidates:
        if (path / "etc" / "an4_train.transcription").exists():
            return path
    raise FileNotFoundError(f"AN4 corpus not found; looked in {', '.join(map(str, candidates))} (set PRNN_AN4)")


class StillRunning(Exception):
    """Not TimeoutError, an OSError, which the code under test may take for a file it cannot read."""


@contextlib.contextmanager
def within_seconds(seconds: int):
    """StillRunning where the block is still running after `seconds`: a read of a pipe that no one writes ends there
    (SIGALRM interrupts the wait), where it waited for ever."""
    def timed_out(number, frame):
        raise StillRunning(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def wait_for_file(path: Path, job: subprocess.Popen, timeout_s: float) -> None:
    """Returns once `path` exists, while `job` still runs; fails the test if the job ends first, or ends the job and
    fails it if `path` has not appeared within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if job.poll() is not None:
        output = job.communicate()[0] if job.stdout else ""
        pytest.fail(f"the job ended before {path} appeared:\n{(output or '')[-4000:]}")
    if not path.exists():
        job.kill()
        pytest.fail(f"{path} did not appear within {timeout_s} s")


def without_root_privilege(command: list[str]) -> list[str]:
    """`command` run so that file permissions hold for it: as root, without its power to read and enter anything."""
    if os.geteuid() != 0:
        return command
    if shutil.which("setpriv") is None:
        pytest.skip("root, and no setpriv to drop its power over file permissions")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]


def error_without_root_privilege(function: str, error: str, path: Path) -> str:
    """The message of `error` ("module.Name", or a built-in's name) that `function` ("module.name") raises given
    `path`, in a process for which file permissions hold (without_root_privilege); nothing where it raises none."""
    modules = {name.rpartition(".")[0] for name in (function, error)} - {""}
    script = (f"import sys, {', '.join(sorted(modules))}\ntry:\n    {function}(sys.argv[1])\n"
              f"except {error} as error:\n    print(error, end='')\n")
    result = subprocess.run(without_root_privilege([sys.executable, "-c", script, str(path)]), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def raw_control_characters(text: str) -> list[str]:
    """What data.manifest.printable escapes in a message, left in `text` as it is."""
    return [char for char in text if unicodedata.category(char) in ("Cc", "Cf", "Cs", "Zl", "Zp")]


def wait_for_text(path: Path, text: str, job: subprocess.Popen, timeout_s: float = 600) -> None:
    """Returns once `path` holds `text`, or `job` has ended (the test's assertions then say why); ends the job and
    fails the test where neither happens within `timeout_s`, rather than waiting for ever on a trainer that stopped
    writing."""
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text() and job.poll() is None:
        if time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"{path} did not hold {text!r} within {timeout_s} s")
        time.sleep(0.02)


def data_loading_workers(pid: int) -> set[int]:
    """The pids of trainer process `pid`'s children: its data-loading workers."""
    listed = subprocess.run(["ps", "--ppid", str(pid), "-o", "pid="], capture_output=True, text=True).stdout
    return {int(child) for child in listed.split()}


def running(pid: int) -> bool:
    """Whether process `pid` has not ended: a zombie has, only its exit status left for its parent to read."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.fixture(scope="session")
def an4_source() -> Path:
    return find_an4()


@pytest.fixture(scope="session")
def an4_train(an4_source, tmp_path_factory):
    """AN4's training utterances, from manifests prepared once per test session."""
    return read_manifest(prepare_an4(an4_source, tmp_path_factory.mktemp("manifests"))["train"])


def write_slice(path: Path, utterances) -> Path:
    """Writes `utterances` as a manifest at `path` and returns it."""
    write_manifest(path, utterances)
    return path


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


class NotesAutocast(torch.nn.Module):
    """A model that notes, at each forward, whether it ran under CPU autocast. With build.uses_amp told to take bf16
    on the CPU (cpu_takes_bf16), the tests of a CPU see whether a pass ran under the autocast train.amp asks for."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.under_autocast = []

    def forward(self, *args, **kwargs):
        self.under_autocast.append(torch.is_autocast_enabled("cpu"))
        return self.model(*args, **kwargs)


@pytest.fixture
def cpu_takes_bf16(monkeypatch):
    """bf16 autocast on the CPU, as on a GPU (build.uses_amp): what no CPU run of the trainer does."""
    monkeypatch.setattr(build, "uses_amp", lambda amp, device: amp == "bf16")


def small_checkpoint(path, *overrides: str):
    """A checkpoint of a small untrained model (what from_checkpoint reads), under `overrides`."""
    cfg = compose_config(["model.depth=1", "model.hidden=16", "model.conv_channels=2", "data.features.kind=mel",
                          "data.features.n_mels=40", *overrides])
    network = build.model(cfg.model, build.features(cfg.data).num_features)
    checkpoint.save(path, {"model": network.state_dict(), "config": OmegaConf.to_container(cfg, resolve=True)})
    return path
