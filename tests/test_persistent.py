"""persistent_layer against the float64 reference: outputs and every gradient over many shapes, the refusals, a launch
that times out, CUDA-graph capture and the custom ops' registration (opcheck)."""
import contextlib
import importlib
import math
import pathlib
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.cuda_graphs import collector_paused
import prnn_kernels
from prnn_kernels import build, modules, persistent, products
from prnn_kernels.persistent import (
    directions_run_together,
    launch_plans,
    persistent_bidirectional_layer,
    persistent_layer,
    support,
)
from prnn_kernels.reference import NUM_GATES, reference_layer, relative_error

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
CUDA = torch.device("cuda")


def test_support_without_cuda_says_why():
    verdict = support("relu", 2048, 4, torch.float32, "cpu")
    assert not verdict.ok and verdict.reason == "needs a CUDA GPU (compute capability 9.0, Hopper, or newer)"
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        launch_plans("relu", 2048, 4, torch.float32, "cpu")
    # What no GPU would run is named first, with or without one.
    assert "is not one of" in support("conv", 256, 4, torch.float32, "cpu").reason
    assert "batch size 33" in support("relu", 256, 33, torch.float32, "cpu").reason
    # float64 too: answered as fp32, "auto" would take the kernel for a float64 layer, which its binding refuses.
    for dtype in (torch.float16, torch.float64, torch.int32):
        assert support("gru", 256, 4, dtype, "cpu").reason == f"dtype {dtype} is unsupported (float32 or bfloat16)"
    # A dtype's name, which read "dtype float32 is unsupported (float32 or bfloat16)".
    for name in ("float32", np.float32):
        reason = f"dtype {name!r} is not a torch.dtype (torch.float32 or torch.bfloat16)"
        assert support("gru", 256, 4, name, "cpu").reason == reason


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)], ids=["current", "0", "1"])
def test_support_for_a_cuda_device_on_a_machine_without_one_says_why(device, monkeypatch):
    """A config or benchmark that names the GPU, run where there is none (faked here, so that a GPU machine asks the
    same): the query answers why, not torch's "Found no NVIDIA driver" from asking which GPU is current."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    verdict = support("gru", 256, 4, torch.float32, device)
    assert not verdict.ok and verdict.reason == "needs a CUDA GPU (compute capability 9.0, Hopper, or newer)"


def test_raise_if_failed_off_a_gpu_has_no_launch_to_check():
    # A loop that trains on whichever device there is calls it there too: it raised "Found no NVIDIA driver".
    persistent.raise_if_failed("cpu")
    persistent.raise_if_failed(torch.device("cpu"))
    if not torch.cuda.is_available():
        persistent.raise_if_failed()


@pytest.mark.parametrize("hidden_size, batch_size, reason", [
    (0, 4, "hidden size 0 is out of range (at least 1)"), (-5, 4, "hidden size -5 is out of range (at least 1)"),
    (256.0, 4, "hidden size 256.0 is not an integer"), (256, 2.5, "batch size 2.5 is not an integer"),
    (256, True, "batch size True is not an integer"),
    (256, 0, "batch size 0 is out of range (1..32; the modules' batch_slice runs a larger batch as slices)")])
def test_support_names_sizes_no_gpu_runs_before_asking_for_one(hidden_size, batch_size, reason):
    # A machine without a GPU answered "needs a CUDA GPU" for these, and one with a GPU ran int() on them: hidden
    # 256.0 and batch 2.5 were answered as the shapes of 256 and 2.
    assert support("gru", hidden_size, batch_size, torch.float32, "cpu") == persistent.Support(False, reason)
    assert support("gru", 256, np.int64(4), torch.float32, "cpu").reason.startswith("needs a CUDA GPU")


@pytest.mark.cuda
def test_support_names_a_gpu_index_this_process_does_not_see():
    # torch's own check was an AssertionError, "Invalid device id".
    missing = torch.device("cuda", torch.cuda.device_count())
    assert support("relu", 256, 4, torch.float32, missing) == persistent.Support(
        False, f"{missing} does not exist: the last CUDA GPU this process sees is cuda:{torch.cuda.device_count() - 1}")


def test_a_gpu_index_past_those_seen_is_refused_naming_the_last_one_seen(monkeypatch):
    # A process that sees one GPU (faked here; the CUDA test above asks the real one) answered "1 CUDA GPU(s)".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert support("relu", 256, 4, torch.float32, "cuda:1").reason == (
        "cuda:1 does not exist: the last CUDA GPU this process sees is cuda:0")


def test_the_layer_names_an_input_projection_of_no_hidden_size_before_asking_for_a_gpu():
    # A width of 7 is no GRU's 3 x H: it was asked about as H = 2, and without a GPU refused as needing one.
    with pytest.raises(ValueError, match="input_proj's last dimension 7 is not 1 x 3 gates x H"):
        persistent_layer("gru", torch.randn(3, 2, 7), torch.zeros(2, 2), torch.zeros(6, 2), None, [3, 3], False)


@pytest.fixture
def hopper_without_its_extension(monkeypatch):
    """torch.cuda answers as on a Hopper GPU, and building the extension fails as it does without a CUDA toolkit;
    counts the builds tried."""
    builds = []

    def failed_build():
        builds.append(1)
        raise RuntimeError("prnn_kernels: no CUDA toolkit found")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(build, "load_extension", failed_build)
    persistent._cuda_support.cache_clear()
    persistent._built_extension.cache_clear()
    yield builds
    persistent._cuda_support.cache_clear()
    persistent._built_extension.cache_clear()


def test_an_extension_that_cannot_be_built_is_a_reason_auto_falls_back_on(hopper_without_its_extension, monkeypatch):
    monkeypatch.setattr(modules, "_warned_fallbacks", set())
    verdict = support("gru", 16, 4, torch.float32, "cuda")
    assert not verdict.ok and verdict.reason == "its CUDA extension is unavailable: prnn_kernels: no CUDA toolkit found"
    with pytest.warns(UserWarning, match="runs on cuDNN, not the persistent kernel: its CUDA extension is unavailable"):
        assert prnn_kernels.GRU(8, 32).backend_for(4, torch.float32, "cuda") == "cudnn"
    with pytest.raises(ValueError, match="backend='persistent' cannot run: its CUDA extension is unavailable"):
        prnn_kernels.GRU(8, 64, backend="persistent").backend_for(4, torch.float32, "cuda")
    assert len(hopper_without_its_extension) == 1  # tried once: a failing build can take a minute


def test_a_gpu_that_cannot_run_the_kernels_is_named_before_the_extension_is_built(hopper_without_its_extension,
                                                                                 monkeypatch):
    # Where a GPU is visible, a CPU device is still no place for the kernels, and a GPU before Hopper lacks the
    # thread-block clusters' bulk copies: neither may be answered by a build (or by the kernels' tiling chooser).
    assert support("gru", 16, 4, torch.float32, "cpu").reason == (
        "needs a CUDA GPU (compute capability 9.0, Hopper, or newer)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert support("gru", 16, 4, torch.float32, "cuda").reason == (
        "needs compute capability 9.0 (Hopper) or newer for its bulk copies in thread-block clusters, device 0 has 8.0")
    assert not hopper_without_its_extension  # no build tried


def test_a_device_without_an_index_is_asked_about_as_the_current_gpu(hopper_without_its_extension, monkeypatch):
    # A rank's "cuda" is the GPU it set current (torch.cuda.set_device), not cuda:0: here an older GPU.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0) if device == 1 else (8, 0))
    assert support("gru", 16, 4, torch.float32, "cuda") == support("gru", 16, 4, torch.float32, "cuda:1") == (
        persistent.Support(False, "its CUDA extension is unavailable: prnn_kernels: no CUDA toolkit found"))


class _ExtensionRunningBatchesUpTo:
    """The extension's support query as a GPU answers it for a shape that runs up to `largest` utterances (the fp32 GRU
    at 1280 runs 1 to 12 on an H100 and an H200), refused above it with the reason an H100 gave at 13."""

    def __init__(self, largest):
        self.largest = largest

    def support(self, cell, hidden_size, batch_size, bf16):
        if batch_size <= self.largest:
            return True, ""
        return False, (f"backward: weights of a GRU of hidden size {hidden_size} (fp32, 19.7 MB) do not fit on chip on "
                       "this device (132 SMs): no tiling fits one SM's registers and shared memory with batch "
                       f"{batch_size}")


def test_a_batch_refused_where_fewer_utterances_run_is_named_as_the_reason(hopper_without_its_extension,
                                                                           monkeypatch):
    # The kernels' reason leads with the weights, 19.7 MB that "do not fit on chip", and says neither that fewer
    # utterances run nor how many: 12, which batch_slice=12 gives a larger batch.
    extension = _ExtensionRunningBatchesUpTo(12)
    monkeypatch.setattr(build, "load_extension", lambda: extension)
    weights = extension.support("gru", 1280, 13, False)[1]
    assert support("gru", 1280, 13, torch.float32, "cuda") == persistent.Support(
        False, "batch size 13 does not fit on this device, 12 does (the modules' batch_slice runs a larger batch as "
               f"slices): {weights}")
    assert support("gru", 1280, 12, torch.float32, "cuda").ok
    monkeypatch.setattr(modules, "_warned_fallbacks", set())
    with pytest.warns(UserWarning, match="runs on cuDNN, not the persistent kernel: batch size 16 does not fit on this "
                                         "device, 12 does"):
        prnn_kernels.GRU(8, 1280).backend_for(16, torch.float32, "cuda")
    # Where one utterance is refused too, the batch is not why, and the reason is the kernels' own.
    extension.largest = 0
    persistent._cuda_support.cache_clear()
    assert support("gru", 1280, 13, torch.float32, "cuda") == persistent.Support(False, weights)


def test_lengths_out_of_range_are_refused_before_the_extension_is_built(hopper_without_its_extension):
    # They were checked after the support query, which builds the extension first: a minute's build before the
    # refusal, and where the build failed, "its CUDA extension is unavailable" instead of the lengths.
    input_proj, hx, weight_hh = torch.randn(5, 2, 3 * 16), torch.zeros(2, 16), torch.zeros(3 * 16, 16)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, T=5\], got \[5, 6\]"):
        persistent_layer("gru", input_proj, hx, weight_hh, None, [5, 6], False)
    assert not hopper_without_its_extension  # no build tried


def test_weights_on_another_device_are_refused_before_the_extension_is_built(hopper_without_its_extension):
    # The binding refused them, after the support query's build.
    input_proj, hx, weight_hh = torch.randn(5, 2, 3 * 16), torch.zeros(2, 16), torch.zeros(3 * 16, 16, device="meta")
    with pytest.raises(ValueError, match="persistent_layer: weight_hh is on meta, input_proj on cpu"):
        persistent_layer("gru", input_proj, hx, weight_hh, None, [5, 3], False)
    assert not hopper_without_its_extension


@pytest.fixture
def poisoned(monkeypatch):
    """Outputs start as NaN, so an element the kernel never writes fails the comparison."""
    monkeypatch.setattr(persistent, "POISON_OUTPUTS", True)


def random_layer(cell, num_steps, batch_size, hidden_size, dtype, bias, seed, lengths_on_cpu=False):
    """Inputs as torch.nn initialises and feeds a layer (weights U(-1/sqrt(H), 1/sqrt(H))), ragged lengths.

    Returns (leaves in dtype with requires_grad, lengths): leaves = [input_proj, hx, cx (LSTM only), weight_hh,
    bias_hh or None].
    """
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    bound = 1 / math.sqrt(hidden_size)
    gate_rows = NUM_GATES[cell] * hidden_size

    def uniform(*shape):
        return (torch.rand(*shape, device=CUDA, generator=generator) * 2 - 1) * bound

    def state():
        return torch.randn(batch_size, hidden_size, device=CUDA, generator=generator) * 0.5

    leaves = [
        torch.randn(num_steps, batch_size, gate_rows, device=CUDA, generator=generator),
        state(),
        *([state()] if cell == "lstm" else []),
        uniform(gate_rows, hidden_size),
        uniform(gate_rows) if bias else None,
    ]
    leaves = [None if t is None else t.to(dtype).requires_grad_() for t in leaves]
    lengths = torch.randint(0, num_steps + 1, (batch_size,), device=CUDA, generator=generator)
    lengths[0] = num_steps  # someone runs the whole sequence
    if batch_size >= 3:
        lengths[-1] = 0  # and someone runs none of it: h_n = hx
    return leaves, (lengths.cpu() if lengths_on_cpu else lengths)


def layer_arguments(cell, leaves):
    """persistent_layer's (input_proj, hx, weight_hh, bias_hh) from random_layer's leaves."""
    if cell == "lstm":
        input_proj, h0, c0, weight_hh, bias_hh = leaves
        return input_proj, (h0, c0), weight_hh, bias_hh
    return tuple(leaves)


def outputs_and_gradients(layer, cell, leaves, lengths, reverse, upstream):
    """[output, h_n, (c_n,) and the gradient of every leaf] for a random linear function of the outputs."""
    output, final = layer(cell, *layer_arguments(cell, leaves), lengths, reverse)
    finals = list(final) if cell == "lstm" else [final]
    loss = sum((value * weight).sum() for value, weight in zip([output, *finals], upstream))
    wanted = [leaf for leaf in leaves if leaf is not None]
    return [output, *finals, *torch.autograd.grad(loss, wanted)]


def value_names(cell, bias):
    states = ["h_n", "c_n"] if cell == "lstm" else ["h_n"]
    initial = ["hx", "cx"] if cell == "lstm" else ["hx"]
    return ["output", *states, "grad input_proj", *[f"grad {n}" for n in initial], "grad weight_hh",
            *(["grad bias_hh"] if bias else [])]


def random_upstream(cell, num_steps, batch_size, hidden_size, dtype, seed):
    """Gradients for output, h_n (and c_n), from their own seed so that a failure in the suite recurs when its test
    runs alone: the global generator's state depends on the tests run before."""
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    shapes = [(num_steps, batch_size, hidden_size)] + [(batch_size, hidden_size)] * (2 if cell == "lstm" else 1)
    return [torch.randn(*shape, device=CUDA, generator=generator).to(dtype) for shape in shapes]


