"""The persistent RNN CUDA kernels as PyTorch functions with autograd: `persistent_layer` (one direction),
`persistent_bidirectional_layer` (both directions of a layer in one launch), and `support` to ask first.

One launch runs a whole layer: every CTA keeps its rows of weight_hh on chip for the whole sequence (a matrix larger
than the chip partly in L2, read again every step) and the CTAs exchange each step's vector through L2 with a
count of the CTAs' published steps and bulk copies shared within thread-block clusters (prnn_kernels/csrc; Hopper or
newer). Cells: ReLU and tanh RNNs, GRU and LSTM with torch.nn's weight layout and gate order. The backward data
gradient runs the same engine in reverse time on weight_hh^T; the weight and bias gradients are one GEMM and one sum
over all steps afterwards.

Importing this module needs neither a GPU nor a compiler; the extension is built just in time on first use
(prnn_kernels.build).

Errors inside a launch: every wait for the other CTAs' steps is bounded (SPIN_TIMEOUT_S; the only other wait, for the
step's copies within a thread-block cluster, depends on co-resident CTAs that never stop); a CTA that runs out of
time sets a status word on the device, stops waiting, and the launch ends instead of hanging; a sequence length
outside [0, T] sets it too (GPU lengths are not read on the host before a launch). Reading that word on
the host would need a synchronisation, so it is checked lazily: after each launch (outside CUDA-graph capture) the
word is copied to pinned memory asynchronously, and the next call on that device, or `raise_if_failed()`, raises
RuntimeError once the copy has landed and shows a failure. Under graph capture nothing is copied; after replaying
a graph, call `graph_replayed()` (the same lazy check) or `raise_if_failed()` (waits).
"""
import dataclasses
import functools
import numbers

import torch

from prnn_kernels import products
from prnn_kernels.reference import NUM_GATES, checked_layer, checked_lengths

CELLS = tuple(NUM_GATES)
DTYPES = (torch.float32, torch.bfloat16)
MAX_BATCH = 32
# Steps x samples x directions of one call: after each launch one CUDA block per (step, sample, direction) gathers the
# output, the grid counted in an int (csrc/sequence_gather.cu); half of int's range leaves the kernels' int step
# arithmetic room. The binding checks the same limit (kMaxSequenceRows, csrc/persistent_rnn.h).
MAX_SEQUENCE_ROWS = 2**30
# The waits compare a direction's step count, steps x CTAs, in 32 bits (csrc/sync.cuh): past that it would wrap and a
# wait pass early. ReLU at H = 8 runs on 8 CTAs, so 2^29 steps (a 16 GiB input) reach it; no plan has 2^12 CTAs, so
# only a sequence past STEPS_SAFE_ON_ANY_PLAN = 2^20 steps needs its plan asked.
MAX_STEP_COUNT = 2**32 - 1
STEPS_SAFE_ON_ANY_PLAN = 2**20
# Bound on each spin-wait inside the kernel; a step takes microseconds, so seconds mean a launch that cannot progress.
SPIN_TIMEOUT_S = 4.0
# Fill outputs with NaN before each launch so that elements the kernel fails to write show up (tests set this).
POISON_OUTPUTS = False


@dataclasses.dataclass(frozen=True)
class Support:
    """Whether the persistent kernel can run a shape, and if not, why."""

    ok: bool
    reason: str


# Eager under torch.compile (a graph break in the module's forward): traced, it took the extension's loading and the
# answers' cache apart, warning of each to a user who compiles a model.
@torch.compiler.disable
def support(cell: str, hidden_size: int, batch_size: int, dtype: torch.dtype, device) -> Support:
    """Whether `persistent_layer` (forward and backward) can run this shape; answers on machines without CUDA too.

    On a GPU the answer comes from the kernels' tiling chooser and the device's limits, so the first call builds
    the extension if it is not cached yet. Answers are cached per shape and device.

    Args:
        cell: "relu" | "tanh" | "gru" | "lstm".
        hidden_size: H.
        batch_size: B.
        dtype: dtype of input_proj (float32 or bfloat16).
        device: where the tensors live.
    """
    # What no GPU would run comes first, so that a machine without one names it too.
    if cell not in CELLS:
        return Support(False, f"cell {cell!r} is not one of {CELLS}")
    if not isinstance(dtype, torch.dtype):  # a name would read "dtype float32 is unsupported (float32 or ...)"
        return Support(False, f"dtype {dtype!r} is not a torch.dtype (torch.float32 or torch.bfloat16)")
    if dtype not in DTYPES:
        return Support(False, f"dtype {dtype} is unsupported (float32 or bfloat16)")
    for name, size in (("hidden size", hidden_size), ("batch size", batch_size)):
        # int() below would answer for 2 where 2.5 was asked, and a bool for 1.
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            return Support(False, f"{name} {size!r} is not an integer")
    if hidden_size < 1:
        return Support(False, f"hidden size {hidden_size} is out of range (at least 1)")
    if not 1 <= batch_size <= MAX_BATCH:
        return Support(False, f"batch size {batch_size} is out of range (1..{MAX_BATCH}; the modules' batch_slice "
                              "runs a larger batch as slices)")
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return Support(False, "needs a CUDA GPU (compute capability 9.0, Hopper, or newer)")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():  # torch's own check is an assertion without the count
        return Support(False, f"{device} does not exist: the last CUDA GPU this process sees is "
                              f"cuda:{torch.cuda.device_count() - 1}")
    return _cuda_support(cell, int(hidden_size), int(batch_size), dtype, device.index)


