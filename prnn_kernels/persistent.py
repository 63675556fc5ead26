"""The persistent RNN CUDA kernel as a PyTorch function with autograd: `persistent_layer`, and `support` to ask first.

One launch runs a whole layer in one direction: every CTA keeps its rows of weight_hh on chip for the whole
sequence and the CTAs exchange each step's hidden vector through L2 with step-stamped flags (prnn_kernels/csrc).
The backward data gradient runs the same kernel in reverse time on weight_hh^T; the weight and bias gradients are
one GEMM and one sum over all steps afterwards.

Importing this module needs neither a GPU nor a compiler; the extension is built just in time on first use
(prnn_kernels.build).

Errors inside a launch: every spin-wait in the kernel is bounded (SPIN_TIMEOUT_S); a CTA that runs out of time
sets a status word on the device and the launch ends instead of hanging. Reading that word on the host would need a
synchronisation, so it is checked lazily: after each launch (outside CUDA-graph capture) the word is copied to
pinned memory asynchronously, and the next call on that device, or `raise_if_failed()`, raises RuntimeError once the
copy has landed and shows a failure. Under graph capture nothing is copied; call `raise_if_failed()` after replays.
"""
import dataclasses
import functools
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

CELLS = ("relu", "tanh")
DTYPES = (torch.float32, torch.bfloat16)
MAX_BATCH = 16
# Bound on each spin-wait inside the kernel; a step takes microseconds, so seconds mean a launch that cannot progress.
SPIN_TIMEOUT_S = 4.0
# Fill outputs with NaN before each launch so that elements the kernel fails to write show up (tests set this).
POISON_OUTPUTS = False


@dataclasses.dataclass(frozen=True)
class Support:
    """Whether the persistent kernel can run a shape, and if not, why."""

    ok: bool
    reason: str