CASES = [
    # cell, T, B, H, dtype, reverse, bias
    ("relu", 1, 1, 32, torch.float32, False, True),
    ("tanh", 2, 3, 33, torch.float32, True, True),
    ("relu", 17, 4, 100, torch.float32, True, False),
    ("tanh", 17, 7, 257, torch.float32, False, True),
    ("tanh", 2, 16, 31, torch.float32, False, True),
    ("tanh", 17, 7, 1000, torch.float32, True, True),
    ("relu", 256, 1, 1152, torch.float32, False, True),
    ("tanh", 256, 16, 1025, torch.float32, True, True),
    ("relu", 17, 3, 2047, torch.float32, False, True),
    ("relu", 17, 16, 2048, torch.float32, True, True),
    ("relu", 256, 4, 2048, torch.float32, False, True),
    ("tanh", 2, 1, 33, torch.bfloat16, False, True),
    ("tanh", 17, 3, 100, torch.bfloat16, True, True),
    ("relu", 256, 7, 1152, torch.bfloat16, True, False),
    ("relu", 256, 4, 2048, torch.bfloat16, False, True),
    ("tanh", 17, 4, 2304, torch.bfloat16, False, True),
    ("relu", 17, 16, 2816, torch.bfloat16, True, True),
    ("tanh", 17, 32, 1152, torch.bfloat16, True, True),  # 17-32 utterances: bf16 on its four-sample-tile variants
    ("relu", 17, 21, 300, torch.float32, False, True),
    ("tanh", 17, 7, 2048, torch.float32, True, True),  # chained engine, chains of 4 and 3 utterances
    ("gru", 17, 5, 1152, torch.float32, False, True),  # chained engine in both passes, chains of 3 and 2
    ("tanh", 33, 2, 1536, torch.float32, True, True),  # chained engine, one chain of 2
    ("relu", 17, 4, 2304, torch.float32, False, True),  # fp32 weights partly in shared memory (and below)
    ("tanh", 33, 3, 2816, torch.float32, True, True),
    ("tanh", 17, 8, 2500, torch.float32, False, False),
    ("gru", 1, 1, 32, torch.float32, False, True),
    ("gru", 17, 3, 33, torch.float32, True, True),
    ("gru", 17, 7, 257, torch.float32, False, False),
    ("gru", 256, 4, 800, torch.float32, True, True),
    ("gru", 17, 16, 1024, torch.float32, False, True),
    ("gru", 64, 4, 1152, torch.float32, True, True),
    ("gru", 17, 4, 1536, torch.float32, True, True),
    ("gru", 33, 8, 1300, torch.float32, False, True),
    ("gru", 17, 4, 2048, torch.float32, True, True),  # fp32 weights partly in L2 (and below)
    ("gru", 17, 16, 1152, torch.float32, False, True),
    ("lstm", 17, 3, 2048, torch.float32, False, True),
    ("relu", 9, 2, 4096, torch.float32, True, False),
    ("gru", 2, 3, 100, torch.bfloat16, True, True),
    ("gru", 256, 4, 1152, torch.bfloat16, False, True),
    ("gru", 17, 16, 800, torch.bfloat16, True, True),
    ("gru", 33, 32, 800, torch.bfloat16, False, True),
    ("gru", 17, 25, 257, torch.float32, True, True),
    ("gru", 33, 4, 2048, torch.bfloat16, True, True),  # part of the weights in shared memory (and below)
    ("gru", 17, 7, 2000, torch.bfloat16, False, True),
    ("lstm", 2, 1, 31, torch.float32, False, True),
    ("lstm", 17, 4, 100, torch.float32, True, True),
    ("lstm", 17, 16, 513, torch.float32, True, False),
    ("lstm", 256, 4, 1024, torch.float32, False, True),
    ("lstm", 17, 5, 600, torch.float32, False, True),
    ("lstm", 33, 12, 1152, torch.float32, True, True),
    ("lstm", 17, 4, 1408, torch.float32, False, True),
    ("lstm", 17, 7, 100, torch.bfloat16, False, True),
    ("lstm", 17, 19, 513, torch.bfloat16, True, False),
    ("lstm", 17, 4, 800, torch.bfloat16, False, True),  # CTAs of 16 warps where the 4-tile variant would take 26
    ("relu", 17, 6, 1344, torch.bfloat16, True, True),
    ("lstm", 256, 4, 1024, torch.bfloat16, True, True),
    ("lstm", 65, 4, 2048, torch.bfloat16, True, True),
    ("lstm", 17, 3, 2048, torch.bfloat16, False, False),
    ("gru", 17, 4, 2304, torch.bfloat16, True, True),  # bf16 weights partly in L2 (and below)
    ("lstm", 17, 3, 2304, torch.bfloat16, False, True),
    ("lstm", 9, 8, 2048, torch.bfloat16, True, True),
]


