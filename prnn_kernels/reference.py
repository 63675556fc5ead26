"""Pure-PyTorch recurrence of one layer in one direction: numerics oracle for the persistent kernel and the CPU path.

`reference_layer` and `prnn_kernels.persistent.persistent_layer` share one signature and compute the same function;
tests hold them together with `relative_error`.
"""
import torch
import torch.nn.functional as F

# Gates stacked along the rows of weight_ih / weight_hh, in torch.nn order: GRU (r, z, n), LSTM (i, f, g, o).
NUM_GATES = {"relu": 1, "tanh": 1, "gru": 3, "lstm": 4}


def _relu_step(input_gates, hidden_gates, state):
    return (torch.relu(input_gates + hidden_gates),)


def _tanh_step(input_gates, hidden_gates, state):
    return (torch.tanh(input_gates + hidden_gates),)


def _gru_step(input_gates, hidden_gates, state):
    (h,) = state
    input_r, input_z, input_n = input_gates.chunk(3, dim=1)
    hidden_r, hidden_z, hidden_n = hidden_gates.chunk(3, dim=1)
    reset = torch.sigmoid(input_r + hidden_r)
    update = torch.sigmoid(input_z + hidden_z)
    # As torch.nn.GRU: the reset gate scales W_hn h + b_hn, bias included.
    candidate = torch.tanh(input_n + reset * hidden_n)
    return ((1 - update) * candidate + update * h,)


def _lstm_step(input_gates, hidden_gates, state):
    _, c = state
    i, f, g, o = (input_gates + hidden_gates).chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return (torch.sigmoid(o) * torch.tanh(c), c)


# Each step maps (input gates (B, G*H), hidden gates (B, G*H), state) to the new state; a state is a tuple of
# (B, H) tensors, (h,) or (h, c), whose first element is the step's output.
_STEPS = {"relu": _relu_step, "tanh": _tanh_step, "gru": _gru_step, "lstm": _lstm_step}


def checked_lengths(name, lengths, batch_size, num_steps, shortest=1):
    """`lengths` (a tensor or a sequence) as an int64 tensor, refused with a message naming `name` unless it holds one
    integer per sample in [shortest, T]; the range is checked on CPU lengths only, as reading GPU ones would wait for
    the GPU (and break a graph's capture)."""
    # torch's own refusal of a None, a string or an integer past int64 ("Could not infer dtype of NoneType") names
    # neither the argument nor the layer.
    try:
        lengths = torch.as_tensor(lengths)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{name}: lengths must be integers, got {lengths!r} ({error})") from None
    # torch reads an empty sequence ([], numpy's np.array([])) as floats; holding no value to cast, it is an empty
    # batch's lengths.
    if lengths.numel() == 0:
        lengths = lengths.to(torch.int64)
    # A float would be cast: 2.5 would run two steps on one backend and three on another.
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise ValueError(f"{name}: lengths must be integers, got {lengths.dtype}")
    if tuple(lengths.shape) != (batch_size,):
        raise ValueError(f"{name}: lengths must have shape ({batch_size},), one per sample, got {tuple(lengths.shape)}")
    # int64 before comparing: torch has no comparisons for uint16/32/64 (numpy's unsigned lengths); a uint64 above
    # int64's range turns negative and is refused below, showing the value given.
    signed = lengths.to(torch.int64)
    if lengths.device.type == "cpu" and bool(((signed < shortest) | (signed > num_steps)).any()):
        raise ValueError(f"{name}: lengths must lie in [{shortest}, T={num_steps}], got {lengths.tolist()}")
    return signed


def checked_layer(name, cell, input_proj, hx, weight_hh, bias_hh):
    """(H, each direction's initial state as a tuple: (h,), an LSTM's (h, c)) for a layer of D directions, where hx,
    weight_hh and bias_hh are lists of D, one per direction; refused with a ValueError naming `name` unless
    input_proj is (T, B, D x G x H), and each direction's hx (B, H) (an LSTM's a pair of them), weight_hh (G x H, H)
    and bias_hh (G x H,) or None, all on input_proj's device. Checked here, not left to broadcasting, which ran a (1, H)
    state or a (1,) bias for every sample, nor to the kernels' binding, which the support query reaches only after
    building the extension."""
    if cell not in NUM_GATES:
        raise ValueError(f"{name}: cell {cell!r} is not one of {tuple(NUM_GATES)}")
    if input_proj.dim() != 3:
        raise ValueError(f"{name}: input_proj must be (T, B, G*H), got shape {tuple(input_proj.shape)}")
    _, batch_size, width = input_proj.shape
    num_directions = len(weight_hh)
    hidden_size = width // (num_directions * NUM_GATES[cell])
    gate_rows = NUM_GATES[cell] * hidden_size
    if hidden_size < 1 or width != num_directions * gate_rows:
        raise ValueError(f"{name}: input_proj's last dimension {width} is not {num_directions} x {NUM_GATES[cell]} "
                         "gates x H")
    if cell == "lstm" and not all(isinstance(h, tuple | list) and len(h) == 2 for h in hx):
        raise ValueError(f"{name}: an LSTM's hx must be a tuple (h0, c0)")
    states = [tuple(h) if cell == "lstm" else (h,) for h in hx]
    if not all(isinstance(h, torch.Tensor) for state in states for h in state):
        raise ValueError(f"{name}: hx must be a tensor (B, H) (an LSTM's a tuple of two); give zeros for none")
    expected = {"weight_hh": (gate_rows, hidden_size), "bias_hh": (gate_rows,), "hx": (batch_size, hidden_size)}
    given = [("weight_hh", w) for w in weight_hh] + [("bias_hh", b) for b in bias_hh if b is not None]
    given += [("hx", h) for state in states for h in state]
    for argument, tensor in given:
        if tuple(tensor.shape) != expected[argument]:
            raise ValueError(f"{name}: {argument} must have shape {expected[argument]}, got {tuple(tensor.shape)}")
        if tensor.device != input_proj.device:
            raise ValueError(f"{name}: {argument} is on {tensor.device}, input_proj on {input_proj.device}")
    return hidden_size, states


