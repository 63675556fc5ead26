"""The CUDA sources still compile for Hopper (sm_90a) with nvcc, so CI catches a kernel that no longer builds.

Needs no GPU: one full build of the extension into a temporary directory (about a minute), then an import of it.
"""
import pytest

from prnn_kernels import build


@pytest.mark.skipif(build.cuda_home() is None, reason="no CUDA toolkit (bin/nvcc and cuda_runtime.h): set CUDA_HOME")
def test_extension_compiles_for_hopper(tmp_path):
    module = build.load_extension("90a", str(tmp_path))
    assert {"forward", "backward", "support"} <= set(dir(module))