def relu_reference_with_pattern(passed):
    """reference_layer's ReLU recurrence in float64, except that which pre-activations pass the ReLU is given.

    passed: (T, B, H) bool, here from the bf16 kernel's output. bf16 rounding of the state decorrelates any two
    computations at the 1e-3 level within a few steps, so a small fraction of pre-activations land on the other side
    of 0 than in float64, and there ReLU's derivative jumps from 1 to 0: against reference_layer the gradients of any
    bf16 kernel differ by more than 1e-2. With the kernel's own pattern everything else is still checked in float64.
    """

    def layer(cell, input_proj, hx, weight_hh, bias_hh, lengths, reverse):
        assert cell == "relu"
        num_steps = input_proj.shape[0]
        valid = torch.arange(num_steps, device=CUDA)[:, None] < lengths.to(CUDA)[None, :]
        valid = valid.unsqueeze(2).unbind(0)  # T x (B, 1)
        step_inputs, gates = input_proj.unbind(0), passed.to(input_proj.dtype).unbind(0)
        h = hx
        outputs = [None] * num_steps
        for t in reversed(range(num_steps)) if reverse else range(num_steps):
            new = (step_inputs[t] + F.linear(h, weight_hh, bias_hh)) * gates[t]
            h = torch.where(valid[t], new, h)
            outputs[t] = torch.where(valid[t], new, 0.0)
        return torch.stack(outputs), h

    return layer


@pytest.mark.cuda
@pytest.mark.parametrize("cell, num_steps, batch_size, hidden_size, dtype, reverse, bias", CASES)
def test_matches_float64_reference(poisoned, cell, num_steps, batch_size, hidden_size, dtype, reverse, bias):
    seed = num_steps * 7919 + batch_size * 104729 + hidden_size + NUM_GATES[cell]
    leaves, lengths = random_layer(cell, num_steps, batch_size, hidden_size, dtype, bias, seed,
                                   lengths_on_cpu=seed % 2 == 1)
    upstream = random_upstream(cell, num_steps, batch_size, hidden_size, dtype, seed + 1)

    actual = outputs_and_gradients(persistent_layer, cell, leaves, lengths, reverse, upstream)
    persistent.raise_if_failed()
    # The reference runs in float64 on the very values the kernel saw (dtype-rounded inputs and upstream gradients).
    leaves64 = [None if t is None else t.detach().double().requires_grad_() for t in leaves]
    relu_in_bf16 = cell == "relu" and dtype == torch.bfloat16
    reference = relu_reference_with_pattern(actual[0].detach() > 0) if relu_in_bf16 else reference_layer
    expected = outputs_and_gradients(reference, cell, leaves64, lengths, reverse, [u.double() for u in upstream])

    names = value_names(cell, bias)
    assert len(actual) == len(names) == len(expected)
    unwritten = [name for name, a in zip(names, actual) if not torch.isfinite(a).all()]
    assert not unwritten, f"NaN/inf (elements left unwritten?) in {unwritten}"
    errors = {name: relative_error(a.double(), e) for name, a, e in zip(names, actual, expected)}
    assert all(error <= TOLERANCE[dtype] for error in errors.values()), f"relative errors {errors}"
    assert actual[0].dtype == dtype and actual[1].dtype == dtype
    if relu_in_bf16:  # the outputs also stay within 1e-2 of the plain float64 recurrence
        plain = reference_layer(cell, *layer_arguments(cell, [None if t is None else t.detach() for t in leaves64]),
                                lengths, reverse)
        plain_errors = [relative_error(a.double(), e) for a, e in zip(actual[:2], plain)]
        assert all(error <= TOLERANCE[dtype] for error in plain_errors), f"output, h_n vs plain float64: {plain_errors}"


BIDIRECTIONAL_CASES = [
    # cell, T, B, H, dtype, whether both passes run the two directions in one launch (on an H100 or H200)
    ("gru", 33, 4, 256, torch.bfloat16, True),
    ("gru", 65, 8, 800, torch.bfloat16, True),
    ("gru", 33, 4, 1152, torch.bfloat16, True),  # the backward with part of its weights in shared memory
    ("lstm", 17, 4, 1152, torch.bfloat16, False),  # the forward so; the backward one direction after the other
    ("lstm", 17, 3, 100, torch.float32, True),
    ("tanh", 17, 7, 300, torch.float32, True),
    ("gru", 17, 4, 1024, torch.float32, True),  # fp32 with part of its weights in shared memory (and below)
    ("relu", 17, 4, 2048, torch.float32, True),
    ("gru", 17, 4, 1152, torch.float32, True),
    ("lstm", 17, 4, 1152, torch.float32, False),  # the forward so; the backward one direction after the other
    ("gru", 9, 2, 2048, torch.float32, False),  # part of the weights in L2: one direction after the other
    ("gru", 9, 2, 2304, torch.bfloat16, False),
]


@pytest.mark.cuda
@pytest.mark.parametrize("cell, num_steps, batch_size, hidden_size, dtype, together", BIDIRECTIONAL_CASES)
def test_bidirectional_layer_matches_two_reference_directions(poisoned, cell, num_steps, batch_size, hidden_size,
                                                              dtype, together):
    seed = num_steps + batch_size + hidden_size
    directions = [random_layer(cell, num_steps, batch_size, hidden_size, dtype, True, seed + d)[0] for d in range(2)]
    _, lengths = random_layer(cell, num_steps, batch_size, hidden_size, dtype, True, seed)
    upstream = [random_upstream(cell, num_steps, batch_size, hidden_size, dtype, seed + 2 + d) for d in range(2)]

    def run(leaves_per_direction, layer):
        arguments = [layer_arguments(cell, leaves) for leaves in leaves_per_direction]  # (input_proj, hx, w, b)
        if layer is persistent_bidirectional_layer:
            input_proj = torch.cat([a[0] for a in arguments], dim=2)
            output, finals = layer(cell, input_proj, *[[a[i] for a in arguments] for i in (1, 2, 3)], lengths)
            outputs = output.chunk(2, dim=2)
        else:
            outputs, finals = zip(*[layer(cell, *a, lengths, reverse=d == 1) for d, a in enumerate(arguments)])
        loss, values = 0, []  # values: each direction's output, h_n (and c_n)
        for output, final, weights in zip(outputs, finals, upstream):
            its_values = [output, *(final if cell == "lstm" else [final])]
            loss = loss + sum((value * weight.to(value.dtype)).sum() for value, weight in zip(its_values, weights))
            values += its_values
        leaves = [leaf for leaves in leaves_per_direction for leaf in leaves if leaf is not None]
        # The final states too: no gradient reads their values, so only comparing them shows a wrong h_n or c_n.
        return [*values, *torch.autograd.grad(loss, leaves)]

    actual = run(directions, persistent_bidirectional_layer)
    persistent.raise_if_failed()
    directions64 = [[None if t is None else t.detach().double().requires_grad_() for t in leaves]
                    for leaves in directions]
    expected = run(directions64, reference_layer)
    assert all(torch.isfinite(a).all() for a in actual)
    errors = [relative_error(a.double(), e) for a, e in zip(actual, expected)]
    assert all(error <= TOLERANCE[dtype] for error in errors), f"relative errors {errors}"
    assert directions_run_together(cell, hidden_size, batch_size, dtype, CUDA) == together, "the planner changed"


