"""The layers' fp32 products on 3xTF32 tensor cores (prnn_kernels.products) against float64: the product over many
shapes, layouts and alignments, the input projection's output and gradients, its fall-backs, and graph capture; and,
without a GPU, that every variant compiles for Hopper with the parameters the extension passes."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from models.cuda_graphs import collector_paused
from prnn_kernels import products
from prnn_kernels.reference import relative_error

CUDA = torch.device("cuda")
# Measured 2.0-2.5e-7 at the layers' shapes, against cuBLAS fp32's 3.7-8.1e-7 (NOTES.md, v22).
TOLERANCE = 1e-6


@pytest.mark.parametrize("has_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("tiling", list(products.TILINGS))
def test_the_product_compiles_for_hopper_with_the_extensions_parameters(has_bias, tiling):
    """Triton compiles the product for sm_90 with its own ptxas into TF32 warpgroup MMAs, with the parameter list
    csrc/products.cpp passes (compile_product raises otherwise)."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    kernel = products.compile_product(GPUTarget("cuda", 90, 32), has_bias, products.TILINGS[tiling])
    assert kernel.asm["cubin"]
    assert "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32" in kernel.asm["ptx"]


def test_compile_products_compiles_every_variant_the_extension_launches(monkeypatch):
    """products.cpp refuses every product on a device where a variant is missing (with and without a bias, in both
    tilings), so the layers' GEMMs would fail on a GPU; each compilation, checked by the test above, is played here."""
    pytest.importorskip("triton")
    monkeypatch.setattr(products, "compile_product", lambda target, has_bias, tiling: (target.arch, has_bias, tiling))
    # Named as products.cpp looks them up (has bias, small tiles), not read from TILINGS: a tiling renamed or left out
    # of TILINGS, which the extension then lacks, passed.
    variants = [(has_bias, name, products.TILINGS[name]) for has_bias in (False, True) for name in ("large", "small")]
    assert products.compile_products(100) == {(has_bias, name): (100, has_bias, tiling)
                                              for has_bias, name, tiling in variants}


def test_a_triton_that_lays_the_parameters_out_otherwise_is_refused(monkeypatch):
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    monkeypatch.setattr(products, "_PARAMETER_TYPES", ["u64"] * 3)
    with pytest.raises(RuntimeError, match=r"compiled the product with parameters \['u64', 'u64', 'u64', 'u64', "
                                           r"'u32'.* not the \['u64', 'u64', 'u64'\] that csrc/products.cpp passes"):
        products.compile_product(GPUTarget("cuda", 90, 32), False, products.TILINGS["large"])


def test_input_projection_off_the_gpu_is_f_linear():
    x, weight, bias = torch.randn(5, 3, 7), torch.randn(6, 7), torch.randn(6)
    assert torch.equal(products.input_projection(x, weight, bias), F.linear(x, weight, bias))
    assert not products.supported(x, weight)


def test_matmul_nt_off_the_gpu_says_where_it_does_not_run():
    # It asked for the current GPU's capability first: "Found no NVIDIA driver" without one, and with one the
    # extension's launch was handed CPU tensors.
    with pytest.raises(RuntimeError, match=r"the product does not run on cpu \(see products.supported\)"):
        products.matmul_nt(torch.randn(3, 4), torch.randn(5, 4))


@pytest.mark.cuda
@pytest.mark.parametrize("rows, columns, depth", [
    (1, 1, 1), (3, 5, 7), (17, 33, 129), (128, 128, 64), (130, 250, 1000), (1024, 2048, 2048), (1000, 3456, 1152),
    (4000, 1152, 3456), (2048, 2048, 1024), (7, 4608, 2),
])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_nt_against_float64(rows, columns, depth, bias):
    generator = torch.Generator(device=CUDA).manual_seed(rows * 7919 + columns * 31 + depth)
    a = torch.randn(rows, depth, device=CUDA, generator=generator)
    b = torch.randn(columns, depth, device=CUDA, generator=generator)
    c = torch.randn(columns, device=CUDA, generator=generator) if bias else None
    expected = a.double() @ b.double().t() + (c.double() if bias else 0)
    actual = products.matmul_nt(a, b, c)
    assert actual.shape == (rows, columns) and actual.stride(1) == 1 and actual.stride(0) % 4 == 0
    assert relative_error(actual.double(), expected) <= TOLERANCE


@pytest.mark.cuda
def test_matmul_nt_with_nothing_to_sum_is_zero_or_the_bias():
    a, b, bias = torch.randn(4, 0, device=CUDA), torch.randn(6, 0, device=CUDA), torch.randn(6, device=CUDA)
    assert torch.equal(products.matmul_nt(a, b), torch.zeros(4, 6, device=CUDA))
    assert torch.equal(products.matmul_nt(a, b, bias), bias.expand(4, 6))


