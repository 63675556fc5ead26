"""fp32 matrix products on tensor cores at fp32's accuracy ("3xTF32"), for the persistent fp32 layers' GEMMs.

Each fp32 operand is split into a TF32 high part and a TF32 remainder, and a b = a_hi b_hi + a_hi b_lo + a_lo b_hi is
summed in fp32 (Triton's input_precision="tf32x3"). On Hopper that runs the layers' products 1.5-2x faster than
cuBLAS's fp32 FMAs and closer to float64 (2e-7 against 4-8e-7 relative; csrc/NOTES.md, v22). cuBLAS has no such mode on
Hopper, and plain TF32 (torch.backends.cuda.matmul.allow_tf32) loses three digits.

Triton compiles the kernel, once per device (and caches it on disk); the extension launches it (csrc/products.cpp),
since Triton's own launcher costs the host more per call than the product saves on the GPU. Hopper's tensor cores read
32-bit operands only K-major, so an operand laid out otherwise is first copied so (csrc/k_major_copy.cu).

`matmul_nt(a, b, bias)` is a @ b^T [+ bias]; `input_projection` is a layer's F.linear(input, weight_ih, bias_ih) on
them, with its gradients.
"""
import dataclasses
import functools
import re
import warnings

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Tiling:
    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int


# The tile measured fastest at the layers' shapes (M = T * B ~ 1000, N and K 1152-4608) on an H200 (NOTES.md, "Tried
# after v21 and not kept"), and a smaller one that products.cpp picks where the large tiles would leave SMs idle and
# the small ones fill them in one wave (a short sequence's input gradient: M = T * B ~ 600, N ~ 1600, K ~ 4800).
TILINGS = {"large": Tiling(128, 128, 64, 3, 8), "small": Tiling(64, 128, 64, 4, 4)}
# The kernel's parameters as products.cpp passes them: four pointers, six 32-bit ints, Triton's two scratch pointers.
_PARAMETER_TYPES = ["u64"] * 4 + ["u32"] * 6 + ["u64"] * 2


@functools.lru_cache(maxsize=None)
def _kernel():
    """The Triton kernel, defined on first use so that this module imports where Triton does not."""
    import triton
    import triton.language as tl

    # compile_product compiles it with no assumptions about the values passed (no alignment or divisibility hints),
    # so that one binary serves every shape the C++ launch passes.
    @triton.jit
    def product_kernel(a_ptr, b_ptr, out_ptr, bias_ptr, M, N, K, a_stride, b_stride, out_stride,
                       HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       STAGES: tl.constexpr):
        # Tiles in groups of 8 rows of tiles, so that consecutive CTAs share their b tiles in L2.
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BN)
        group = 8 * tiles_n
        first_m = (pid // group) * 8
        group_m = min(tl.cdiv(M, BM) - first_m, 8)
        pid_m = first_m + (pid % group) % group_m
        pid_n = (pid % group) // group_m
        # TMA descriptors made here, in Triton's global scratch: the launch passes pointers and strides only.
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [a_stride, 1], [BM, BK])
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [b_stride, 1], [BN, BK])
        out_desc = tl.make_tensor_descriptor(out_ptr, [M, N], [out_stride, 1], [BM, BN])
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
            a = a_desc.load([pid_m * BM, k * BK])
            b = b_desc.load([pid_n * BN, k * BK])
            acc = tl.dot(a, b.T, acc, input_precision="tf32x3")
        if HAS_BIAS:
            columns = pid_n * BN + tl.arange(0, BN)
            acc += tl.load(bias_ptr + columns, mask=columns < N, other=0.0)[None, :]
        out_desc.store([pid_m * BM, pid_n * BN], acc)

    return product_kernel