def launch_played_by_the_reference(cell, reverse, num_directions, input_proj, hx, cx, lengths, *parameters):
    """_PersistentLayer.apply as reference_layer computes it, direction by direction, taking and giving what the
    kernels' binding does: hx and cx (D, B, H), the D weight_hh then the D bias_hh or none; output (T, B, D*H), h_n
    and c_n (D, B, H), c_n empty but for an LSTM. Direction 0 runs reversed if `reverse`, direction 1 the other way."""
    weight_hh = parameters[:num_directions]
    bias_hh = parameters[num_directions:] or (None,) * num_directions
    width = input_proj.shape[2] // num_directions
    outputs, finals = [], []
    for direction in range(num_directions):
        state = (hx[direction], cx[direction]) if cell == "lstm" else hx[direction]
        output, final = reference_layer(cell, input_proj[..., direction * width:(direction + 1) * width], state,
                                        weight_hh[direction], bias_hh[direction], lengths, reverse != (direction == 1))
        outputs.append(output)
        finals.append(final if cell == "lstm" else (final,))
    c_n = torch.stack([final[1] for final in finals]) if cell == "lstm" else hx.new_empty(0)
    return torch.cat(outputs, 2), torch.stack([final[0] for final in finals]), c_n


@pytest.mark.parametrize("cell", ["relu", "gru", "lstm"])
@pytest.mark.parametrize("bidirectional, bias", [(True, True), (False, True), (True, False)])
def test_the_persistent_backend_composes_a_stack_as_the_reference_backend_does(cell, bidirectional, bias,
                                                                                monkeypatch):
    """The Python around the kernels (the modules' persistent branch, the layer's checks, each layer's directions
    stacked into one launch and their final states split out of it) on a launch that reference_layer plays, and a
    support query that says yes: every output and gradient is the reference backend's. No test run without a GPU
    reached that code before."""
    monkeypatch.setattr(persistent, "support", lambda *arguments: persistent.Support(True, ""))
    launched = []  # each launch's number of directions: a module that ran the reference instead passed unlaunched
    monkeypatch.setattr(persistent._PersistentLayer, "apply",
                        lambda *arguments: launched.append(arguments[2]) or launch_played_by_the_reference(*arguments))
    torch.manual_seed(5)
    kind = {"relu": prnn_kernels.RNN, "gru": prnn_kernels.GRU, "lstm": prnn_kernels.LSTM}[cell]
    layer = kind(5, 6, num_layers=2, bidirectional=bidirectional, bias=bias, dtype=torch.float64,
                 **({"nonlinearity": "relu"} if cell == "relu" else {}))
    x = torch.randn(7, 3, 5, dtype=torch.float64, requires_grad=True)
    states = [torch.randn(4 if bidirectional else 2, 3, 6, dtype=torch.float64, requires_grad=True)
              for _ in range(2 if cell == "lstm" else 1)]
    results = []
    for backend in ("persistent", "reference"):
        layer.backend = backend
        output, final = layer(x, tuple(states) if cell == "lstm" else states[0], lengths=torch.tensor([7, 4, 1]))
        values = [output, *(final if cell == "lstm" else (final,))]
        loss = sum((value * torch.linspace(-1, 1, value.numel(), dtype=torch.float64).view_as(value)).sum()
                   for value in values)
        results.append([*values, *torch.autograd.grad(loss, [x, *states, *layer.parameters()])])
    assert launched == [2 if bidirectional else 1] * 2  # one launch a layer, both directions in it
    for on_persistent, on_reference in zip(*results, strict=True):
        assert relative_error(on_persistent, on_reference) < 1e-12


@pytest.mark.cuda
@pytest.mark.parametrize("cell", ["gru", "lstm", "relu"])
def test_model_on_persistent_backend_matches_reference_backend(cell, no_tf32):
    """A bidirectional 2-layer stack inside DeepSpeech2: loss and every gradient, persistent against reference."""
    from models.deepspeech2 import DeepSpeech2

    torch.manual_seed(8)
    features = torch.randn(3, 90, 40, device=CUDA)
    feature_lengths = torch.tensor([90, 71, 40], device=CUDA)
    upstream = None
    results = []
    for backend in ("persistent", "reference"):
        torch.manual_seed(9)
        model = DeepSpeech2(40, 29, depth=2, hidden=96, cell=cell, backend=backend, conv_channels=4).to(CUDA)
        log_probs, _ = model(features, feature_lengths)
        if upstream is None:
            upstream = torch.randn_like(log_probs)
        (log_probs * upstream).sum().backward()
        results.append([log_probs.detach(), *[p.grad.detach() for p in model.parameters()]])
    persistent.raise_if_failed()
    errors = [relative_error(a.double(), b.double()) for a, b in zip(*results)]
    assert all(error <= 1e-4 for error in errors), f"relative errors {errors}"  # max() would pass a NaN


@pytest.mark.cuda
@pytest.mark.parametrize("cell", ["relu", "gru"])
def test_repeated_runs_are_identical(poisoned, cell):
    """The kernel reduces in a fixed order: any difference between two runs would be a race. Poisoned: the second
    run's workspaces reuse the blocks the first one freed, so a value read before it is written would otherwise be the
    same stale one in both runs."""
    leaves, lengths = random_layer(cell, 64, 4, 1024, torch.float32, True, seed=3)
    upstream = random_upstream(cell, 64, 4, 1024, torch.float32, seed=4)
    first = outputs_and_gradients(persistent_layer, cell, leaves, lengths, False, upstream)
    second = outputs_and_gradients(persistent_layer, cell, leaves, lengths, False, upstream)
    persistent.raise_if_failed()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("cell", ["tanh", "lstm"])
def test_fp32_parameters_of_a_bf16_layer_get_unrounded_fp32_gradients(cell):
    """fp32 master weights of a bf16 layer (as under autocast) run the same bf16 layer as their bf16 copies, and get
    that layer's fp32 weight and bias gradients before any rounding to bf16."""
    leaves, lengths = random_layer(cell, 17, 4, 300, torch.bfloat16, True, seed=5)
    upstream = random_upstream(cell, 17, 4, 300, torch.bfloat16, seed=6)
    masters = [leaf.detach().float().requires_grad_() for leaf in leaves[-2:]]  # weight_hh, bias_hh
    in_bf16 = outputs_and_gradients(persistent_layer, cell, leaves, lengths, False, upstream)
    in_fp32 = outputs_and_gradients(persistent_layer, cell, [*leaves[:-2], *masters], lengths, False, upstream)
    persistent.raise_if_failed()
    for bf16_value, fp32_value in zip(in_bf16[:-2], in_fp32[:-2]):  # outputs and the other gradients: the same
        assert torch.equal(bf16_value, fp32_value)
    for bf16_grad, fp32_grad in zip(in_bf16[-2:], in_fp32[-2:]):
        assert fp32_grad.dtype == torch.float32 and torch.isfinite(fp32_grad).all()
        assert torch.equal(fp32_grad.to(torch.bfloat16), bf16_grad)
        assert not torch.equal(fp32_grad.to(torch.bfloat16).float(), fp32_grad)  # not rounded on the way


@pytest.mark.cuda
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_an_fp32_initial_state_of_a_bf16_layer_runs_as_its_bf16_rounding(cell):
    """A bf16 layer handed an fp32 state (as a model under autocast may hold it) runs it rounded to bf16."""
    leaves, lengths = random_layer(cell, 17, 4, 300, torch.bfloat16, True, seed=5)
    input_proj, hx, weight_hh, bias_hh = layer_arguments(cell, [t.detach() for t in leaves])
    in_fp32 = tuple(h.float() for h in hx) if cell == "lstm" else hx.float()
    expected, _ = persistent_layer(cell, input_proj, hx, weight_hh, bias_hh, lengths, False)
    output, _ = persistent_layer(cell, input_proj, in_fp32, weight_hh, bias_hh, lengths, False)
    persistent.raise_if_failed()
    assert torch.equal(output, expected)


@pytest.mark.parametrize("cell, batch_size, dtype, message", [
    ("conv", 4, torch.float32, "is not one of"), ("relu", 33, torch.float32, "batch size 33"),
    ("gru", 4, torch.float16, "dtype")])
def test_the_layer_refuses_what_no_gpu_runs_before_asking_for_one(cell, batch_size, dtype, message):
    hidden_size = 256
    gate_rows = NUM_GATES.get(cell, 1) * hidden_size
    input_proj = torch.randn(3, batch_size, gate_rows, dtype=dtype)
    hx = torch.zeros(batch_size, hidden_size, dtype=dtype)
    with pytest.raises(ValueError, match=message):
        persistent_layer(cell, input_proj, hx, torch.zeros(gate_rows, hidden_size, dtype=dtype), None,
                         torch.full((batch_size,), 3), False)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "cell, hidden_size, batch_size, dtype, message",
    [
        ("relu", 8192, 4, torch.float32, "do not fit on chip"),
        ("gru", 4096, 4, torch.float32, "not even with what does not fit read again from its L2"),
        ("lstm", 1152, 16, torch.float32, "with batch 16"),
        ("lstm", 2048, 16, torch.bfloat16, "with batch 16"),
    ],
)
def test_refuses_unsupported_shapes(cell, hidden_size, batch_size, dtype, message):
    verdict = support(cell, hidden_size, batch_size, dtype, CUDA)
    assert not verdict.ok and message in verdict.reason
    gate_rows = NUM_GATES.get(cell, 1) * hidden_size
    input_proj = torch.randn(3, batch_size, gate_rows, device=CUDA, dtype=dtype)
    hx = torch.zeros(batch_size, hidden_size, device=CUDA, dtype=dtype)
    hx = (hx, hx) if cell == "lstm" else hx  # a well-formed call, so that the refusal is the shape's
    weight = torch.zeros(gate_rows, hidden_size, device=CUDA, dtype=dtype)
    lengths = torch.full((batch_size,), 3)
    with pytest.raises(ValueError, match=message):
        persistent_layer(cell, input_proj, hx, weight, None, lengths, False)


