"""The CUDA sources still compile for Hopper (sm_90a) with nvcc, and the fp32 products with Triton, so CI catches a
kernel that no longer builds.

Needs no GPU: `python -m prnn_kernels.build --arch 90a` into a temporary directory (about a minute), which imports the
extension (registering the operators' CUDA kernels with the dispatcher) and compiles the products.
"""
import pytest
import torch

from prnn_kernels import build
from prnn_kernels import persistent  # noqa: F401  declares the operators the extension registers CUDA kernels for


@pytest.mark.skipif(build.cuda_home() is None, reason="no CUDA toolkit (bin/nvcc and cuda_runtime.h): set CUDA_HOME")
def test_extension_and_products_compile_for_hopper(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build.main(["--arch", "90a"])
    output = capsys.readouterr().out
    assert f"built prnn_kernels_{build.source_hash()}_sm90a from {tmp_path}" in output, output
    assert "compiled the fp32 layers' 3xTF32 products for sm_90 into Triton's cache" in output, output
    module = build.load_extension("90a", verbose=False)  # the build above, from load_extension's cache
    assert {"support", "launch_plans", "load_product", "product"} <= set(dir(module))
    for operator in ("persistent_forward", "persistent_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"prnn_kernels::{operator}", "CUDA")