def compile_product(target, has_bias: bool, tiling: Tiling):
    """Triton's compiled product, with or without a bias, for a triton.backends.compiler.GPUTarget; raises
    RuntimeError if its parameters are not the ones products.cpp passes (a Triton that lays them out otherwise)."""
    import triton

    signature = {"a_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*fp32", "bias_ptr": "*fp32", "M": "i32", "N": "i32",
                 "K": "i32", "a_stride": "i32", "b_stride": "i32", "out_stride": "i32", "HAS_BIAS": "constexpr",
                 "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "STAGES": "constexpr"}
    constants = {"HAS_BIAS": has_bias, "BM": tiling.block_m, "BN": tiling.block_n, "BK": tiling.block_k,
                 "STAGES": tiling.stages}
    source = triton.compiler.ASTSource(fn=_kernel(), signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=target, options={"num_warps": tiling.warps})
    entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", compiled.asm["ptx"], re.S)
    parameters = re.findall(r"\.param\s+\.(\w+)", entry.group(1)) if entry else []
    if parameters != _PARAMETER_TYPES or getattr(compiled.metadata, "profile_scratch_size", 0):
        raise RuntimeError(f"prnn_kernels.products: Triton {triton.__version__} compiled the product with parameters "
                           f"{parameters}, not the {_PARAMETER_TYPES} that csrc/products.cpp passes")
    return compiled


def compile_products(capability: int) -> dict:
    """Every variant of the product, with and without a bias in both tilings, compiled for a compute capability
    (e.g. 90): {(has_bias, tiling name): Triton's compiled kernel}. Triton caches them on disk, which is why
    `python -m prnn_kernels.build` calls this ahead of a job."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", capability, 32)
    return {(has_bias, name): compile_product(target, has_bias, tiling)
            for has_bias in (False, True) for name, tiling in TILINGS.items()}


@functools.lru_cache(maxsize=None)
def _loaded(device_index: int):
    """The extension with the product loaded for a CUDA device (with and without a bias, both tilings; Triton caches
    the compiled kernels on disk), or None where it cannot run there: no TMA (compute capability below 9.0), no
    Triton, or a Triton that compiles it otherwise than products.cpp launches it (warned once, naming why)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 9:
        return None
    try:
        import triton  # noqa: F401  (installed with torch's CUDA builds on Linux)
    except ImportError:
        return None
    from prnn_kernels.persistent import _extension

    # Anything that keeps the products from this device leaves the GEMMs to cuBLAS: Triton's compilation errors and
    # an unwritable cache are no RuntimeError, and a device may refuse a kernel's shared memory when it is loaded.
    try:
        compiled = compile_products(major * 10 + minor)
        for (has_bias, name), kernel in compiled.items():
            metadata, tiling = kernel.metadata, TILINGS[name]
            align = getattr(metadata, "global_scratch_align", 1)
            scratch_bytes = -(-getattr(metadata, "global_scratch_size", 0) // align) * align
            _extension().load_product(device_index, has_bias, name == "small", kernel.asm["cubin"], metadata.name,
                                      tiling.block_m, tiling.block_n, tiling.warps, metadata.shared, scratch_bytes)
    except Exception as error:
        warnings.warn(f"prnn_kernels: the fp32 layers' GEMMs run on cuBLAS, not as 3xTF32 products: {error}",
                      stacklevel=3)
        return None
    return _extension()


def supported(*tensors) -> bool:
    """Whether the layers' products of these tensors run here (compiling and loading them on first use): fp32 on a
    CUDA GPU where `_loaded` can load them, and fp32 products asked for at fp32's accuracy
    (torch.backends.cuda.matmul.allow_tf32 off, as by default; with it on, cuBLAS's plain TF32 is faster)."""
    return all(t.is_cuda and t.dtype == torch.float32 for t in tensors) and \
        not torch.backends.cuda.matmul.allow_tf32 and _loaded(tensors[0].device.index) is not None


def matmul_nt(a, b, bias=None, reverse_b_blocks_of=0):
    """a (M, K) @ b (N, K)^T [+ bias (N,)] -> (M, N) fp32 on the current stream, for CUDA fp32 tensors where
    `supported`, in any layout; its rows padded to a multiple of 4 (contiguous where N is a multiple of 4). With
    reverse_b_blocks_of = n, b's K index runs in blocks of n taken in reverse order (a sequence's steps, backwards)."""
    # Off a GPU, before asking for one: _loaded(None) would ask the current GPU's capability, and raise without one.
    extension = _loaded(a.device.index) if a.is_cuda else None
    if extension is None:
        raise RuntimeError(f"prnn_kernels.products: the product does not run on {a.device} (see products.supported)")
    return extension.product(a, b, bias, reverse_b_blocks_of)


def first_order_backward(backward):
    """For an autograd Function's backward that is not itself differentiable (its kernels have no derivative): asked
    for a graph of the gradient (create_graph=True, for a second derivative), it raises. torch's once_differentiable
    raises only where the incoming gradient requires grad, and otherwise hands back a gradient without a graph, whose
    own derivative then came out None (allow_unused) or "not used in the graph"."""
    @functools.wraps(backward)
    def backward_without_graph(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError("prnn_kernels: the persistent backend's gradients have no derivative of their own "
                               "(create_graph=True); run the layer on backend='reference' for a second derivative")
        return backward(ctx, *grads)
    return backward_without_graph


class _InputProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias):
        flat = input.reshape(-1, input.shape[-1])
        ctx.save_for_backward(flat, weight)
        ctx.input_shape, ctx.has_bias = input.shape, bias is not None
        bias = bias.contiguous() if bias is not None else None
        return matmul_nt(flat, weight, bias).contiguous().view(*input.shape[:-1], -1)

    @staticmethod
    @first_order_backward
    def backward(ctx, grad_output):
        flat, weight = ctx.saved_tensors
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = matmul_nt(grad, weight.t()).view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = matmul_nt(grad.t(), flat.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_input, grad_weight, grad_bias


@torch.compiler.disable  # eager under torch.compile, as the recurrence it feeds (persistent._run_layer)
def input_projection(input, weight, bias=None):
    """F.linear(input, weight, bias) for a recurrent layer's input projection: on 3xTF32 products where `supported`
    and outside autocast, F.linear (cuBLAS) everywhere else."""
    parameters = (weight,) if bias is None else (weight, bias)
    if torch.is_autocast_enabled(input.device.type) or not supported(input, *parameters):
        return F.linear(input, weight, bias)
    return _InputProjection.apply(input, weight, bias)