@pytest.mark.cuda
@pytest.mark.parametrize("batch_slice", [4, 20])
def test_batch_above_the_kernels_limit_runs_as_slices(batch_slice, no_tf32):
    """A bidirectional 2-layer GRU at 40 sequences, more than one launch takes: refused whole, and as slices of
    `batch_slice` (at 20: two of 20, at 4: ten of 4) the same outputs and gradients as the
    reference."""
    import prnn_kernels

    torch.manual_seed(2)
    batch_size = 40
    assert batch_size > persistent.MAX_BATCH
    modules = {backend: prnn_kernels.GRU(24, 200, num_layers=2, bidirectional=True, backend=backend).to(CUDA)
               for backend in ("persistent", "reference")}
    modules["reference"].load_state_dict(modules["persistent"].state_dict())
    x = torch.randn(33, batch_size, 24, device=CUDA)
    lengths = torch.randint(1, 34, (batch_size,))
    with pytest.raises(ValueError, match="batch size 40 is out of range.*batch_slice"):
        modules["persistent"](x, lengths=lengths)
    upstream = None
    results = []
    for backend, module in modules.items():
        module.batch_slice = batch_slice
        leaf = x.clone().requires_grad_()
        output, h_n = module(leaf, lengths=lengths)
        if upstream is None:
            upstream = torch.randn_like(output), torch.randn_like(h_n)
        grads = torch.autograd.grad((output * upstream[0]).sum() + (h_n * upstream[1]).sum(),
                                    [leaf, *module.parameters()])
        results.append([output, h_n, *grads])
    persistent.raise_if_failed()
    errors = [relative_error(a.double(), b.double()) for a, b in zip(*results, strict=True)]
    assert all(error <= TOLERANCE[torch.float32] for error in errors), f"relative errors {errors}"


@pytest.mark.cuda
@pytest.mark.parametrize("cell, hidden_size, batch_size, dtype, directions, weight_homes", [
    # weight_homes: (forward, backward), where the weights the registers cannot hold go
    ("relu", 2048, 4, torch.float32, 1, ("registers", "registers")),
    ("gru", 1152, 4, torch.float32, 1, ("registers", "registers")),
    ("lstm", 1152, 8, torch.bfloat16, 1, ("registers", "registers")),
    ("relu", 1152, 4, torch.bfloat16, 2, ("registers", "registers")),
    ("gru", 1152, 4, torch.float32, 2, ("shared", "shared")),
    ("relu", 2816, 4, torch.float32, 1, ("shared", "shared")),
    ("gru", 1152, 4, torch.bfloat16, 2, ("registers", "shared")),
    ("lstm", 1152, 4, torch.bfloat16, 2, ("shared", "registers")),
    ("gru", 2048, 4, torch.bfloat16, 2, ("shared", "shared")),
    ("lstm", 2048, 4, torch.bfloat16, 1, ("shared", "shared")),
    ("gru", 2048, 4, torch.float32, 1, ("l2", "l2")),
    ("lstm", 2048, 4, torch.float32, 2, ("l2", "l2")),  # one direction after the other: never both on L2
    ("gru", 1152, 16, torch.float32, 1, ("registers", "l2")),
    ("gru", 2816, 4, torch.bfloat16, 1, ("l2", "l2")),
    ("lstm", 2048, 8, torch.bfloat16, 1, ("shared", "l2")),
])
def test_launch_plans_hold_every_unit_on_co_resident_ctas(cell, hidden_size, batch_size, dtype, directions,
                                                           weight_homes):
    plans = launch_plans(cell, hidden_size, batch_size, dtype, CUDA, directions)
    assert [plan["pass"] for plan in plans] == ["forward", "backward"]
    properties = torch.cuda.get_device_properties(CUDA)
    for plan, home in zip(plans, weight_homes):
        assert plan["ok"] and plan["reason"] == ""
        # One direction of an fp32 layer ran slower in clusters of 2 than in none (NOTES.md, "Cluster sizes by
        # precision").
        one_fp32_direction = dtype == torch.float32 and not (directions == 2 and plan["directions_in_one_launch"])
        assert plan["cluster_size"] in ((1, 4, 8) if one_fp32_direction else (1, 2, 4, 8))
        assert plan["ctas_per_direction"] % plan["cluster_size"] == 0
        assert plan["units_per_cta"] * plan["ctas_per_direction"] >= hidden_size
        launched = plan["ctas_per_direction"] * (directions if plan["directions_in_one_launch"] else 1)
        assert launched <= 2 * properties.multi_processor_count and plan["threads"] <= 1024
        # Shared memory holds weights only where the registers cannot hold those of the directions launched at once,
        # and L2 only where shared memory cannot hold the rest of one direction's, within the L2's size.
        found = "l2" if plan["weight_l2_bytes"] else ("shared" if plan["weight_smem_bytes"] else "registers")
        assert found == home
        assert plan["weight_smem_bytes"] < plan["smem_bytes"]
        assert plan["weight_l2_bytes"] * plan["ctas_per_direction"] <= properties.L2_cache_size
        if home == "l2":
            assert not plan["directions_in_one_launch"]
    if directions == 2:
        together = all(plan["directions_in_one_launch"] for plan in plans)
        assert together == directions_run_together(cell, hidden_size, batch_size, dtype, CUDA)
    with pytest.raises(ValueError, match="do not fit on chip"):
        launch_plans("gru", 4096, 4, torch.float32, CUDA)


@pytest.mark.cuda
@pytest.mark.parametrize("hidden_size, batch_size, threads", [
    (1024, 8, 256),  # 8 k-tiles per warp: half the warps of 4 tiles for the same work
    (1024, 16, 256),  # 16 units of 16 utterances: one element a thread
    (512, 16, 256),  # 128 threads would finish two (unit, sample) elements each
])
def test_bf16_plans_take_the_fewest_threads_that_finish_one_element_each(hidden_size, batch_size, threads):
    # Among tilings of equal work, fewer warps ran the plain engine's bf16 passes up to 27 % faster, but not where each
    # thread then finished two elements (NOTES.md, "Threads per CTA"). These shapes are past the cluster engine's (each
    # CTA would receive more than 8 KB of the vector a step) and fit one CTA per SM on 64 SMs.
    if torch.cuda.get_device_properties(CUDA).multi_processor_count < 64:
        pytest.skip("the tilings asserted here are those of a GPU with 64 SMs or more")
    plans = launch_plans("relu", hidden_size, batch_size, torch.bfloat16, CUDA)
    assert [(plan["threads"], plan["one_cluster"]) for plan in plans] == [(threads, False)] * 2


@pytest.mark.cuda
@pytest.mark.parametrize("cell, hidden_size, batch_size, threads", [
    ("gru", 800, 4, 448),  # 14 warps of 8 k-tiles, not the 26 of 4 that pad K = 800 least
    ("lstm", 800, 16, 448),
    ("relu", 1344, 4, 352),  # 11 warps of 8, not 21 of 4
])
def test_bf16_plans_keep_to_16_warps_where_a_tiling_that_small_fits(cell, hidden_size, batch_size, threads):
    # CTAs of more than 16 warps ran every bf16 pass sampled slower: the GRU at 800 8-12 % forward, the LSTM 24-27 %
    # (NOTES.md v32). These shapes fit one CTA per SM on 104 SMs.
    if torch.cuda.get_device_properties(CUDA).multi_processor_count < 104:
        pytest.skip("the tilings asserted here are those of a GPU with 104 SMs or more")
    forward = launch_plans(cell, hidden_size, batch_size, torch.bfloat16, CUDA)[0]
    assert forward["threads"] == threads


@pytest.mark.cuda
@pytest.mark.parametrize("hidden_size, threads, ctas", [
    (256, 128, 8),  # not 32 CTAs of one warp each: the same work per warp on a quarter of the CTAs
    (512, 128, 32),
    (768, 96, 96),  # six warps on 48 CTAs would give each busy sub-partition half again the work
])
def test_fp32_plans_fill_the_sub_partitions_on_the_fewest_ctas(hidden_size, threads, ctas):
    # The small fp32 layers ran 12-38 % faster on a quarter as many CTAs of four warps as of one (NOTES.md, "Work per
    # busy sub-partition"). These shapes fit one CTA per SM on 96 SMs.
    if torch.cuda.get_device_properties(CUDA).multi_processor_count < 96:
        pytest.skip("the tilings asserted here are those of a GPU with 96 SMs or more")
    plans = launch_plans("relu", hidden_size, 4, torch.float32, CUDA)
    assert [(plan["threads"], plan["ctas_per_direction"]) for plan in plans] == [(threads, ctas)] * 2


