"""Shared pytest set-up: the `cuda` marker skips on machines without a GPU, and the AN4 corpus location."""
import os
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


@pytest.fixture(scope="session")
def an4_source() -> Path:
    return find_an4()