def support(cell: str, hidden_size: int, batch_size: int, dtype: torch.dtype, device) -> Support:
    """Whether `persistent_layer` (forward and backward) can run this shape; answers on machines without CUDA too.

    On a GPU the answer comes from the kernels' tiling chooser and the device's limits, so the first call builds
    the extension if it is not cached yet. Answers are cached per shape and device.

    Args:
        cell: "relu" | "tanh" ("gru", "lstm" are answered with a reason).
        hidden_size: H.
        batch_size: B.
        dtype: dtype of input_proj (float32 or bfloat16).
        device: where the tensors live.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return Support(False, "needs a CUDA GPU")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _cuda_support(cell, int(hidden_size), int(batch_size), dtype, device.index)


@functools.lru_cache(maxsize=None)
def _cuda_support(cell: str, hidden_size: int, batch_size: int, dtype: torch.dtype, device_index: int) -> Support:
    if cell not in CELLS:
        return Support(False, f"cell {cell!r} has no persistent kernel yet (it runs {', '.join(CELLS)})")
    if dtype not in DTYPES:
        return Support(False, f"dtype {dtype} is unsupported (float32 or bfloat16)")
    if not 1 <= batch_size <= MAX_BATCH:
        return Support(False, f"batch size {batch_size} is out of range (1..{MAX_BATCH})")
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 8:
        return Support(False, f"needs compute capability 8.0 or newer, device {device_index} has {major}.{minor}")
    with torch.cuda.device(device_index):
        ok, reason = _extension().support(hidden_size, batch_size, dtype == torch.bfloat16)
    return Support(ok, reason)


def persistent_layer(cell, input_proj, hx, weight_hh, bias_hh, lengths, reverse):
    """One recurrent layer in one direction on the persistent kernel, with autograd.

    Same signature and function as `prnn_kernels.reference.reference_layer`.

    Args:
        cell: "relu" | "tanh".
        input_proj: (T, B, H) x @ weight_ih^T + bias_ih for every step, float32 or bfloat16 (sets the precision:
            bfloat16 runs bf16 weights and activations with fp32 accumulation and fp32 state).
        hx: (B, H) initial state.
        weight_hh: (H, H) recurrent weights (cast to input_proj's dtype).
        bias_hh: (H,) recurrent bias, or None.
        lengths: (B,) int64 valid steps per sample; on the CPU they are checked to lie in [0, T], on the GPU they
            are clamped to it.
        reverse: run t = T-1 .. 0; a sample's pass starts from hx at its own last valid step.

    Returns:
        output: (T, B, H) in input_proj's dtype, zero at t >= lengths[b].
        h_n: (B, H) in input_proj's dtype, the state after each sample's last valid step (hx where lengths[b] == 0).

    Raises ValueError for shapes the kernel cannot run (see `support`), RuntimeError when a launch failed.
    """
    if input_proj.dim() != 3:
        raise ValueError(f"persistent_layer: input_proj must be (T, B, H), got shape {tuple(input_proj.shape)}")
    num_steps, batch_size, hidden_size = input_proj.shape
    verdict = support(cell, hidden_size, batch_size, input_proj.dtype, input_proj.device)
    if not verdict.ok:
        raise ValueError(f"persistent_layer cannot run cell={cell!r}, hidden {hidden_size}, batch {batch_size}, "
                         f"{input_proj.dtype} on {input_proj.device}: {verdict.reason}")
    expected = {"hx": (batch_size, hidden_size), "weight_hh": (hidden_size, hidden_size), "lengths": (batch_size,)}
    if bias_hh is not None:
        expected["bias_hh"] = (hidden_size,)
    given = {"hx": hx, "weight_hh": weight_hh, "lengths": lengths, "bias_hh": bias_hh}
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            raise ValueError(f"persistent_layer: {name} must have shape {shape}, got {tuple(given[name].shape)}")
    if lengths.device.type == "cpu" and bool(((lengths < 0) | (lengths > num_steps)).any()):
        raise ValueError(f"persistent_layer: lengths must lie in [0, T={num_steps}], got {lengths.tolist()}")
    dtype = input_proj.dtype
    with torch.autocast("cuda", enabled=False):
        return _PersistentLayer.apply(
            cell,
            input_proj.contiguous(),
            hx.to(dtype).contiguous(),
            weight_hh.to(dtype).contiguous(),
            None if bias_hh is None else bias_hh.to(dtype).contiguous(),
            lengths.to(input_proj.device, torch.int64),
            bool(reverse),
        )


def raise_if_failed(device=None) -> None:
    """Waits for the status of the launches so far on `device` and raises RuntimeError if one of them failed."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    _LaunchStatus.of(device).check(wait=True)


class _LaunchStatus:
    """A device's status word, which a failing kernel sets, and its asynchronous copy to the host."""

    _by_device = {}

    def __init__(self, device):
        self.word = torch.zeros(1, dtype=torch.int32, device=device)
        self.host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.copied = torch.cuda.Event()
        self.pending = False

    @classmethod
    def of(cls, device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in cls._by_device:
            cls._by_device[index] = cls(torch.device("cuda", index))
        return cls._by_device[index]

    def after_launch(self):
        if torch.cuda.is_current_stream_capturing():
            return
        self.host.copy_(self.word, non_blocking=True)
        self.copied.record()
        self.pending = True

    def check(self, wait):
        if not self.pending or torch.cuda.is_current_stream_capturing():
            return
        if wait:
            self.copied.synchronize()
        elif not self.copied.query():
            return
        self.pending = False
        code = int(self.host.item())
        if code != 0:
            self.word.zero_()
            self.host.zero_()
            raise RuntimeError(
                f"prnn_kernels: a persistent RNN kernel timed out waiting for another CTA (status {code}); the "
                "results of the launches since the last check are invalid. The GPU may be shared with other work "
                f"that starves the kernel, or SPIN_TIMEOUT_S ({SPIN_TIMEOUT_S}) is too short."
            )


def _timeout_ns() -> int:
    return int(SPIN_TIMEOUT_S * 1e9)


class _PersistentLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cell, input_proj, hx, weight_hh, bias_hh, lengths, reverse):
        status = _LaunchStatus.of(input_proj.device)
        status.check(wait=False)
        output, h_n, state = torch.ops.prnn_kernels.persistent_forward(
            cell, input_proj, hx, weight_hh, bias_hh, lengths, reverse, status.word, _timeout_ns(), POISON_OUTPUTS
        )
        status.after_launch()
        ctx.cell, ctx.reverse, ctx.hx_dtype = cell, reverse, hx.dtype
        ctx.has_bias = bias_hh is not None
        if any(ctx.needs_input_grad[1:5]):
            ctx.save_for_backward(weight_hh, lengths, state)
        return output, h_n

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output, grad_h_n):
        weight_hh, lengths, state = ctx.saved_tensors
        status = _LaunchStatus.of(grad_output.device)
        status.check(wait=False)
        grad_input_proj, grad_hx, grad_state = torch.ops.prnn_kernels.persistent_backward(
            ctx.cell, grad_output.contiguous(), grad_h_n.contiguous(), state, weight_hh, lengths, ctx.reverse,
            status.word, _timeout_ns(), POISON_OUTPUTS,
        )
        status.after_launch()
        num_steps, batch_size, hidden_size = grad_output.shape
        grad_weight = grad_bias = None
        # grad_state[1 + q] is dpre of backward step q, which undid forward processing step T-1-q; that step's input
        # state is state[T-1-q]. Both (T, B, H) in fp32.
        grad_pre = grad_state[1:num_steps + 1, :, :hidden_size].reshape(num_steps * batch_size, hidden_size)
        if ctx.needs_input_grad[3]:
            state_in = state[:num_steps, :, :hidden_size].flip(0).reshape(num_steps * batch_size, hidden_size)
            grad_weight = (grad_pre.t() @ state_in).to(weight_hh.dtype)
        if ctx.needs_input_grad[4] and ctx.has_bias:
            grad_bias = grad_pre.sum(0).to(weight_hh.dtype)
        return None, grad_input_proj, grad_hx.to(ctx.hx_dtype), grad_weight, grad_bias, None, None