@pytest.mark.cuda
@pytest.mark.parametrize("cell, hidden_size, batch_size, chains", [
    ("relu", 2048, 4, 2),  # 16 rows x 2048 x 4 multiply-adds a CTA per step
    ("relu", 1152, 4, 0),  # too little work a step for a second chain to hide the hand-off
    ("relu", 2048, 1, 1),  # one utterance: the hand-off off the compute warps, no second chain
    ("gru", 1152, 1, 0),  # but not in the 384-thread variants
    ("gru", 1152, 4, 2),
    ("lstm", 1024, 4, 0),  # the gated cells' 2 x 8 variant and
    ("lstm", 1152, 4, 0),  # the 5 x 6 run in the plain engine only
])
def test_fp32_plans_chain_samples_where_the_work_pays(cell, hidden_size, batch_size, chains):
    # Two chains of samples took 5-15 % off the fp32 ReLU at 2048 and the GRU at 1152 and cost the small layers 2-20 %;
    # one chain took 3-8 % off the ReLU at 1152-2048 with one utterance (NOTES.md v24). The work per CTA asserted here
    # is that of a GPU with 128 SMs or more.
    if torch.cuda.get_device_properties(CUDA).multi_processor_count < 128:
        pytest.skip("the tilings asserted here are those of a GPU with 128 SMs or more")
    plans = launch_plans(cell, hidden_size, batch_size, torch.float32, CUDA)
    assert [plan["chains"] for plan in plans] == [chains, chains]


# Refused before the support query, so without a GPU too: asked after it, these answered "needs a CUDA GPU" there.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_refuses_lengths_out_of_range_or_not_integers(device):
    input_proj, hx, weight_hh = (torch.zeros(shape, device=device) for shape in ((5, 2, 64), (2, 64), (64, 64)))
    with pytest.raises(ValueError, match="lengths must lie in"):
        persistent_layer("relu", input_proj, hx, weight_hh, None, torch.tensor([5, 6]), False)
    with pytest.raises(ValueError, match="lengths must be integers, got torch.float32"):
        persistent_layer("relu", input_proj, hx, weight_hh, None, torch.tensor([2.5, 5.0]), False)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_refuses_a_state_that_is_not_a_tensor_or_an_lstms_pair(device):
    input_proj, h0, weight_hh = (torch.zeros(shape, device=device) for shape in ((5, 2, 4 * 64), (2, 64), (4 * 64, 64)))
    with pytest.raises(ValueError, match=r"an LSTM's hx must be a tuple \(h0, c0\)"):
        persistent_layer("lstm", input_proj, h0, weight_hh, None, torch.tensor([5, 3]), False)
    with pytest.raises(ValueError, match=r"hx must be a tensor \(B, H\)"):
        persistent_layer("gru", input_proj[..., :3 * 64], None, weight_hh[:3 * 64], None, [5, 3], False)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_refuses_more_sequence_rows_than_the_output_gather_launches(device):
    # csrc/sequence_gather.cu launches a block per (step, sample, direction), counted in an int: at 2^31 rows the
    # grid was too large to launch, at 2^32 + 32 it wrapped to 32 blocks and left the rest of the output unwritten.
    # Expanded tensors: the refusal comes before any is read.
    def zeros(*shape):
        return torch.zeros(1, device=device).expand(*shape)

    hx, weight_hh, lengths = zeros(32, 1), zeros(1, 1), torch.full((32,), 2**25)
    with pytest.raises(ValueError, match=r"steps T x samples B x directions = 33554432 x 32 x 2 = 2147483648 rows, "
                                         r"above the kernels' 1073741824"):
        persistent_bidirectional_layer("relu", zeros(2**25, 32, 2), (hx, hx), (weight_hh, weight_hh), None, lengths)
    for num_steps, rows in ((2**25 + 1, 1073741856), (2**27 + 1, 4294967328)):
        with pytest.raises(ValueError, match=f"{num_steps} x 32 x 1 = {rows} rows"):
            persistent_layer("relu", zeros(num_steps, 32, 1), hx, weight_hh, None, lengths, False)
    if device == "cpu":  # one direction of 2^25 steps, 2^30 rows, is within the limit: the missing GPU refuses it
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            persistent_layer("relu", zeros(2**25, 32, 1), hx, weight_hh, None, lengths, False)


@pytest.mark.cuda
def test_refuses_a_launch_whose_step_counts_would_wrap():
    # The waits compare a direction's step count, steps x CTAs, in 32 bits (csrc/sync.cuh): ReLU at H = 8 runs on 8
    # CTAs, so 2^29 steps of one sample reach 2^32, within the limit on rows. Expanded: refused before it is read.
    ctas = launch_plans("relu", 8, 1, torch.float32, CUDA)[0]["ctas_per_direction"]
    num_steps = 2**32 // ctas
    input_proj = torch.zeros(1, device=CUDA).expand(num_steps, 1, 8)
    hx, weight_hh, lengths = torch.zeros(1, 8, device=CUDA), torch.zeros(8, 8, device=CUDA), torch.tensor([1])
    with pytest.raises(ValueError, match=f"T={num_steps} steps x {ctas} CTAs overflow the kernels' 32-bit step counts"):
        persistent_layer("relu", input_proj, hx, weight_hh, None, lengths, False)


def test_refuses_a_launch_whose_step_counts_would_wrap_on_the_plans_a_gpu_gives(monkeypatch):
    """The CUDA test above, on plans played: without a GPU the support query says no before a plan is asked, so no
    test run without one reached the check. Plans of 4,096 CTAs reach 2^32 in 2^20 steps, an input small enough to
    copy where a broken check lets it through (the 2^29 steps of ReLU's 8 CTAs at H = 8 would be 16 GiB)."""
    monkeypatch.setattr(persistent, "support", lambda *arguments: persistent.Support(True, ""))
    monkeypatch.setattr(persistent, "launch_plans", lambda *arguments: [
        {"ok": True, "one_cluster": False, "ctas_per_direction": 4096}] * 2)
    input_proj = torch.zeros(1).expand(2**20 + 1, 1, 8)  # expanded: refused before it is read
    hx, weight_hh, lengths = torch.zeros(1, 8), torch.zeros(8, 8), torch.tensor([1])
    with pytest.raises(ValueError, match="T=1048577 steps x 4096 CTAs overflow the kernels' 32-bit step counts"):
        persistent_layer("relu", input_proj, hx, weight_hh, None, lengths, False)


def test_directions_run_together_only_where_both_passes_launch_them_together(monkeypatch):
    # benchmarks/support_table.py asks it of every shape, those the kernels refuse too, for which there is no plan.
    assert not directions_run_together("relu", 256, 4, torch.float32, "cpu")
    monkeypatch.setattr(persistent, "support", lambda *arguments: persistent.Support(True, ""))
    for forward, backward in ((True, True), (True, False), (False, True)):
        def plans(cell, hidden_size, batch_size, dtype, device, directions=1, forward=forward, backward=backward):
            # Asked for one direction, every plan answers False (csrc/binding.cpp): a bidirectional layer's are wanted.
            assert directions == 2
            return [{"directions_in_one_launch": forward}, {"directions_in_one_launch": backward}]

        monkeypatch.setattr(persistent, "launch_plans", plans)
        assert directions_run_together("relu", 256, 4, torch.float32, "cuda") == (forward and backward)


def test_refuses_directions_that_are_not_two_before_asking_for_a_gpu():
    both, h0, c0 = torch.randn(5, 2, 2 * 4 * 64), torch.zeros(2, 64), torch.zeros(2, 64)
    weight_hh, bias_hh = torch.zeros(4 * 64, 64), torch.zeros(4 * 64)
    with pytest.raises(ValueError, match="hx, weight_hh and bias_hh must each be a pair"):
        persistent_bidirectional_layer("lstm", both, [(h0, c0)] * 3, [weight_hh] * 3, [bias_hh] * 3,
                                       torch.tensor([5, 3]))


def test_refuses_one_direction_with_a_bias_and_the_other_without_before_asking_for_a_gpu():
    both, hx = torch.randn(5, 2, 2 * 3 * 16), torch.zeros(2, 16)
    weight_hh, bias_hh = torch.zeros(3 * 16, 16), torch.zeros(3 * 16)
    for biases in ((bias_hh, None), (None, bias_hh)):
        with pytest.raises(ValueError, match="persistent_bidirectional_layer: give both biases or neither"):
            persistent_bidirectional_layer("gru", both, (hx, hx), (weight_hh, weight_hh), biases, torch.tensor([5, 3]))


