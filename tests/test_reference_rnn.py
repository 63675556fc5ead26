"""reference_layer against torch.nn in float64: outputs, final states and every gradient, over ragged batches; and its
recurrent parameters' gradients under bf16 autocast against float64."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from prnn_kernels import NUM_GATES, reference_layer, relative_error

TOLERANCE = 1e-10
NUM_STEPS = 9
INPUT_SIZE = 4


def torch_bidirectional_layer(cell, hidden_size, bias):
    """A one-layer bidirectional torch.nn module: its two directions hold the weights for both `reverse` values."""
    kwargs = dict(bias=bias, bidirectional=True, dtype=torch.float64)
    if cell in ("relu", "tanh"):
        return nn.RNN(INPUT_SIZE, hidden_size, nonlinearity=cell, **kwargs)
    return {"gru": nn.GRU, "lstm": nn.LSTM}[cell](INPUT_SIZE, hidden_size, **kwargs)


def ragged_lengths(batch_size):
    lengths = torch.randint(1, NUM_STEPS + 1, (batch_size,))
    lengths[0] = NUM_STEPS
    return lengths


@pytest.mark.parametrize("cell", ["relu", "tanh", "gru", "lstm"])
@pytest.mark.parametrize(
    "batch_size, hidden_size, reverse, bias",
    [(1, 5, False, True), (3, 13, True, True), (7, 37, False, False), (7, 37, True, True)],
)
def test_layer_matches_torch(cell, batch_size, hidden_size, reverse, bias):
    torch.manual_seed(0)
    module = torch_bidirectional_layer(cell, hidden_size, bias)
    direction = 1 if reverse else 0
    x = torch.randn(NUM_STEPS, batch_size, INPUT_SIZE, dtype=torch.float64, requires_grad=True)
    lengths = ragged_lengths(batch_size)
    # (2, B, H) per state, shared by both computations so their gradients land in the same leaves.
    states = [torch.randn(2, batch_size, hidden_size, dtype=torch.float64, requires_grad=True)
              for _ in range(2 if cell == "lstm" else 1)]

    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    packed_output, torch_final = module(packed, tuple(states) if cell == "lstm" else states[0])
    torch_output = pad_packed_sequence(packed_output, total_length=NUM_STEPS)[0]
    torch_output = torch_output[..., direction * hidden_size:(direction + 1) * hidden_size]
    torch_final = [s[direction] for s in (torch_final if cell == "lstm" else (torch_final,))]

    weight_ih, weight_hh, *biases = module.all_weights[direction]
    bias_ih, bias_hh = biases if bias else (None, None)
    hx = tuple(s[direction] for s in states) if cell == "lstm" else states[0][direction]
    output, final = reference_layer(cell, F.linear(x, weight_ih, bias_ih), hx, weight_hh, bias_hh, lengths, reverse)
    final = list(final) if cell == "lstm" else [final]

    upstream = [torch.randn_like(output)] + [torch.randn_like(s) for s in final]
    leaves = [x, *states, *module.all_weights[direction]]

    def gradients(results):
        loss = sum((r * g).sum() for r, g in zip(results, upstream))
        return torch.autograd.grad(loss, leaves)

    expected = [torch_output, *torch_final]
    actual = [output, *final]
    assert len(actual) == len(expected)  # the zip below would pass a layer that drops its final state
    for name, a, e in zip(["output", "h_n", "c_n"], actual, expected):
        assert relative_error(a, e) < TOLERANCE, name
    for index, (a, e) in enumerate(zip(gradients(actual), gradients(expected))):
        assert relative_error(a, e) < TOLERANCE, f"gradient of leaf {index}"


@pytest.mark.parametrize("cell", ["relu", "tanh", "gru", "lstm"])
@pytest.mark.parametrize("reverse", [False, True])
def test_padding_is_ignored(cell, reverse):
    torch.manual_seed(1)
    batch_size, hidden_size = 4, 6
    lengths = torch.tensor([NUM_STEPS, 3, 0, 1])
    gates = NUM_GATES[cell] * hidden_size
    weight_hh = torch.randn(gates, hidden_size, dtype=torch.float64, requires_grad=True)
    bias_hh = torch.randn(gates, dtype=torch.float64)
    hx = torch.randn(batch_size, hidden_size, dtype=torch.float64)
    hx = (hx, torch.randn_like(hx)) if cell == "lstm" else hx
    padded = torch.arange(NUM_STEPS)[:, None] >= lengths[None, :]  # (T, B)
    input_proj = torch.randn(NUM_STEPS, batch_size, gates, dtype=torch.float64)
    other_padding = torch.where(padded[:, :, None], 1e3 * torch.randn_like(input_proj), input_proj)

    results = []
    for values in (input_proj, other_padding):
        values = values.clone().requires_grad_()
        output, final = reference_layer(cell, values, hx, weight_hh, bias_hh, lengths, reverse)
        final = final[0] if cell == "lstm" else final
        input_grad, weight_grad = torch.autograd.grad((output.sum() + final.sum()), [values, weight_hh])
        results.append((output, final, input_grad, weight_grad))

    for first, second in zip(*results):
        assert torch.equal(first, second)
    output, final, input_grad, _ = results[0]
    assert not output[padded].any()
    assert not input_grad[padded].any()
    # The sample with no steps keeps its initial state.
    assert torch.equal(final[2], (hx[0] if cell == "lstm" else hx)[2])


@pytest.mark.parametrize("cell", ["tanh", "gru", "lstm"])
def test_autocast_sums_recurrent_gradients_in_the_parameters_dtype(cell):
    """fp32 parameters under bf16 autocast, as the trainer's `train.amp=bf16` gives them: each step's weight_hh and
    bias_hh gradient is summed in fp32. Summed in bf16 over 256 steps they were 1.7-2.1 % off float64; in fp32,
    0.5-0.7 %. ReLU is left out: bf16 rounding moves which pre-activations pass, and its derivative jumps there (5-8 %
    either way)."""
    torch.manual_seed(3)
    num_steps, batch_size, hidden_size = 256, 4, 64
    gate_rows = NUM_GATES[cell] * hidden_size
    input_proj = torch.randn(num_steps, batch_size, gate_rows).bfloat16()  # as autocast's input GEMM returns it
    weight_hh = torch.randn(gate_rows, hidden_size) / hidden_size**0.5
    bias_hh = torch.randn(gate_rows) * 0.1
    lengths = torch.randint(num_steps // 2, num_steps + 1, (batch_size,))
    grad_output = torch.randn(num_steps, batch_size, hidden_size)

    def parameter_grads(dtype, autocast):
        weight, bias = (p.to(dtype).requires_grad_() for p in (weight_hh, bias_hh))
        hx = torch.zeros(batch_size, hidden_size, dtype=input_proj.dtype if autocast else dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            output, _ = reference_layer(cell, input_proj if autocast else input_proj.to(dtype),
                                        (hx, hx) if cell == "lstm" else hx, weight, bias, lengths, reverse=False)
        (output.to(dtype) * grad_output.to(dtype)).sum().backward()
        return weight.grad, bias.grad

    expected = parameter_grads(torch.float64, autocast=False)
    for got, want in zip(parameter_grads(torch.float32, autocast=True), expected):
        assert got.dtype == torch.float32
        assert relative_error(got.double(), want) < 1e-2


@pytest.mark.parametrize("cell, input_proj, hx, weight_hh, bias_hh, refusal", [
    # One state or one bias for every sample ran, broadcast, where persistent_layer refuses them.
    ("gru", torch.randn(5, 2, 12), torch.zeros(1, 4), torch.randn(12, 4), None,
     r"hx must have shape \(2, 4\), got \(1, 4\)"),
    ("gru", torch.randn(5, 2, 12), torch.zeros(2, 4), torch.randn(12, 4), torch.randn(1),
     r"bias_hh must have shape \(12,\), got \(1,\)"),
    # These ended in torch's messages about sizes of "tensor a" and "mat1 and mat2", naming no argument.
    ("gru", torch.randn(5, 2, 13), torch.zeros(2, 4), torch.randn(12, 4), None,
     "input_proj's last dimension 13 is not 1 x 3 gates x H"),
    # A width of 0 is 3 gates x H = 0, which empty hx and weight_hh matched: a layer of no units ran.
    ("gru", torch.randn(5, 2, 0), torch.zeros(2, 0), torch.randn(0, 0), None,
     "input_proj's last dimension 0 is not 1 x 3 gates x H"),
    ("lstm", torch.randn(5, 2, 12), (torch.zeros(2, 4),) * 2, torch.randn(12, 4), None,
     r"weight_hh must have shape \(12, 3\), got \(12, 4\)"),
    ("gru", torch.randn(5, 2, 12), torch.zeros(2, 4), torch.randn(4, 12), None,
     r"weight_hh must have shape \(12, 4\), got \(4, 12\)"),
    ("lstm", torch.randn(5, 2, 16), torch.zeros(2, 4), torch.randn(16, 4), None,
     r"an LSTM's hx must be a tuple \(h0, c0\)"),
    ("relu", torch.randn(5, 4), torch.zeros(2, 4), torch.randn(4, 4), None, r"input_proj must be \(T, B, G\*H\)"),
    ("relu", torch.randn(5, 2, 4), torch.zeros(2, 4, device="meta"), torch.randn(4, 4), None,
     "hx is on meta, input_proj on cpu"),
    ("gru", torch.randn(5, 2, 12), torch.zeros(2, 4), torch.randn(12, 4), torch.randn(12, device="meta"),
     "bias_hh is on meta, input_proj on cpu"),
])
def test_arguments_of_other_shapes_are_refused_naming_them(cell, input_proj, hx, weight_hh, bias_hh, refusal):
    with pytest.raises(ValueError, match=f"reference_layer: {refusal}"):
        reference_layer(cell, input_proj, hx, weight_hh, bias_hh, [5, 3], False)


def test_unknown_cell_is_rejected():
    with pytest.raises(ValueError, match="'elman'"):
        reference_layer("elman", torch.zeros(2, 1, 3), torch.zeros(1, 3), torch.eye(3), None, torch.tensor([2]), False)


@pytest.mark.parametrize("lengths, refusal", [
    (torch.tensor([2.5, 5.0]), "must be integers, got torch.float32"),
    (torch.tensor([True, True]), "must be integers, got torch.bool"),
    (torch.tensor([3]), r"must have shape \(2,\), one per sample, got \(1,\)"),
    # persistent_layer refuses these; here a length past T ran T steps, a negative one none
    (torch.tensor([6, 3]), r"must lie in \[0, T=5\], got \[6, 3\]"),
    (torch.tensor([-1, 3]), r"must lie in \[0, T=5\], got \[-1, 3\]"),
])
def test_lengths_that_are_not_one_integer_in_0_to_T_per_sample_are_refused(lengths, refusal):
    # 2.5 would run three steps here where the persistent layer, which casts to int64, runs two.
    with pytest.raises(ValueError, match=rf"reference_layer: lengths {refusal}"):
        reference_layer("relu", torch.randn(5, 2, 4), torch.zeros(2, 4), torch.randn(4, 4), None, lengths, False)


def test_lengths_as_persistent_layer_takes_them():
    # A list or a numpy array, which persistent_layer takes, ended here in AttributeError ('list' object has no
    # attribute 'dtype'), and numpy's unsigned lengths would meet torch's missing comparisons for uint64.
    arguments = ("relu", torch.randn(5, 2, 4), torch.zeros(2, 4), torch.randn(4, 4), None)
    expected = reference_layer(*arguments, torch.tensor([5, 3]), False)
    for lengths in ([5, 3], np.array([5, 3]), np.array([5, 3], dtype=np.uint64)):
        for actual, wanted in zip(reference_layer(*arguments, lengths, False), expected, strict=True):
            assert torch.equal(actual, wanted), type(lengths)


@pytest.mark.parametrize("cell", ["tanh", "lstm"])
def test_no_time_steps_give_an_empty_output_and_the_initial_state(cell):
    # As persistent_layer's binding does for T = 0; torch.stack of no steps ended here in "stack expects a non-empty
    # TensorList".
    hidden_size, gates = 3, NUM_GATES[cell]
    h0 = torch.randn(2, hidden_size, dtype=torch.float64, requires_grad=True)
    hx = (h0, torch.randn(2, hidden_size, dtype=torch.float64)) if cell == "lstm" else h0
    input_proj = torch.randn(0, 2, gates * hidden_size, dtype=torch.float64)
    weight_hh = torch.randn(gates * hidden_size, hidden_size, dtype=torch.float64)
    output, h_n = reference_layer(cell, input_proj, hx, weight_hh, None, [0, 0], False)
    assert output.shape == (0, 2, hidden_size) and output.dtype == torch.float64
    for actual, wanted in zip(h_n if cell == "lstm" else (h_n,), hx if cell == "lstm" else (hx,), strict=True):
        assert torch.equal(actual, wanted)
    (h_n[0] if cell == "lstm" else h_n).sum().backward()
    assert torch.equal(h0.grad, torch.ones_like(h0))


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_an_initial_state_of_another_dtype_runs_as_under_autocast(cell):
    # persistent_layer takes an fp32 state for a bf16 layer; here it ended outside autocast in F.linear's "expected m1
    # and m2 to have the same dtype", which names neither hx nor the layer.
    torch.manual_seed(4)
    hidden_size, gates = 3, NUM_GATES[cell]
    input_proj = torch.randn(5, 2, gates * hidden_size).bfloat16()
    weight_hh, bias_hh = torch.randn(gates * hidden_size, hidden_size), torch.randn(gates * hidden_size)
    h0 = torch.randn(2, hidden_size)
    hx = (h0, torch.randn(2, hidden_size)) if cell == "lstm" else h0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference_layer(cell, input_proj, hx, weight_hh, bias_hh, [5, 3], False)
    actual = reference_layer(cell, input_proj, hx, weight_hh, bias_hh, [5, 3], False)
    for got, want in zip([actual[0], *actual[1]] if cell == "lstm" else actual,
                         [expected[0], *expected[1]] if cell == "lstm" else expected, strict=True):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_relative_error_refuses_tensors_of_different_shapes():
    # Broadcast, a final state of (B, H) matched torch.nn's (num_layers * num_directions, B, H), so a layer that
    # returned the wrong shape passed every comparison with the reference.
    h_n = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"relative_error: actual has shape \(3, 4\), expected \(1, 3, 4\)"):
        relative_error(h_n, h_n[None])
    assert relative_error(h_n, h_n) == 0.0
    assert relative_error(h_n + 1e-3 * h_n, h_n) == pytest.approx(1e-3)