def _state_stride(hidden_size):
    return (hidden_size + 3) // 4 * 4


@functools.lru_cache(maxsize=None)
def _extension():
    from prnn_kernels.build import load_extension

    return load_extension()


@torch.library.custom_op("prnn_kernels::persistent_forward", mutates_args=("status",))
def _forward_op(
    cell: str, input_proj: Tensor, hx: Tensor, weight_hh: Tensor, bias_hh: Optional[Tensor], lengths: Tensor,
    reverse: bool, status: Tensor, timeout_ns: int, poison: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(output (T, B, H), h_n (B, H), state (T+1, B, HS) fp32: h entering each processing step, [T] = h_n)."""
    output, h_n, state = _extension().forward(
        cell, input_proj, hx, weight_hh, bias_hh, lengths, reverse, status, timeout_ns, poison
    )
    return output, h_n, state


@_forward_op.register_fake
def _(cell, input_proj, hx, weight_hh, bias_hh, lengths, reverse, status, timeout_ns, poison):
    num_steps, batch_size, hidden_size = input_proj.shape
    state = input_proj.new_empty((num_steps + 1, batch_size, _state_stride(hidden_size)), dtype=torch.float32)
    return torch.empty_like(input_proj), input_proj.new_empty((batch_size, hidden_size)), state


@torch.library.custom_op("prnn_kernels::persistent_backward", mutates_args=("status",))
def _backward_op(
    cell: str, grad_output: Tensor, grad_h_n: Tensor, state: Tensor, weight_hh: Tensor, lengths: Tensor,
    reverse: bool, status: Tensor, timeout_ns: int, poison: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_input_proj (T, B, H), grad_hx (B, H) fp32, grad_state (T+2, B, HS) fp32).

    grad_state[1 + q] is dpre of backward step q.
    """
    grad_input_proj, grad_hx, grad_state = _extension().backward(
        cell, grad_output, grad_h_n, state, weight_hh, lengths, reverse, status, timeout_ns, poison
    )
    return grad_input_proj, grad_hx, grad_state


@_backward_op.register_fake
def _(cell, grad_output, grad_h_n, state, weight_hh, lengths, reverse, status, timeout_ns, poison):
    num_steps, batch_size, hidden_size = grad_output.shape
    grad_hx = grad_output.new_empty((batch_size, hidden_size), dtype=torch.float32)
    grad_state = grad_output.new_empty((num_steps + 2, batch_size, _state_stride(hidden_size)), dtype=torch.float32)
    return torch.empty_like(grad_output), grad_hx, grad_state