def assert_the_next_launch_is_right(cell, leaves, lengths, dtype):
    """After a failed launch was reported: the next one runs and matches float64."""
    output, _ = persistent_layer(cell, *layer_arguments(cell, leaves), lengths, False)
    persistent.raise_if_failed()
    expected, _ = reference_layer(cell, *layer_arguments(cell, [t.detach().double() for t in leaves]), lengths,
                                  False)
    assert relative_error(output.double(), expected) <= TOLERANCE[dtype]


@pytest.mark.cuda
@pytest.mark.parametrize("cell, hidden_size, batch_size, dtype, chains, one_cluster", [
    ("relu", 2048, 4, torch.float32, 2, False), ("relu", 2048, 1, torch.float32, 1, False),
    ("lstm", 1024, 4, torch.float32, 0, False), ("gru", 512, 4, torch.bfloat16, 0, True)])
def test_timed_out_wait_raises_then_recovers(monkeypatch, cell, hidden_size, batch_size, dtype, chains, one_cluster):
    if torch.cuda.get_device_properties(CUDA).multi_processor_count >= 128:  # where the engines' rule is known
        plan = launch_plans(cell, hidden_size, batch_size, dtype, CUDA)[0]
        assert (plan["chains"], plan["one_cluster"]) == (chains, one_cluster)
    leaves, lengths = random_layer(cell, 64, batch_size, hidden_size, dtype, True, seed=5)
    arguments = layer_arguments(cell, leaves)
    monkeypatch.setattr(persistent, "SPIN_TIMEOUT_S", 0.0)  # every wait that finds a flag unset fails at once
    persistent_layer(cell, *arguments, lengths, False)
    with pytest.raises(RuntimeError, match="timed out"):
        persistent.raise_if_failed()
    monkeypatch.setattr(persistent, "SPIN_TIMEOUT_S", 4.0)
    assert_the_next_launch_is_right(cell, leaves, lengths, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("cell, hidden_size, batch_size, dtype, bad_length", [
    ("relu", 2048, 4, torch.float32, 65), ("relu", 2048, 1, torch.float32, -1), ("lstm", 1024, 4, torch.float32, 65),
    ("gru", 512, 4, torch.bfloat16, -3)])
def test_gpu_length_outside_the_sequence_raises_then_recovers(cell, hidden_size, batch_size, dtype, bad_length):
    """GPU lengths are not read on the host before a launch; the kernel reports one outside [0, T] (one per engine,
    as in the timeout test) through the status word."""
    leaves, lengths = random_layer(cell, 64, batch_size, hidden_size, dtype, True, seed=6)
    arguments = layer_arguments(cell, leaves)
    bad_lengths = lengths.clone()
    bad_lengths[-1] = bad_length
    persistent_layer(cell, *arguments, bad_lengths, False)
    with pytest.raises(RuntimeError, match=r"sequence length outside \[0, T\]"):
        persistent.raise_if_failed()
    assert_the_next_launch_is_right(cell, leaves, lengths, dtype)


@pytest.mark.cuda
def test_a_first_launch_under_inference_mode_leaves_later_ones_outside_it_working(monkeypatch):
    """The status word is made on a device's first launch: made under inference_mode, it could not be written outside
    it, and every later launch failed ("Inplace update to inference tensor outside InferenceMode")."""
    monkeypatch.setattr(persistent._LaunchStatus, "_by_device", {})
    leaves, lengths = random_layer("gru", 9, 3, 64, torch.float32, True, seed=8)
    arguments = [t.detach() for t in leaves]
    with torch.inference_mode():
        inferred, _ = persistent_layer("gru", *arguments, lengths, False)
    with torch.no_grad():
        output, _ = persistent_layer("gru", *arguments, lengths, False)
    persistent.raise_if_failed()
    assert torch.equal(output, inferred)


@pytest.mark.cuda
def test_raise_if_failed_waits_for_launches_on_other_streams(monkeypatch):
    leaves, lengths = random_layer("relu", 64, 4, 2048, torch.float32, True, seed=5)
    monkeypatch.setattr(persistent, "SPIN_TIMEOUT_S", 0.0)  # the launch fails
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(500_000_000)  # the failing launch lands long after the caller's stream is idle
        persistent_layer("relu", *[t.detach() for t in leaves], lengths, False)
    with pytest.raises(RuntimeError, match="timed out"):
        persistent.raise_if_failed()
    torch.cuda.current_stream().wait_stream(side)


@pytest.mark.cuda
def test_a_failed_launch_is_raised_by_the_next_pass_on_its_device(monkeypatch):
    """The lazy check the module promises, without raise_if_failed: once a failed launch's status has reached the host
    (here after a synchronisation), the next forward or backward on the device raises it before launching."""
    leaves, lengths = random_layer("relu", 64, 4, 2048, torch.float32, True, seed=5)

    def forward(timeout_s):
        monkeypatch.setattr(persistent, "SPIN_TIMEOUT_S", timeout_s)  # 0: every wait that finds a flag unset fails
        return persistent_layer("relu", *leaves, lengths, False)[0]

    forward(0.0)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="timed out"):
        forward(4.0)  # after a failed forward
    output = forward(0.0)
    torch.cuda.synchronize()
    monkeypatch.setattr(persistent, "SPIN_TIMEOUT_S", 4.0)
    with pytest.raises(RuntimeError, match="timed out"):
        output.sum().backward()  # the backward of a failed forward
    output = forward(4.0)
    monkeypatch.setattr(persistent, "SPIN_TIMEOUT_S", 0.0)
    output.sum().backward()
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="timed out"):
        forward(4.0)  # after a failed backward
    assert_the_next_launch_is_right("relu", leaves, lengths, torch.float32)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_layer_on_another_gpu_than_the_current_one_trains_and_reports_there():
    """The status word's copy and its event on the word's own GPU: recorded on the current one, the backward (on
    autograd's thread for the tensors' GPU) raised "Event device 0 does not match recording stream's device 1"."""
    leaves, lengths = random_layer("gru", 9, 3, 64, torch.float32, True, seed=8)
    other = torch.device("cuda", 1)
    leaves = [t.detach().to(other).requires_grad_() for t in leaves]
    output, _ = persistent_layer("gru", *leaves, lengths, False)
    output.sum().backward()
    persistent.raise_if_failed(other)
    assert all(torch.isfinite(leaf.grad).all() for leaf in leaves if leaf is not None)


@pytest.mark.cuda
def test_lengths_and_bias_pairs_as_callers_pass_them():
    """Expanded CUDA lengths (one length for all) run as contiguous ones, a list or numpy's unsigned lengths as an
    int64 tensor; a bidirectional layer takes bias_hh=None."""
    leaves, _ = random_layer("gru", 9, 3, 64, torch.float32, False, seed=8)
    input_proj, hx, weight_hh, _ = [t.detach() if t is not None else None for t in leaves]
    expanded = torch.full((1,), 7, device=CUDA).expand(3)
    assert torch.equal(persistent_layer("gru", input_proj, hx, weight_hh, None, expanded, False)[0],
                       persistent_layer("gru", input_proj, hx, weight_hh, None, expanded.contiguous(), False)[0])
    both = torch.cat([input_proj, input_proj], dim=2)
    assert torch.equal(persistent_bidirectional_layer("gru", both, (hx, hx), (weight_hh, weight_hh), None, [9] * 3)[0],
                       persistent_bidirectional_layer("gru", both, (hx, hx), (weight_hh, weight_hh), (None, None),
                                                      [9] * 3)[0])
    expected, _ = persistent_layer("gru", input_proj, hx, weight_hh, None, torch.tensor([9, 5, 3]), False)
    assert torch.equal(persistent_layer("gru", input_proj, hx, weight_hh, None, [9, 5, 3], False)[0], expected)
    # gate inputs in another layout than the kernel reads (a caller's own projection) as their contiguous copy
    strided = input_proj.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    assert torch.equal(persistent_layer("gru", strided, hx, weight_hh, None, [9, 5, 3], False)[0], expected)
    # numpy's unsigned lengths, which torch cannot compare (this raised NotImplementedError), as int64 ones
    unsigned = np.array([9, 5, 3], dtype=np.uint64)
    assert torch.equal(persistent_layer("gru", input_proj, hx, weight_hh, None, unsigned, False)[0], expected)