@functools.lru_cache(maxsize=None)
def _cuda_support(cell: str, hidden_size: int, batch_size: int, dtype: torch.dtype, device_index: int) -> Support:
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 9:
        return Support(False, f"needs compute capability 9.0 (Hopper) or newer for its bulk copies in thread-block "
                              f"clusters, device {device_index} has {major}.{minor}")
    try:
        extension = _extension()
    except RuntimeError as error:  # no toolkit, a failed build, a damaged cache: "auto" runs cuDNN instead
        return Support(False, f"its CUDA extension is unavailable: {error}")
    with torch.cuda.device(device_index):
        ok, reason = extension.support(cell, hidden_size, batch_size, dtype == torch.bfloat16)
    if not ok and batch_size > 1 and _cuda_support(cell, hidden_size, 1, dtype, device_index).ok:
        # The kernels' reason leads with the weights, which more utterances' vectors leave less room on chip, and does
        # not say that fewer run: where they do, it is the batch to change, not the layer.
        fewer = next(size for size in range(batch_size - 1, 0, -1)
                     if _cuda_support(cell, hidden_size, size, dtype, device_index).ok)
        reason = (f"batch size {batch_size} does not fit on this device, {fewer} does (the modules' batch_slice runs "
                  f"a larger batch as slices): {reason}")
    return Support(ok, reason)


def launch_plans(cell: str, hidden_size: int, batch_size: int, dtype: torch.dtype, device,
                 directions: int = 1) -> list[dict]:
    """How each pass (forward, then backward) of a supported layer of this shape launches on `device`: one dict per
    pass with `directions_in_one_launch`, `ctas_per_direction`, `threads`, `cluster_size` (CTAs sharing each step's
    vector copies), `units_per_cta`, `smem_bytes`, `weight_smem_bytes` (the part of the CTA's weights kept in shared
    memory, 0 where registers hold them all), `weight_l2_bytes` (the part read again from L2 every step, where the
    chip cannot hold the matrix; else 0), `chains` (fp32: 0 for the plain engine, else the chained engine's chains
    of samples, whose steps interleave and are handed off by a sync warpgroup; `threads` counts the compute threads
    only) and `one_cluster` (bf16: the cluster engine, each direction one thread-block cluster of `cluster_size` =
    `ctas_per_direction` CTAs that hand each step off through distributed shared memory); or `ok` False and the
    `reason`."""
    device = torch.device(device)
    verdict = support(cell, hidden_size, batch_size, dtype, device)
    if not verdict.ok:
        raise ValueError(f"the persistent kernel cannot run {cell} H={hidden_size} B={batch_size} {dtype}: "
                         f"{verdict.reason}")
    with torch.cuda.device(device):
        return _extension().launch_plans(cell, int(hidden_size), int(batch_size), dtype == torch.bfloat16,
                                         int(directions))


def directions_run_together(cell: str, hidden_size: int, batch_size: int, dtype: torch.dtype, device) -> bool:
    """Whether `persistent_bidirectional_layer` runs both directions of this shape in one launch (forward and
    backward) rather than one after the other: it does when both directions' CTAs fit on the device at once."""
    if not support(cell, hidden_size, batch_size, dtype, device).ok:
        return False
    plans = launch_plans(cell, hidden_size, batch_size, dtype, device, directions=2)
    return all(plan["directions_in_one_launch"] for plan in plans)


