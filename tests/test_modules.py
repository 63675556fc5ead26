"""prnn_kernels.RNN / GRU / LSTM: the reference stack against torch.nn in float64, state dicts, backend choice."""
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import prnn_kernels
from prnn_kernels import relative_error

TOLERANCE = 1e-10
NUM_STEPS = 8
INPUT_SIZE = 5


def module_pair(cell, **kwargs):
    """(torch.nn module, prnn_kernels module with the torch module's weights loaded), float64."""
    kwargs = dict(kwargs, dtype=torch.float64)
    if cell in ("relu", "tanh"):
        kwargs["nonlinearity"] = cell
    name = {"relu": "RNN", "tanh": "RNN", "gru": "GRU", "lstm": "LSTM"}[cell]
    theirs = getattr(nn, name)(INPUT_SIZE, **kwargs)
    ours = getattr(prnn_kernels, name)(INPUT_SIZE, backend="reference", **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def run_torch_packed(module, x, hx, lengths):
    """torch.nn over a packed batch: the ground truth for ragged sequences."""
    packed = pack_padded_sequence(x, lengths, batch_first=module.batch_first, enforce_sorted=False)
    output, h_n = module(packed, hx)
    num_steps = x.shape[1 if module.batch_first else 0]
    return pad_packed_sequence(output, batch_first=module.batch_first, total_length=num_steps)[0], h_n


def flatten(output, h_n):
    return [output, *(h_n if isinstance(h_n, tuple) else (h_n,))]


@pytest.mark.parametrize("cell", ["relu", "tanh", "gru", "lstm"])
@pytest.mark.parametrize(
    "batch_size, hidden_size, num_layers, bidirectional, batch_first, bias",
    [
        (1, 7, 1, False, False, True),
        (3, 13, 2, True, False, True),
        (7, 33, 3, True, True, True),
        (3, 6, 2, False, True, False),
    ],
)
def test_reference_stack_matches_torch(cell, batch_size, hidden_size, num_layers, bidirectional, batch_first, bias):
    torch.manual_seed(0)
    sizes = dict(hidden_size=hidden_size, num_layers=num_layers, bidirectional=bidirectional)
    theirs, ours = module_pair(cell, **sizes, batch_first=batch_first, bias=bias)
    shape = (batch_size, NUM_STEPS, INPUT_SIZE) if batch_first else (NUM_STEPS, batch_size, INPUT_SIZE)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    lengths = torch.randint(1, NUM_STEPS + 1, (batch_size,))
    lengths[-1] = NUM_STEPS
    state_shape = (num_layers * (2 if bidirectional else 1), batch_size, hidden_size)
    num_states = 2 if cell == "lstm" else 1
    states = [torch.randn(state_shape, dtype=torch.float64, requires_grad=True) for _ in range(num_states)]
    hx = tuple(states) if cell == "lstm" else states[0]

    expected = flatten(*run_torch_packed(theirs, x, hx, lengths))
    actual = flatten(*ours(x, hx, lengths=lengths))
    assert len(actual) == len(expected)  # the zip below would pass a layer that drops its final state
    for name, a, e in zip(["output", "h_n", "c_n"], actual, expected):
        assert relative_error(a, e) < TOLERANCE, name

    upstream = [torch.randn_like(e) for e in expected]
    their_leaves = [x, *states, *theirs.parameters()]
    our_leaves = [x, *states, *ours.parameters()]
    names = ["input", *(f"hx[{i}]" for i in range(len(states))), *(name for name, _ in ours.named_parameters())]
    expected_grads = torch.autograd.grad(sum((e * g).sum() for e, g in zip(expected, upstream)), their_leaves)
    actual_grads = torch.autograd.grad(sum((a * g).sum() for a, g in zip(actual, upstream)), our_leaves)
    for name, a, e in zip(names, actual_grads, expected_grads, strict=True):
        assert relative_error(a, e) < TOLERANCE, name


@pytest.mark.parametrize("cell", ["tanh", "lstm"])
def test_full_length_without_lengths_or_hx(cell):
    torch.manual_seed(0)
    theirs, ours = module_pair(cell, hidden_size=9, num_layers=2, bidirectional=True)
    x = torch.randn(NUM_STEPS, 3, INPUT_SIZE, dtype=torch.float64)
    for a, e in zip(flatten(*ours(x)), flatten(*theirs(x)), strict=True):
        assert relative_error(a, e) < TOLERANCE


@pytest.mark.parametrize("backend", ["reference", "cudnn"])
def test_padding_values_change_nothing(backend):
    torch.manual_seed(0)
    _, module = module_pair("gru", hidden_size=6, num_layers=2, bidirectional=True)
    module.backend = backend
    lengths = torch.tensor([NUM_STEPS, 2, 5])
    padded = torch.arange(NUM_STEPS)[:, None] >= lengths[None, :]  # (T, B)
    x = torch.randn(NUM_STEPS, 3, INPUT_SIZE, dtype=torch.float64)
    other_padding = torch.where(padded[:, :, None], 1e3 * torch.randn_like(x), x)
    # Not finite either: the input projection's weight gradient sums over the padding rows too.
    not_finite_row = torch.tensor([math.inf, -math.inf, math.nan]).repeat(INPUT_SIZE)[:INPUT_SIZE]
    not_finite = torch.where(padded[:, :, None], not_finite_row, x)
    results = []
    for values in (x, other_padding, not_finite):
        values = values.clone().requires_grad_()
        output, h_n = module(values, lengths=lengths)
        grads = torch.autograd.grad(output.sum() + h_n.sum(), [values, *module.parameters()])
        results.append([output, h_n, *grads])
    for first, *others in zip(*results):
        for other in others:
            torch.testing.assert_close(first, other, rtol=0, atol=0)
    assert not results[0][0][padded].any()


def test_state_dict_loads_into_torch():
    torch.manual_seed(0)
    ours = prnn_kernels.LSTM(INPUT_SIZE, 11, num_layers=2, bidirectional=True, backend="reference", dtype=torch.float64)
    theirs = nn.LSTM(INPUT_SIZE, 11, num_layers=2, bidirectional=True, dtype=torch.float64)
    theirs.load_state_dict(ours.state_dict())
    assert list(theirs.state_dict()) == list(ours.state_dict())
    x = torch.randn(NUM_STEPS, 2, INPUT_SIZE, dtype=torch.float64)
    for a, e in zip(flatten(*ours(x)), flatten(*theirs(x)), strict=True):
        assert relative_error(a, e) < TOLERANCE


@pytest.mark.parametrize("cell", ["tanh", "gru", "lstm"])
def test_dropout_between_layers_only_in_training(cell):
    """Training draws the masks torch.nn draws (ATen's recurrent stack calls the same dropout between layers), so under
    one seed the outputs are torch.nn's: a dropout of the wrong rate or scale, or on the last layer's output, is not."""
    torch.manual_seed(0)
    theirs, ours = module_pair(cell, hidden_size=8, num_layers=3, bidirectional=True, dropout=0.5)
    x = torch.randn(NUM_STEPS, 3, INPUT_SIZE, dtype=torch.float64)
    theirs.eval()
    ours.eval()
    for a, e in zip(flatten(*ours(x)), flatten(*theirs(x)), strict=True):
        assert relative_error(a, e) < TOLERANCE
    evaluated = ours(x)[0]
    theirs.train()
    ours.train()
    seed = torch.seed()
    expected = flatten(*theirs(x))
    torch.manual_seed(seed)
    for a, e in zip(flatten(*ours(x)), expected, strict=True):
        assert relative_error(a, e) < TOLERANCE, f"seed {seed}"
    assert relative_error(expected[0], evaluated) > 1e-3  # the masks dropped something


def test_auto_on_cpu_runs_torch_silently():
    torch.manual_seed(0)
    theirs, module = module_pair("lstm", hidden_size=6)
    module.backend = "auto"
    x = torch.randn(NUM_STEPS, 2, INPUT_SIZE, dtype=torch.float64)
    lengths = torch.tensor([3, NUM_STEPS])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        automatic = flatten(*module(x, lengths=lengths))
    # Bit for bit torch.nn's own: against backend cudnn, a module that ran the reference for both passed.
    for a, e in zip(automatic, flatten(*run_torch_packed(theirs, x, None, lengths)), strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_backend_errors():
    with pytest.raises(ValueError, match="backend='fast'"):
        prnn_kernels.GRU(4, 8, backend="fast")
    gru = prnn_kernels.GRU(4, 8, backend="reference")
    with pytest.raises(ValueError, match="backend='Reference' is not one of"):  # set on a built module: ran as auto
        gru.backend = "Reference"
    assert gru.backend == "reference"
    with pytest.raises(ValueError, match="proj_size=3"):
        prnn_kernels.LSTM(4, 8, proj_size=3)
    with pytest.raises(ValueError, match="3-D"):
        prnn_kernels.GRU(4, 8)(torch.randn(5, 4))
    with pytest.raises(RuntimeError, match="input_size"):  # torch.nn's own check, on the reference path too
        prnn_kernels.GRU(4, 8, backend="reference")(torch.randn(5, 2, 3))


@pytest.mark.parametrize("backend", ["reference", "cudnn", "auto"])
@pytest.mark.parametrize("bidirectional", [1, 2, 0, "yes"])
def test_bidirectional_that_is_no_bool_is_refused_naming_it(backend, bidirectional):
    # torch.nn checks bias and batch_first so, but not bidirectional: the reference ran 1 or 2 as two directions, and
    # cuDNN's path ended in torch's "gru() received an invalid combination of arguments".
    with pytest.raises(TypeError, match=f"prnn_kernels.GRU: bidirectional should be of type bool, got: "
                                        f"{type(bidirectional).__name__}"):
        prnn_kernels.GRU(4, 3, bidirectional=bidirectional, backend=backend)
    with pytest.raises(TypeError, match="bidirectional should be of type bool"):  # positional, as torch.nn takes it
        prnn_kernels.GRU(4, 3, 1, True, False, 0.0, bidirectional, backend=backend)


@pytest.mark.parametrize("backend", ["reference", "cudnn"])
def test_arguments_torch_would_misread_are_refused_naming_them(backend):
    # Left unchecked, the backends disagreed: cuDNN's packing dropped a sample that a short lengths left out while the
    # reference broadcast it, and a float length ran 3 steps on one and 4 on the other.
    gru, lstm = prnn_kernels.GRU(4, 3, backend=backend), prnn_kernels.LSTM(4, 3, backend=backend)
    x = torch.randn(5, 2, 4)
    refusals = [
        (lambda: gru(x, lengths=torch.tensor([3])), r"GRU: lengths must have shape \(2,\), one per sample, got \(1,\)"),
        (lambda: gru(x, lengths=torch.tensor([3.5, 5.0])), "lengths must be integers, got torch.float32"),
        (lambda: gru(x, lengths=[5, None]), r"GRU: lengths must be integers, got \[5, None\]"),
        (lambda: gru(x, lengths=[5, "3"]), r"GRU: lengths must be integers, got \[5, '3'\]"),
        (lambda: gru(x, lengths=[5, 2**70]), rf"GRU: lengths must be integers, got \[5, {2**70}\]"),
        (lambda: gru(x, lengths=torch.tensor([9, 5])), r"lengths must lie in \[1, T=5\], got \[9, 5\]"),
        (lambda: gru(x, lengths=torch.tensor([0, 5])), r"lengths must lie in \[1, T=5\], got \[0, 5\]"),
        (lambda: gru(torch.nn.utils.rnn.pack_padded_sequence(x, [5, 3])), "a PackedSequence is not taken"),
        (lambda: lstm(x, torch.zeros(1, 2, 3)), r"LSTM: hx must be a tuple \(h0, c0\), got Tensor"),
        (lambda: lstm(x, (torch.zeros(1, 2, 3),) * 3), r"hx must be a tuple \(h0, c0\), got a tuple of 3"),
        # An LSTM's pair handed to a GRU, and lists: torch.nn's own "'tuple' object has no attribute 'size'".
        (lambda: gru(x, (torch.zeros(1, 2, 3),) * 2), r"GRU: hx must be a tensor \(1, 2, 3\), got tuple"),
        (lambda: lstm(x, ([0.0] * 3, [0.0] * 3)), r"LSTM: hx must be a tuple of two tensors \(1, 2, 3\), got list"),
        (lambda: gru(x[:0]), r"GRU: input has no time steps, shape \(0, 2, 4\)"),
    ]
    for call, message in refusals:
        with pytest.raises(ValueError, match=message):
            call()
    output, _ = gru(x, lengths=[5, 3])  # a list, as pack_padded_sequence takes
    assert output.shape == (5, 2, 3) and not output[3:, 1].any()


@pytest.mark.parametrize("backend", ["reference", "cudnn"])
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64])
def test_unsigned_numpy_lengths_run_as_int64_ones(backend, dtype):
    # torch has no comparisons for its unsigned types: these lengths raised NotImplementedError ("lt_cpu").
    gru = prnn_kernels.GRU(4, 3, backend=backend)
    x = torch.randn(5, 2, 4)
    expected = flatten(*gru(x, lengths=torch.tensor([5, 3])))
    for actual, wanted in zip(flatten(*gru(x, lengths=np.array([5, 3], dtype=dtype))), expected, strict=True):
        assert torch.equal(actual, wanted)
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, T=5\], got \[6, 3\]"):
        gru(x, lengths=np.array([6, 3], dtype=dtype))
    if dtype == np.uint64:  # above int64's range: refused, naming the value given
        with pytest.raises(ValueError, match=r"got \[18446744073709551615, 3\]"):
            gru(x, lengths=np.array([2**64 - 1, 3], dtype=dtype))