@pytest.mark.cuda
@pytest.mark.parametrize("cell, hidden_size, batch_size, directions, one_cluster", [
    ("relu", 1024, 4, 1, (True, True)),  # 16 CTAs of 64 units, forward and backward
    ("gru", 512, 4, 2, (True, False)),  # a GRU's backward publishes three values a unit: the plain engine
    ("lstm", 256, 8, 1, (True, False)),
    ("tanh", 64, 1, 2, (True, True)),  # one CTA a direction
    ("gru", 512, 16, 1, (False, False)),  # more utterances than the cluster engine takes
    ("relu", 1024, 8, 1, (False, False)),  # 16 KB of the vector a step into each CTA: level with the plain engine
    ("gru", 1152, 4, 1, (False, False)),  # more weights than 16 SMs' registers hold
])
def test_small_bf16_layers_run_in_one_cluster(cell, hidden_size, batch_size, directions, one_cluster):
    # One cluster a direction, each step handed off through distributed shared memory, ran the bf16 ReLU to 1024 units,
    # the GRU and the LSTM to 512 1.1-1.8x as fast as the plain engine where each CTA receives up to 8 KB of the vector
    # a step (NOTES.md, "The cluster engine lands").
    plans = launch_plans(cell, hidden_size, batch_size, torch.bfloat16, CUDA, directions)
    assert [plan["one_cluster"] for plan in plans] == list(one_cluster)
    for plan in plans:
        if plan["one_cluster"]:
            assert plan["cluster_size"] == plan["ctas_per_direction"] <= 16
            assert plan["units_per_cta"] % 8 == 0 and plan["units_per_cta"] * plan["ctas_per_direction"] >= hidden_size


@pytest.mark.cuda
# The ReLU in the chained engine, the GRU's forward in the cluster engine, the others in the plain one.
@pytest.mark.parametrize("cell, hidden_size, dtype", [
    ("tanh", 512, torch.float32), ("relu", 2048, torch.float32), ("gru", 512, torch.bfloat16),
    ("lstm", 512, torch.float32)])
def test_forward_and_backward_capture_in_a_cuda_graph(cell, hidden_size, dtype):
    leaves, lengths = random_layer(cell, 33, 4, hidden_size, dtype, True, seed=6)
    upstream = random_upstream(cell, 33, 4, hidden_size, dtype, seed=7)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: build, plan, status word
        outputs_and_gradients(persistent_layer, cell, leaves, lengths, True, upstream)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph):
        captured = outputs_and_gradients(persistent_layer, cell, leaves, lengths, True, upstream)

    with torch.no_grad():  # fresh values in the captured input buffers
        for leaf in leaves:
            leaf.copy_(torch.randn_like(leaf) * leaf.abs().mean())
    graph.replay()
    torch.cuda.synchronize()
    persistent.raise_if_failed()
    eager = outputs_and_gradients(persistent_layer, cell, leaves, lengths, True, upstream)
    for a, b in zip(captured, eager):  # stale inputs or a skipped launch would be off by O(1)
        assert relative_error(a.double(), b.double()) <= 1e-6


@pytest.mark.cuda
@pytest.mark.parametrize("check", ["raise_if_failed", "graph_replayed"])
def test_timed_out_wait_in_a_cuda_graph_raises_after_replay(monkeypatch, check):
    leaves, lengths = random_layer("lstm", 64, 4, 1024, torch.float32, True, seed=7)
    arguments = layer_arguments("lstm", leaves)
    monkeypatch.setattr(persistent, "SPIN_TIMEOUT_S", 0.0)  # captured into the launch: every replay fails at once
    with torch.no_grad():
        persistent_layer("lstm", *arguments, lengths, False)  # warm-up outside capture
        with pytest.raises(RuntimeError, match="timed out"):
            persistent.raise_if_failed()
        graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(graph):
            persistent_layer("lstm", *arguments, lengths, False)
    persistent.raise_if_failed()  # capturing launched nothing
    graph.replay()
    if check == "graph_replayed":
        persistent.graph_replayed()  # copies the status word, waits for nothing: returns before the failure is seen
        torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="timed out"):
        if check == "raise_if_failed":
            persistent.raise_if_failed()
        else:
            persistent.graph_replayed()  # finds the copy landed


@pytest.mark.cuda
@pytest.mark.parametrize("cell", ["relu", "gru", "lstm"])
def test_custom_ops_pass_opcheck(cell):
    leaves, lengths = random_layer(cell, 5, 3, 40, torch.float32, True, seed=7)
    input_proj, hx, *rest = [t.detach() for t in leaves]
    cx = rest.pop(0)[None] if cell == "lstm" else None
    weight, bias = rest
    status = torch.zeros(1, dtype=torch.int32, device=CUDA)
    forward_args = (cell, input_proj, hx[None], cx, [weight], [bias], lengths, False, status, 10**9, False)
    torch.library.opcheck(torch.ops.prnn_kernels.persistent_forward.default, forward_args)
    output, h_n, c_n, state, saved = torch.ops.prnn_kernels.persistent_forward(*forward_args)
    grad_c_n = torch.randn_like(c_n) if cell == "lstm" else None
    backward_args = (cell, torch.randn_like(output), torch.randn_like(h_n), grad_c_n, state, saved, [weight], lengths,
                     False, status, 10**9, False)
    torch.library.opcheck(torch.ops.prnn_kernels.persistent_backward.default, backward_args)


@pytest.mark.cuda
def test_padding_that_is_not_finite_changes_nothing_on_the_persistent_backend():
    """The input projection's weight gradient sums over every row, padding included: 0 x inf would make it NaN."""
    torch.manual_seed(0)
    module = prnn_kernels.GRU(16, 32, num_layers=2, bidirectional=True, backend="persistent").to(CUDA)
    lengths = torch.tensor([12, 5, 9], device=CUDA)
    padded = torch.arange(12, device=CUDA)[:, None] >= lengths[None, :]  # (T, B)
    x = torch.randn(12, 3, 16, device=CUDA)
    results = []
    for values in (x, x.masked_fill(padded[:, :, None], math.inf)):
        values = values.clone().requires_grad_()
        output, h_n = module(values, lengths=lengths)
        results.append([output, h_n, *torch.autograd.grad(output.sum() + h_n.sum(), [values, *module.parameters()])])
    for zero_padded, inf_padded in zip(*results):
        assert torch.isfinite(inf_padded).all()
        torch.testing.assert_close(inf_padded, zero_padded)


def test_the_python_names_the_readme_gives_exist():
    """It told users to call prnn_kernels.raise_if_failed(), which is prnn_kernels.persistent's: an AttributeError."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    names = sorted(set(re.findall(r"prnn_kernels(?:\.\w+)+", readme)))
    assert "prnn_kernels.persistent.support" in names
    missing = []
    for name in names:
        parts = name.split(".")
        # The longest importable module, then attributes.
        for split in range(len(parts), 0, -1):
            try:
                found = importlib.import_module(".".join(parts[:split]))
                break
            except ModuleNotFoundError:
                continue
        for attribute in parts[split:]:
            found = getattr(found, attribute, None)
        if found is None:
            missing.append(name)
    assert missing == []


class _Square(torch.autograd.Function):
    """x^2 with a first-order backward only, as the persistent layer's."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @products.first_order_backward
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def test_a_second_derivative_of_a_first_order_backward_is_refused_not_none():
    """torch's once_differentiable gave the gradient no graph where the incoming one needed none (out.sum()), so the
    second derivative came back None (allow_unused) or 'not used in the graph'."""
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(_Square.apply(x).sum(), x)
    assert torch.equal(grad, 2 * x.detach())
    with pytest.raises(RuntimeError, match=r"no derivative of their own \(create_graph=True\); run the layer on "
                                           r"backend='reference'"):
        torch.autograd.grad(_Square.apply(x).sum(), x, create_graph=True)


@pytest.mark.cuda
@pytest.mark.parametrize("cell, dtype", [("gru", torch.float32), ("relu", torch.bfloat16)])
def test_a_second_derivative_through_the_persistent_layer_is_refused(cell, dtype):
    layer = (modules.GRU(32, 64, backend="persistent") if cell == "gru" else
             modules.RNN(32, 64, nonlinearity=cell, backend="persistent")).to(CUDA, dtype)
    x = torch.randn(9, 3, 32, device=CUDA, dtype=dtype, requires_grad=True)
    with pytest.raises(RuntimeError, match="no derivative of their own"):
        torch.autograd.grad(layer(x)[0].float().sum(), x, create_graph=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_model_runs_its_persistent_layers_eagerly(dtype):
    """torch.compile traced into the layer and failed on its launch status's CUDA events ('expected event to be a
    torch.Event object'): the layers run eagerly inside the compiled model, with the same outputs and gradients, and
    without Dynamo's warnings of what it met tracing into the support query (its cache, the extension's loading)."""
    torch.manual_seed(11)
    layer = modules.GRU(32, 64, bidirectional=True, backend="persistent").to(CUDA, dtype)
    x = torch.randn(9, 3, 32, device=CUDA, dtype=dtype, requires_grad=True)
    results = []
    for run in (layer, torch.compile(layer)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            output = run(x)[0]
        assert [str(w.message) for w in caught if "Dynamo" in str(w.message)] == []
        results.append([output, *torch.autograd.grad(output.float().square().sum(), [x, *layer.parameters()])])
    persistent.raise_if_failed()
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)