def persistent_layer(cell, input_proj, hx, weight_hh, bias_hh, lengths, reverse):
    """One recurrent layer in one direction on the persistent kernel, with autograd.

    Same signature and function as `prnn_kernels.reference.reference_layer`.

    Args:
        cell: "relu" | "tanh" | "gru" | "lstm".
        input_proj: (T, B, G*H) x @ weight_ih^T + bias_ih for every step, G = NUM_GATES[cell], float32 or bfloat16
            (sets the precision: bfloat16 runs bf16 weights and activations with fp32 accumulation and fp32 state).
        hx: (B, H) initial state; for "lstm" a tuple (h0, c0).
        weight_hh: (G*H, H) recurrent weights, cast to input_proj's dtype for the kernel; their gradient comes back in
            their own dtype, from fp32 sums (fp32 master weights of a bf16 layer get it unrounded).
        bias_hh: (G*H,) recurrent bias in weight_hh's dtype, or None.
        lengths: (B,) integers (a tensor or a sequence), the valid steps per sample in [0, T]: on the CPU checked
            before the launch (ValueError), on the GPU by the kernel (RuntimeError at the next check, as for a timeout).
        reverse: run t = T-1 .. 0; a sample's pass starts from hx at its own last valid step.

    Returns:
        output: (T, B, H) in input_proj's dtype, zero at t >= lengths[b].
        h_n: (B, H) in input_proj's dtype, the state after each sample's last valid step (hx where lengths[b] == 0);
            for "lstm" a tuple (h_n, c_n).

    Raises ValueError for shapes the kernel cannot run (see `support`), for more than MAX_SEQUENCE_ROWS steps x
    samples x directions and for steps x CTAs past MAX_STEP_COUNT; RuntimeError when a launch failed.
    """
    output, (final_state,) = _run_layer(cell, input_proj, [hx], [weight_hh], [bias_hh], lengths, reverse)
    return output, final_state


def persistent_bidirectional_layer(cell, input_proj, hx, weight_hh, bias_hh, lengths):
    """Both directions of one bidirectional layer, in one launch when their CTAs fit on the device together.

    Args:
        cell: as persistent_layer.
        input_proj: (T, B, 2*G*H): the forward direction's gate inputs, then the reverse direction's (one GEMM of
            the two weight_ih stacked).
        hx, weight_hh, bias_hh: pairs (forward direction, reverse direction) of what persistent_layer takes; the
            biases are both None or both tensors.
        lengths: as persistent_layer.

    Returns:
        output: (T, B, 2*H) as torch.nn lays out a bidirectional layer (forward direction's h first).
        final states: the pair (forward, reverse) of what persistent_layer returns as h_n.
    """
    bias_hh = (None, None) if bias_hh is None else bias_hh
    if not all(isinstance(pair, tuple | list) and len(pair) == 2 for pair in (hx, weight_hh, bias_hh)):
        raise ValueError("persistent_bidirectional_layer: hx, weight_hh and bias_hh must each be a pair (forward "
                         "direction, reverse direction; bias_hh may be None)")
    if (bias_hh[0] is None) != (bias_hh[1] is None):
        raise ValueError("persistent_bidirectional_layer: give both biases or neither")
    output, final_states = _run_layer(cell, input_proj, list(hx), list(weight_hh), list(bias_hh), lengths, False)
    return output, tuple(final_states)


