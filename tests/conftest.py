"""Shared pytest set-up: the `cuda` marker skips on machines without a GPU, and the AN4 corpus location."""
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

# As the trainer does on a CPU: oneDNN's convolution weight gradient corrupts memory on the model's small
# frequency maps (torch 2.14), so CPU tests use ATen's own convolution.
torch.backends.mkldnn.enabled = False


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


def find_an4() -> Path:
    """AN4 lives beside the checkout in ../shared/data/an4; on the device machine it is carried as .data/an4."""
    candidates = [Path(os.environ["PRNN_AN4"])] if "PRNN_AN4" in os.environ else []
    candidates += [REPO_ROOT / ".data" / "an4", REPO_ROOT.parent / "shared" / "data" / "an4"]
    for path in candidates:
        if (path / "etc" / "an4_train.transcription").exists():
            return path
    raise FileNotFoundError(f"AN4 corpus not found; looked in {', '.join(map(str, candidates))} (set PRNN_AN4)")


def wait_for_file(path: Path, job: subprocess.Popen, timeout_s: float) -> None:
    """Returns once `path` exists, while `job` still runs; fails the test if the job ends first."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if job.poll() is not None:
        output = job.communicate()[0] if job.stdout else ""
        pytest.fail(f"the job ended before {path} appeared:\n{(output or '')[-4000:]}")


@pytest.fixture(scope="session")
def an4_source() -> Path:
    return find_an4()