def test_persistent_backend_on_cpu_says_why():
    pytest.importorskip("prnn_kernels.persistent")
    module = prnn_kernels.GRU(4, 8, backend="persistent")
    with pytest.raises(ValueError, match="CUDA"):
        module(torch.randn(5, 2, 4))
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        module.backend_for(2, torch.float32, "cpu")


def test_a_sliced_layer_asks_for_the_persistent_kernel_at_its_slice():
    """batch_slice lets backend persistent run a batch above the 32 its kernels take at once: the support query is
    asked for a slice. Without a GPU a slice of 8 is told it needs one, where the whole batch of 40 is told its size."""
    pytest.importorskip("prnn_kernels.persistent")
    with pytest.raises(ValueError, match="batch size 40 is out of range"):
        prnn_kernels.GRU(4, 8, backend="persistent").backend_for(40, torch.float32, "cpu")
    with pytest.raises(ValueError, match="cannot run: needs a CUDA GPU"):
        prnn_kernels.GRU(4, 8, backend="persistent", batch_slice=8).backend_for(40, torch.float32, "cpu")


def test_a_sliced_layer_asks_for_the_persistent_kernel_at_its_shorter_last_slice_too(monkeypatch):
    """A batch of 7 in slices of 4 runs a slice of 3, which the support query was never asked about: a plan refused
    there failed in the forward, or in a later step, where "auto" would have run cuDNN."""
    persistent = pytest.importorskip("prnn_kernels.persistent")
    monkeypatch.setattr(persistent, "support", lambda cell, hidden_size, batch_size, dtype, device: persistent.Support(
        batch_size != 3, f"no plan at batch {batch_size}"))
    gru = prnn_kernels.GRU(4, 8, backend="persistent", batch_slice=4)
    assert gru.backend_for(8, torch.float32, "cuda") == gru.backend_for(6, torch.float32, "cuda") == "persistent"
    with pytest.raises(ValueError, match="cannot run: no plan at batch 3"):
        gru.backend_for(7, torch.float32, "cuda")