# Eager under torch.compile (a graph break there): its tracer cannot follow the launch status's CUDA events.
@torch.compiler.disable
def _run_layer(cell, input_proj, hx, weight_hh, bias_hh, lengths, reverse):
    """D = len(weight_hh) directions of one layer; direction 0 runs reversed if `reverse`, direction 1 the other
    way. Returns output (T, B, D*H) and a list of D final states."""
    num_directions = len(weight_hh)
    # Before the support query, which would answer for the H a width rounds down to (without a GPU: needs one).
    hidden_size, states = checked_layer("persistent_layer", cell, input_proj, hx, weight_hh, bias_hh)
    num_steps, batch_size, _ = input_proj.shape
    if num_steps * batch_size * num_directions > MAX_SEQUENCE_ROWS:
        raise ValueError(f"persistent_layer: steps T x samples B x directions = {num_steps} x {batch_size} x "
                         f"{num_directions} = {num_steps * batch_size * num_directions} rows, above the kernels' "
                         f"{MAX_SEQUENCE_ROWS}; run fewer samples at once (batch_slice) or shorter sequences")
    # Before the support query too, which builds the extension on first use (a minute) or, without a GPU, refuses.
    signed = checked_lengths("persistent_layer", lengths, batch_size, num_steps, shortest=0)
    verdict = support(cell, hidden_size, batch_size, input_proj.dtype, input_proj.device)
    if not verdict.ok:
        raise ValueError(f"persistent_layer cannot run cell={cell!r}, hidden {hidden_size}, batch {batch_size}, "
                         f"{input_proj.dtype} on {input_proj.device}: {verdict.reason}")
    if num_steps > STEPS_SAFE_ON_ANY_PLAN:
        plans = launch_plans(cell, hidden_size, batch_size, input_proj.dtype, input_proj.device, num_directions)
        # Each direction counts its own CTAs; the cluster engine hands steps off through shared memory, uncounted.
        ctas = max((plan["ctas_per_direction"] for plan in plans if plan["ok"] and not plan["one_cluster"]), default=0)
        if (num_steps + 1) * ctas > MAX_STEP_COUNT:
            raise ValueError(f"persistent_layer: T={num_steps} steps x {ctas} CTAs overflow the kernels' 32-bit step "
                             "counts; run shorter sequences")
    dtype = input_proj.dtype
    hx_stacked = torch.stack([state[0] for state in states]).to(dtype)
    cx_stacked = torch.stack([state[1] for state in states]).to(dtype) if cell == "lstm" else None
    parameters = list(weight_hh) + [b for b in bias_hh if b is not None]
    with torch.autocast("cuda", enabled=False):
        output, h_n, c_n = _PersistentLayer.apply(
            cell, bool(reverse), num_directions, input_proj.contiguous(), hx_stacked, cx_stacked,
            signed.to(input_proj.device).contiguous(), *parameters,
        )
    finals = [(h_n[d], c_n[d]) if cell == "lstm" else h_n[d] for d in range(num_directions)]
    return output, finals


def raise_if_failed(device=None) -> None:
    """Waits for the launches so far on `device`, on every stream, CUDA-graph replays included, and raises
    RuntimeError if one of them failed. Off a GPU (a CPU device, a machine without CUDA) no launch ran: it returns."""
    # Code that runs on whichever device there is calls it there too: it raised torch's "Found no NVIDIA driver".
    if not torch.cuda.is_available() or device is not None and torch.device(device).type != "cuda":
        return
    status = _LaunchStatus.of(device)
    torch.cuda.synchronize(status.word.device)  # launches on other streams than the caller's
    status.after_launch()  # a fresh copy of the word: launches replayed from a graph made none of their own
    status.check(wait=True)


def graph_replayed(device=None) -> None:
    """Call after replaying a CUDA graph that holds persistent launches on `device`: raises RuntimeError if an
    earlier launch's status has reached the host showing a failure, then copies the status word asynchronously, so
    that the next launch, the next call of this function or `raise_if_failed()` reports a failure in the replay.
    Unlike `raise_if_failed()` it never waits for the GPU."""
    status = _LaunchStatus.of(device)
    status.check(wait=False)
    status.after_launch()


class _LaunchStatus:
    """A device's status word, which a failing kernel sets, and its asynchronous copy to the host."""

    _by_device = {}

    def __init__(self, device):
        # Normal tensors even where the first launch runs under inference_mode: its tensors could not be written
        # outside it, and every later launch would fail.
        with torch.inference_mode(False):
            self.word = torch.zeros(1, dtype=torch.int32, device=device)
            self.host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.copied = torch.cuda.Event()
        self.pending = False

    @classmethod
    def of(cls, device=None):
        """The status of `device` (a CUDA device, its index or name; None or no index: the current device)."""
        device = torch.device("cuda") if device is None else torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in cls._by_device:
            cls._by_device[index] = cls(torch.device("cuda", index))
        return cls._by_device[index]

    def after_launch(self):
        with torch.cuda.device(self.word.device):  # its stream and event, whichever GPU is current
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
            raise RuntimeError(f"prnn_kernels: {_FAILURES.get(code, f'unknown status {code}')}; the results of the "
                               "launches since the last check are invalid.")


# The kernels' status codes (kStatus* in csrc/persistent_rnn.h) and what each means to a user.
_FAILURES = {
    1: "a persistent RNN kernel timed out waiting for another CTA (status 1). The GPU may be shared with other work "
       f"that starves the kernel, or SPIN_TIMEOUT_S ({SPIN_TIMEOUT_S}) is too short",
    2: "a persistent RNN kernel was given a sequence length outside [0, T] (status 2): lengths on the GPU are not "
       "checked before the launch, so pass lengths with 0 <= lengths[b] <= T, the input's number of steps",
}