def reference_layer(cell, input_proj, hx, weight_hh, bias_hh, lengths, reverse):
    """Runs one recurrent layer in one direction over padded sequences, one timestep at a time.

    Args:
        cell: "relu" | "tanh" | "gru" | "lstm".
        input_proj: (T, B, G*H) input projection x @ weight_ih^T + bias_ih for every timestep, G = NUM_GATES[cell].
        hx: (B, H) initial state; for "lstm" a tuple (h0, c0) of (B, H).
        weight_hh: (G*H, H) recurrent weights.
        bias_hh: (G*H,) recurrent bias, or None.
        lengths: (B,) integers (a tensor or a sequence), the valid steps per sample in [0, T], on any device (on the
            CPU checked: ValueError).
        reverse: run t = T-1 .. 0; a sample's pass then starts from hx at its own last valid step.

    Returns:
        output: (T, B, H), zero at t >= lengths[b].
        h_n: (B, H) state after each sample's last valid step (hx where lengths[b] == 0); for "lstm" (h_n, c_n).

    Raises ValueError, naming the argument, for a cell or a shape other than these.

    Computed in input_proj's dtype (the state in hx's where that is wider: an fp32 hx of a bf16 layer) and returned in
    input_proj's dtype, with autograd through the loop.
    """
    hidden_size, (state,) = checked_layer("reference_layer", cell, input_proj, [hx], [weight_hh], [bias_hh])
    step = _STEPS[cell]
    num_steps, batch_size = input_proj.shape[:2]
    lengths = checked_lengths("reference_layer", lengths, batch_size, num_steps, shortest=0).to(input_proj.device)
    # (T, B, 1): whether sample b still has input at step t.
    valid = torch.arange(num_steps, device=input_proj.device)[:, None] < lengths[None, :]
    valid = valid.unsqueeze(2).unbind(0)
    # unbind, not input_proj[t]: its backward stacks the step gradients once, where indexing would write each
    # into a fresh zero tensor of the full input's size (quadratic in T).
    step_inputs = input_proj.unbind(0)
    outputs = [None] * num_steps
    for t in reversed(range(num_steps)) if reverse else range(num_steps):
        # A cast per step: under autocast F.linear would reuse one bf16 copy of the parameters for every step, and
        # autograd would sum the steps' gradients of that copy in bf16 (1.7 % off float64 at T = 256). This way each
        # step's gradient reaches the parameters in their own dtype and is summed there. The state is cast as autocast
        # casts it, so that one of another dtype (an fp32 hx of a bf16 layer) runs the same outside autocast.
        hidden_gates = F.linear(state[0].to(input_proj.dtype), weight_hh.to(input_proj.dtype),
                                None if bias_hh is None else bias_hh.to(input_proj.dtype))
        new_state = step(step_inputs[t], hidden_gates, state)
        # torch.where, not a multiply by the mask, so nothing computed from padding reaches the state.
        state = tuple(torch.where(valid[t], new, old) for new, old in zip(new_state, state))
        outputs[t] = torch.where(valid[t], new_state[0], 0.0)
    # As the persistent kernel returns them: the wider state would otherwise reach h_n, and an LSTM's output. No steps
    # (T = 0), which its binding runs, are an empty output: torch.stack refuses an empty list.
    output = torch.stack(outputs).to(input_proj.dtype) if outputs else input_proj.new_zeros(0, batch_size, hidden_size)
    state = tuple(part.to(input_proj.dtype) for part in state)
    return output, (state if cell == "lstm" else state[0])


def relative_error(actual, expected):
    """||actual - expected|| / ||expected|| over all elements, as a float: the measure that holds fast paths to the
    reference. Tensors of different shapes are refused (ValueError): broadcast, an h_n of (B, H) matched torch.nn's
    (1, B, H), so a test held a result of the wrong shape to the reference and passed."""
    if actual.shape != expected.shape:
        raise ValueError(f"relative_error: actual has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    return (torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected)).item()