@pytest.mark.cuda
@pytest.mark.parametrize("a_layout", ["k_major", "m_major", "strided", "offset"])
@pytest.mark.parametrize("b_layout", ["k_major", "n_major", "strided", "offset"])
def test_matmul_nt_takes_any_layout(a_layout, b_layout):
    """Operands running along K, read where they lie, and every other layout, copied first: running along M or N
    (k_major_copy.cu), every other element, 4 bytes past an aligned start."""
    generator = torch.Generator(device=CUDA).manual_seed(1)

    def operand(rows, layout):
        depth = 130
        if layout == "k_major":
            return torch.randn(rows, depth, device=CUDA, generator=generator)
        if layout == "strided":
            return torch.randn(rows, 2 * depth, device=CUDA, generator=generator)[:, ::2]
        if layout == "offset":
            return torch.randn(rows * depth + 1, device=CUDA, generator=generator)[1:].view(rows, depth)
        return torch.randn(depth, rows, device=CUDA, generator=generator).t()

    a, b = operand(300, a_layout), operand(250, b_layout)
    expected = a.double() @ b.double().t()
    assert relative_error(products.matmul_nt(a, b).double(), expected) <= TOLERANCE


@pytest.mark.cuda
@pytest.mark.parametrize("steps, batch, b_runs_along_k", [(1, 1, False), (17, 3, False), (256, 4, False),
                                                            (5, 7, True), (3, 40, False)])
def test_matmul_nt_reverses_bs_steps(steps, batch, b_runs_along_k):
    """reverse_b_blocks_of: the weight gradient's g^T h with the steps of h taken backwards, as the copy into the
    product's layout reads them (and where b needs no such copy, through ATen's flip)."""
    generator = torch.Generator(device=CUDA).manual_seed(steps * batch)
    g = torch.randn(steps * batch, 96, device=CUDA, generator=generator)
    h = torch.randn(steps * batch, 72, device=CUDA, generator=generator)
    b = h.t().contiguous() if b_runs_along_k else h.t()
    reversed_h = h.unflatten(0, (steps, batch)).flip(0).flatten(0, 1)
    expected = g.double().t() @ reversed_h.double()
    actual = products.matmul_nt(g.t(), b, reverse_b_blocks_of=batch)
    assert relative_error(actual.double(), expected) <= TOLERANCE


@pytest.mark.cuda
def test_matmul_nt_takes_expanded_rows():
    """A stride of 0 between rows (one input broadcast over the batch) passes the layout test of an operand read in
    place, but is no layout the bulk copies read: it is copied first."""
    row, b = torch.randn(1, 64, device=CUDA), torch.randn(8, 64, device=CUDA)
    expected = row.double() @ b.double().t()
    assert relative_error(products.matmul_nt(row.expand(5, 64), b).double(), expected.expand(5, 8)) <= TOLERANCE


@pytest.mark.cuda
def test_matmul_nt_propagates_nan():
    a, b = torch.randn(64, 32, device=CUDA), torch.randn(48, 32, device=CUDA)
    a[5, 7] = float("nan")
    out = products.matmul_nt(a, b)
    assert out[5].isnan().all() and not out[4].isnan().any()


@pytest.mark.cuda
@pytest.mark.parametrize("steps, batch, inputs, outputs", [(1, 1, 1, 3), (17, 3, 33, 100), (256, 4, 2048, 2048),
                                                           (50, 7, 161, 3456), (150, 4, 2304, 2400)])
@pytest.mark.parametrize("bias", [False, True])
def test_input_projection_and_its_gradients_against_float64(steps, batch, inputs, outputs, bias):
    generator = torch.Generator(device=CUDA).manual_seed(steps + batch + inputs + outputs)
    leaves = [torch.randn(steps, batch, inputs, device=CUDA, generator=generator),
              torch.randn(outputs, inputs, device=CUDA, generator=generator) / inputs ** 0.5,
              torch.randn(outputs, device=CUDA, generator=generator) if bias else None]
    leaves = [None if t is None else t.requires_grad_() for t in leaves]
    grad_output = torch.randn(steps, batch, outputs, device=CUDA, generator=generator)
    actual = products.input_projection(*leaves)
    actual_grads = torch.autograd.grad(actual, [t for t in leaves if t is not None], grad_output)
    expected_leaves = [None if t is None else t.detach().double().requires_grad_() for t in leaves]
    expected = F.linear(*expected_leaves)
    expected_grads = torch.autograd.grad(expected, [t for t in expected_leaves if t is not None], grad_output.double())
    assert relative_error(actual.double(), expected) <= TOLERANCE
    for actual_grad, expected_grad in zip(actual_grads, expected_grads, strict=True):
        assert actual_grad.shape == expected_grad.shape
        assert relative_error(actual_grad.double(), expected_grad) <= TOLERANCE