@pytest.mark.parametrize("backend, expected", [("auto", "cudnn"), ("cudnn", "cudnn"), ("reference", "reference")])
def test_backend_for_a_cpu_input(backend, expected):
    assert prnn_kernels.LSTM(4, 8, backend=backend).backend_for(2, torch.float32, "cpu") == expected


@pytest.mark.parametrize("cell", ["relu", "gru", "lstm"])
@pytest.mark.parametrize("backend", ["reference", "cudnn"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_batch_slices_compute_the_whole_batch(cell, backend, batch_first, monkeypatch):
    """Slices of 3, the last one short, give the whole batch's outputs, final states and every gradient."""
    torch.manual_seed(0)
    _, module = module_pair(cell, hidden_size=6, num_layers=2, bidirectional=True, batch_first=batch_first)
    module.backend = backend
    run_sizes = []
    run = module._forward_on
    monkeypatch.setattr(module, "_forward_on", lambda backend, input, hx, lengths: run_sizes.append(
        input.shape[0 if batch_first else 1]) or run(backend, input, hx, lengths))
    batch_size = 7
    shape = (batch_size, NUM_STEPS, INPUT_SIZE) if batch_first else (NUM_STEPS, batch_size, INPUT_SIZE)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    lengths = torch.randint(1, NUM_STEPS + 1, (batch_size,))
    states = [torch.randn(4, batch_size, 6, dtype=torch.float64, requires_grad=True)
              for _ in range(2 if cell == "lstm" else 1)]
    hx = tuple(states) if cell == "lstm" else states[0]
    results = []
    for batch_slice in (None, 3):
        module.batch_slice = batch_slice
        outputs = flatten(*module(x, hx, lengths=lengths))
        upstream = sum((output * torch.linspace(-1, 1, output.numel(), dtype=torch.float64).view_as(output)).sum()
                       for output in outputs)
        results.append([*outputs, *torch.autograd.grad(upstream, [x, *states, *module.parameters()])])
    assert run_sizes == [7, 3, 3, 1]  # the whole batch, then its slices
    for whole, sliced in zip(*results, strict=True):
        assert relative_error(sliced, whole) < TOLERANCE


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_each_slice_gets_its_initial_state_contiguous(cell, monkeypatch):
    """cuDNN refuses an hx that is not contiguous ("rnn: hx is not contiguous", torch's _cudnn_rnn), and a slice of
    a stack's or a bidirectional layer's state, (L * D, B, H) cut along B, is not: on a GPU, batch_slice with an
    initial state and no lengths (no packing, which copies the state) failed there."""
    _, module = module_pair(cell, hidden_size=6, num_layers=2, bidirectional=True)
    module.backend, module.batch_slice = "cudnn", 3
    handed = []
    run = module._forward_on
    monkeypatch.setattr(module, "_forward_on", lambda backend, input, hx, lengths: handed.extend(
        hx if isinstance(hx, tuple) else [hx]) or run(backend, input, hx, lengths))
    states = [torch.randn(4, 7, 6, dtype=torch.float64) for _ in range(2 if cell == "lstm" else 1)]
    module(torch.randn(NUM_STEPS, 7, INPUT_SIZE, dtype=torch.float64), tuple(states) if cell == "lstm" else states[0])
    assert len(handed) == 3 * len(states) and all(state.is_contiguous() for state in handed)


@pytest.mark.parametrize("backend", ["reference", "cudnn"])
def test_an_initial_state_of_another_dtype_than_the_input_is_refused_naming_it(backend):
    # Unchecked, the backends disagreed: the reference ran an LSTM's float64 c0 at T = 1 and returned c_n in float32,
    # ATen's recurrence refused it as "get_mkldnn_dtype: unsupported data type", a GRU's h0 as "mat1 and mat2 must have
    # the same dtype", and the persistent kernel cast it.
    gru, lstm = prnn_kernels.GRU(4, 3, backend=backend), prnn_kernels.LSTM(4, 3, backend=backend)
    x, state = torch.randn(1, 2, 4), torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="GRU: hx must have the input's dtype torch.float32, got torch.float64"):
        gru(x, state.double())
    with pytest.raises(ValueError, match=r"LSTM: hx\[1\] must have the input's dtype torch.float32, got torch.float64"):
        lstm(x, (state, state.double()))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # which casts the state with the input, as torch.nn's does
        assert gru(x, state.bfloat16())[1].shape == (1, 2, 3)


@pytest.mark.parametrize("backend", ["reference", "cudnn"])
def test_an_initial_state_is_checked_against_the_whole_batch_before_slicing(backend):
    # Checked slice by slice, a state of 6 for a batch of 4 ran, and one of 3 was refused as "(1, 2, 5)".
    gru = prnn_kernels.GRU(5, 5, backend=backend, batch_slice=2)
    lstm = prnn_kernels.LSTM(5, 5, backend=backend, batch_slice=2)
    x = torch.randn(3, 4, 5)
    for size in (6, 3):
        with pytest.raises(RuntimeError, match=rf"Expected hidden size \(1, 4, 5\), got \[1, {size}, 5\]"):
            gru(x, torch.zeros(1, size, 5))
    with pytest.raises(RuntimeError, match=r"Expected hidden\[1\] size \(1, 4, 5\), got \[1, 6, 5\]"):
        lstm(x, (torch.zeros(1, 4, 5), torch.zeros(1, 6, 5)))
    assert gru(x, torch.zeros(1, 4, 5))[1].shape == (1, 4, 5)


def test_the_backend_is_chosen_for_the_dtype_the_recurrence_runs_in(monkeypatch):
    # Under autocast the input projection, which the kernel takes, is in autocast's dtype, not the input's.
    persistent = pytest.importorskip("prnn_kernels.persistent")
    asked = []
    monkeypatch.setattr(persistent, "support", lambda cell, hidden, batch, dtype, device: asked.append(dtype) or
                        persistent.Support(False, "asked"))
    module = prnn_kernels.GRU(4, 8, backend="persistent")
    x = torch.randn(5, 2, 4)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), pytest.raises(ValueError, match="asked"):
            module(x)
    assert asked == [torch.float32, torch.bfloat16]


