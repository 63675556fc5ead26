"""The CUDA sources still compile for Hopper (sm_90a) with nvcc, so CI catches a kernel that no longer builds.

Needs no GPU: one full build of the extension into a temporary directory (about a minute), then an import of it,
which registers the operators' CUDA kernels with the dispatcher.
"""
import pytest
import torch

from prnn_kernels import build
from prnn_kernels import persistent  # noqa: F401  declares the operators the extension registers CUDA kernels for


@pytest.mark.skipif(build.cuda_home() is None, reason="no CUDA toolkit (bin/nvcc and cuda_runtime.h): set CUDA_HOME")
def test_extension_compiles_for_hopper(tmp_path):
    module = build.load_extension("90a", str(tmp_path))
    assert {"support", "launch_plans"} <= set(dir(module))
    for operator in ("persistent_forward", "persistent_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"prnn_kernels::{operator}", "CUDA")