def _timeout_ns() -> int:
    return int(SPIN_TIMEOUT_S * 1e9)


class _PersistentLayer(torch.autograd.Function):
    """D directions of one layer: inputs (cell, reverse, D, input_proj, hx (D, B, H), cx (D, B, H) or None, lengths,
    D weight_hh, then D bias_hh or none); outputs (output (T, B, D*H), h_n (D, B, H), c_n (D, B, H) or empty).

    The parameters may come in another dtype than input_proj's (fp32 master weights of a bf16 layer under autocast):
    they are cast in here, and their gradients leave in their own dtype straight from the fp32 GEMM and sum, rather
    than rounded to the layer's dtype and cast back by autograd nodes outside."""

    @staticmethod
    def forward(ctx, cell, reverse, num_directions, input_proj, hx, cx, lengths, *parameters):
        ctx.parameter_dtype = parameters[0].dtype  # torch.nn's layers keep one dtype for all their parameters
        parameters = [parameter.to(input_proj.dtype).contiguous() for parameter in parameters]
        weight_hh, bias_hh = parameters[:num_directions], parameters[num_directions:]
        _extension()  # loaded before the first call: it holds the operators' CUDA kernels
        status = _LaunchStatus.of(input_proj.device)
        status.check(wait=False)
        output, h_n, c_n, state, saved = torch.ops.prnn_kernels.persistent_forward(
            cell, input_proj, hx, cx, weight_hh, bias_hh, lengths, reverse, status.word, _timeout_ns(),
            POISON_OUTPUTS,
        )
        status.after_launch()
        ctx.cell, ctx.reverse, ctx.num_directions, ctx.hx_dtype = cell, reverse, num_directions, hx.dtype
        ctx.has_bias = bool(bias_hh)
        ctx.save_for_backward(lengths, state, saved, *weight_hh)
        if cell != "lstm":
            ctx.mark_non_differentiable(c_n)
        return output, h_n, c_n

    @staticmethod
    @products.first_order_backward
    def backward(ctx, grad_output, grad_h_n, grad_c_n):
        lengths, state, saved, *weight_hh = ctx.saved_tensors
        lstm = ctx.cell == "lstm"
        status = _LaunchStatus.of(grad_output.device)
        status.check(wait=False)
        grad_input_proj, grad_hx, grad_cx, grad_state = torch.ops.prnn_kernels.persistent_backward(
            ctx.cell, grad_output.contiguous(), grad_h_n.contiguous(), grad_c_n.contiguous() if lstm else None, state,
            saved, weight_hh, lengths, ctx.reverse, status.word, _timeout_ns(), POISON_OUTPUTS,
        )
        status.after_launch()
        num_steps, batch_size, _ = grad_output.shape
        gate_rows, hidden_size = weight_hh[0].shape
        # grad_state[d, 1 + q] is g of backward step q, which undid forward processing step T-1-q; that step's input
        # state is state[d, T-1-q]. Both (D, T, B, .) in fp32.
        grad_pre = grad_state[:, 1:num_steps + 1, :, :gate_rows].reshape(ctx.num_directions, -1, gate_rows)
        dtype = weight_hh[0].dtype
        if dtype == torch.float32 and products.supported(grad_pre):
            # On tensor cores at fp32's accuracy (NOTES.md, v22); the copy into the product's operand layout takes
            # the states' steps in reverse.
            states = state[:, :num_steps].reshape(ctx.num_directions, -1, state.shape[-1])[..., :hidden_size]
            grad_weights = [products.matmul_nt(g.t(), h.t(), reverse_b_blocks_of=batch_size)
                            for g, h in zip(grad_pre, states)]
        else:
            state_in = state[:, :num_steps, :, :hidden_size].flip(1).reshape(ctx.num_directions, -1, hidden_size)
            # A bf16 layer's GEMM takes g and h in bf16, as its recurrence's own products do, and accumulates in
            # fp32: on tensor cores rather than fp32 FMAs, 3-8x faster with the casts (NOTES.md, v20). One batched
            # GEMM covers every direction.
            grad_weights = torch.bmm(grad_pre.to(dtype).transpose(1, 2), state_in.to(dtype), out_dtype=torch.float32)
        grad_weights = [grad_weight.to(ctx.parameter_dtype) for grad_weight in grad_weights]
        grad_biases = grad_pre.sum(1).to(ctx.parameter_dtype).unbind(0) if ctx.has_bias else ()
        grad_cx = grad_cx.to(ctx.hx_dtype) if lstm else None
        return (None, None, None, grad_input_proj, grad_hx.to(ctx.hx_dtype), grad_cx, None, *grad_weights,
                *grad_biases)