def test_a_float64_layer_under_autocast_is_chosen_for_float64(monkeypatch):
    # Autocast leaves float64 alone, so the recurrence runs in it: asked for bf16, "auto" took the persistent kernel
    # for a float64 layer under bf16 autocast on a GPU, which then refused float64 instead of falling back to cuDNN.
    persistent = pytest.importorskip("prnn_kernels.persistent")
    asked = []
    monkeypatch.setattr(persistent, "support", lambda cell, hidden, batch, dtype, device: asked.append(dtype) or
                        persistent.Support(False, "asked"))
    module = prnn_kernels.GRU(4, 8, backend="persistent").double()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="asked"):
        module(torch.randn(5, 2, 4, dtype=torch.float64))
    assert asked == [torch.float64]


@pytest.mark.parametrize("cell", ["RNN", "GRU", "LSTM"])
def test_under_autocast_the_reference_returns_the_dtype_it_computes_in(cell):
    """As the persistent kernel does (its output and final state in the input projection's dtype): the zero initial
    state in the input's fp32 made the reference's h_n, and an LSTM's output, fp32 beside a bf16 output."""
    module = getattr(prnn_kernels, cell)(4, 8, backend="reference")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output, final = module(torch.randn(5, 2, 4), lengths=torch.tensor([5, 3]))
    finals = final if cell == "LSTM" else (final,)
    assert [output.dtype, *(part.dtype for part in finals)] == [torch.bfloat16] * (1 + len(finals))