@pytest.mark.cuda
def test_the_persistent_fp32_layer_runs_its_products_on_them():
    """A bidirectional fp32 layer on the persistent backend: its input projection, that projection's two gradients
    and each direction's recurrent weight gradient are products here, not cuBLAS calls."""
    from prnn_kernels import GRU

    layer = GRU(64, 48, bidirectional=True, backend="persistent").to(CUDA)
    x = torch.randn(20, 4, 64, device=CUDA, requires_grad=True)
    layer(x)[0].sum().backward()  # compiles and loads the products outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        layer(x)[0].sum().backward()
        torch.cuda.synchronize()
    kernels = [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    assert sum(name == "product_kernel" for name in kernels) == 5, kernels


@pytest.mark.cuda
def test_a_product_that_cannot_load_leaves_the_layers_on_cublas(monkeypatch):
    """A Triton that compiles the product otherwise than the extension launches it: a warning that says why, once,
    and the layers' GEMMs on cuBLAS."""
    def refuse(*args):
        raise RuntimeError("Triton 9.9 compiled the product with parameters []")

    monkeypatch.setattr(products, "compile_product", refuse)
    products._loaded.cache_clear()
    try:
        x, weight = torch.randn(6, 2, 16, device=CUDA), torch.randn(24, 16, device=CUDA)
        with pytest.warns(UserWarning, match="GEMMs run on cuBLAS, not as 3xTF32 products: Triton 9.9 compiled"):
            assert not products.supported(x, weight)
        assert torch.equal(products.input_projection(x, weight), F.linear(x, weight))
    finally:
        products._loaded.cache_clear()


@pytest.mark.cuda
def test_with_tf32_matmuls_allowed_the_projection_is_cublas(monkeypatch):
    """A user who turns TF32 on for fp32 products gets cuBLAS's TF32, faster than 3xTF32 and as accurate as asked."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    x, weight = torch.randn(6, 2, 16, device=CUDA), torch.randn(24, 16, device=CUDA)
    assert not products.supported(x, weight)
    assert torch.equal(products.input_projection(x, weight), F.linear(x, weight))


@pytest.mark.cuda
def test_input_projection_under_autocast_is_f_linear():
    x, weight = torch.randn(20, 4, 64, device=CUDA), torch.randn(96, 64, device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = products.input_projection(x, weight)
        assert out.dtype == torch.bfloat16 and torch.equal(out, F.linear(x, weight))


@pytest.mark.cuda
def test_input_projection_replays_from_a_cuda_graph():
    leaves = [torch.randn(64, 4, 256, device=CUDA), torch.randn(768, 256, device=CUDA), torch.randn(768, device=CUDA)]
    leaves = [leaf.requires_grad_() for leaf in leaves]
    upstream = torch.randn(64, 4, 768, device=CUDA)

    def output_and_gradients():
        output = products.input_projection(*leaves)
        return output, *torch.autograd.grad(output, leaves, upstream)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch.cuda.graphs asks
        output_and_gradients()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph):
        captured = output_and_gradients()
    with torch.no_grad():  # fresh values in the captured input buffers
        for tensor in (*leaves, upstream):
            tensor.normal_()
    graph.replay()
    expected_leaves = [leaf.detach().double().requires_grad_() for leaf in leaves]
    expected = F.linear(*expected_leaves)
    expected = expected, *torch.autograd.grad(expected, expected_leaves, upstream.double())
    for actual, wanted in zip(captured, expected, strict=True):
        assert relative_error(actual.double(), wanted) <= TOLERANCE


def test_a_product_that_cannot_be_compiled_here_leaves_the_gemms_to_cublas(monkeypatch):
    """Whatever keeps the products from a device (Triton's own compilation errors, an unwritable cache) falls back;
    a GPU before Hopper, which lacks the TMA the product reads its operands with, does so without trying."""
    def unwritable_cache(capability):
        raise PermissionError("[Errno 13] Permission denied: '/home/user/.triton/cache'")

    monkeypatch.setattr(products, "compile_products", unwritable_cache)
    products._loaded.cache_clear()
    try:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a compilation tried would warn
            assert products._loaded(0) is None
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        with pytest.warns(UserWarning, match="run on cuBLAS, not as 3xTF32 products: .*Permission denied"):
            assert products._loaded(1) is None
    finally:
        products._loaded.cache_clear()