def _round_up_4(size):
    return (size + 3) // 4 * 4


def _extension():
    """The compiled extension; loading it registers the operators' CUDA kernels (binding.cpp) with the dispatcher."""
    extension, error = _built_extension()
    if error is not None:
        raise RuntimeError(error)
    return extension


@functools.lru_cache(maxsize=None)
def _built_extension():
    """(extension, None), or (None, why not): a build that failed once is not tried again by the same process, as it
    can take a minute to fail."""
    from prnn_kernels.build import load_extension

    try:
        return load_extension(), None
    except RuntimeError as error:
        return None, str(error)


# The operators are declared here so that they exist, with shapes for tracing (register_fake), on machines without
# CUDA; their CUDA kernels are C++ (binding.cpp), called through the dispatcher with no Python in between.
_LIBRARY = torch.library.Library("prnn_kernels", "DEF")
_LIBRARY.define(
    "persistent_forward(str cell, Tensor input_proj, Tensor hx, Tensor? cx, Tensor[] weight_hh, Tensor[] bias_hh, "
    "Tensor lengths, bool reverse, Tensor(a!) status, int timeout_ns, bool poison) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_LIBRARY.define(
    "persistent_backward(str cell, Tensor grad_output, Tensor grad_h_n, Tensor? grad_c_n, Tensor state, "
    "Tensor saved, Tensor[] weight_hh, Tensor lengths, bool reverse, Tensor(a!) status, int timeout_ns, bool poison) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)


@torch.library.register_fake("prnn_kernels::persistent_forward")
def _(cell, input_proj, hx, cx, weight_hh, bias_hh, lengths, reverse, status, timeout_ns, poison):
    """(output (T, B, D*H), h_n (D, B, H), c_n (D, B, H) or empty, state (D, T+1, B, HS) fp32: h entering each
    processing step, [T] = h_n; saved (D, T, B, V, H) fp32 gate values for the backward, or empty)."""
    num_directions, batch_size, hidden_size = hx.shape
    num_steps = input_proj.shape[0]
    saved_values = _SAVED_VALUES[cell]
    output = input_proj.new_empty((num_steps, batch_size, num_directions * hidden_size))
    c_n = hx.new_empty(hx.shape if cell == "lstm" else (0,))
    state = input_proj.new_empty((num_directions, num_steps + 1, batch_size, _round_up_4(hidden_size)),
                                 dtype=torch.float32)
    saved_shape = (num_directions, num_steps, batch_size, saved_values, hidden_size) if saved_values else (0,)
    saved = input_proj.new_empty(saved_shape, dtype=torch.float32)
    return output, torch.empty_like(hx), c_n, state, saved


@torch.library.register_fake("prnn_kernels::persistent_backward")
def _(cell, grad_output, grad_h_n, grad_c_n, state, saved, weight_hh, lengths, reverse, status, timeout_ns, poison):
    """(grad_input_proj (T, B, D*G*H), grad_hx (D, B, H) fp32, grad_cx (D, B, H) fp32 or empty,
    grad_state (D, T+2, B, GS) fp32: [d, 1 + q] is g of backward step q)."""
    num_directions, batch_size, hidden_size = grad_h_n.shape
    num_steps = grad_output.shape[0]
    gate_rows = NUM_GATES[cell] * hidden_size
    grad_input_proj = grad_output.new_empty((num_steps, batch_size, num_directions * gate_rows))
    grad_hx = grad_output.new_empty(grad_h_n.shape, dtype=torch.float32)
    grad_cx = grad_output.new_empty(grad_h_n.shape if cell == "lstm" else (0,), dtype=torch.float32)
    grad_state = grad_output.new_empty((num_directions, num_steps + 2, batch_size, _round_up_4(gate_rows)),
                                       dtype=torch.float32)
    return grad_input_proj, grad_hx, grad_cx, grad_state


# fp32 values per (step, sample, unit) the forward pass saves for the backward (csrc/persistent_rnn.h).
_SAVED_VALUES = {"relu": 0, "tanh": 0, "gru": 4, "lstm": 6}