def test_auto_warns_once_for_a_layer_whatever_batch_sizes_it_falls_back_on(monkeypatch):
    persistent = pytest.importorskip("prnn_kernels.persistent")
    monkeypatch.setattr(persistent, "support", lambda cell, hidden, batch, dtype, device:
                        persistent.Support(False, f"batch size {batch} is out of range"))
    monkeypatch.setattr(prnn_kernels.modules, "_warned_fallbacks", set())
    module = prnn_kernels.GRU(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch_size in (0, 40, 37, 48, 40):  # the empty batch first, which must not use up the warning
            assert module.backend_for(batch_size, torch.float32, "cuda") == "cudnn"
        prnn_kernels.GRU(4, 16).backend_for(40, torch.float32, "cuda")  # another layer shape warns for itself
        module.backend_for(40, torch.bfloat16, "cuda")  # so does another dtype: the reasons differ by precision
    assert [str(warning.message) for warning in caught] == [
        "prnn_kernels: gru H=8 torch.float32 runs on cuDNN, not the persistent kernel: batch size 40 is out of range",
        "prnn_kernels: gru H=16 torch.float32 runs on cuDNN, not the persistent kernel: batch size 40 is out of range",
        "prnn_kernels: gru H=8 torch.bfloat16 runs on cuDNN, not the persistent kernel: batch size 40 is out of range",
    ]


def test_auto_runs_the_persistent_kernel_silently_where_the_support_query_says_it_can(monkeypatch):
    """The query's answer is played, as without a GPU it is always no: an "auto" that never took the kernel passed
    every test that runs without one."""
    persistent = pytest.importorskip("prnn_kernels.persistent")
    monkeypatch.setattr(persistent, "support", lambda cell, hidden, batch, dtype, device: persistent.Support(True, ""))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prnn_kernels.GRU(4, 8).backend_for(4, torch.float32, "cuda") == "persistent"


@pytest.mark.parametrize("cell", ["relu", "gru", "lstm"])
@pytest.mark.parametrize("backend", ["reference", "cudnn", "auto", "persistent"])  # persistent: nothing to run
# [] and np.array([]) are float tensors to torch, and were refused: "lengths must be integers, got torch.float32".
@pytest.mark.parametrize("lengths", [torch.zeros(0, dtype=torch.int64), [], np.array([])],
                         ids=["int64", "list", "numpy"])
def test_an_empty_batch_with_lengths_gives_empty_outputs(cell, backend, lengths):
    module = prnn_kernels.LSTM if cell == "lstm" else prnn_kernels.GRU if cell == "gru" else prnn_kernels.RNN
    layer = module(3, 5, num_layers=2, bidirectional=True, backend=backend, **({"nonlinearity": "relu"}
                                                                            if cell == "relu" else {}))
    output, state = layer(torch.randn(4, 0, 3), lengths=lengths)
    assert output.shape == (4, 0, 10)
    for tensor in state if cell == "lstm" else (state,):
        assert tensor.shape == (4, 0, 5)


def test_batch_slice_is_checked_and_shown():
    with pytest.raises(ValueError, match="batch_slice=0"):
        prnn_kernels.GRU(4, 8, batch_slice=0)
    with pytest.raises(ValueError, match="batch_slice=2.5"):
        prnn_kernels.GRU(4, 8, batch_slice=2.5)
    with pytest.raises(ValueError, match="batch_slice=True"):  # a bool is an int to isinstance
        prnn_kernels.GRU(4, 8, batch_slice=True)
    gru = prnn_kernels.GRU(4, 8, batch_slice=4)
    assert "batch_slice=4" in repr(gru)
    with pytest.raises(ValueError, match="batch_slice=-1"):  # set on a built module, as a sweep of slices would
        gru.batch_slice = -1
    assert gru.batch_slice == 4


@pytest.mark.parametrize("backend", ["reference", "cudnn", "auto"])
@pytest.mark.parametrize("with_state", [False, True], ids=["no_hx", "hx"])
def test_a_layer_on_the_meta_device_gives_torch_nns_shapes(backend, with_state):
    # As torch.nn's layers do, for a model built on the meta device to size it: asking whether autocast was on for a
    # device type autocast has none for raised "unknown device type for autocast".
    theirs = nn.LSTM(4, 3, num_layers=2, bidirectional=True, device="meta")
    ours = prnn_kernels.LSTM(4, 3, num_layers=2, bidirectional=True, device="meta", backend=backend)
    x = torch.randn(5, 2, 4, device="meta")
    hx = (torch.zeros(4, 2, 3, device="meta"),) * 2 if with_state else None
    output, (h_n, c_n) = ours(x, hx)
    expected_output, (expected_h_n, expected_c_n) = theirs(x, hx)
    assert output.device.type == "meta"
    assert (output.shape, h_n.shape, c_n.shape) == (expected_output.shape, expected_h_n.shape, expected_c_n.shape)


def test_the_persistent_backend_on_the_meta_device_says_it_needs_a_gpu():
    layer = prnn_kernels.GRU(4, 3, device="meta", backend="persistent")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        layer(torch.randn(5, 2, 4, device="meta"))
