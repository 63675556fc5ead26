"""Drop-in torch.nn.RNN / GRU / LSTM that take sequence lengths and run on a chosen backend.

The classes subclass the torch modules, so constructor arguments, parameter names and weight layout are torch's
and state dicts load both ways; an LSTM's proj_size, which the reference and persistent recurrences lack, is
refused. Backends:
  "cudnn"      torch.nn's own forward (cuDNN on a GPU, ATen's native recurrence on a CPU).
  "reference"  the stack composed from `reference_layer`, one call per layer and direction.
  "persistent" the same composition on the persistent kernels (`prnn_kernels.persistent`), both directions of a
               bidirectional layer in one call; an unsupported shape raises.
  "auto"       persistent where the support query says it can run a CUDA input, otherwise cudnn, warning once per
               layer shape (cell, hidden size, dtype) why a CUDA input did not get the persistent kernel.

`batch_slice=N` runs a larger batch as slices of at most N sequences, one after another, each through every layer
on the backend chosen for slices of N and the shorter last one: each slice computes what a GPU with a per-GPU batch of
N would, so one GPU can train with the recurrent arithmetic of many at a small per-GPU batch, and the persistent
kernels can run a batch above the largest they take at once (`prnn_kernels.persistent.MAX_BATCH`).
"""
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from prnn_kernels.reference import checked_lengths, reference_layer

BACKENDS = ("auto", "persistent", "cudnn", "reference")
_CELL_OF_MODE = {"RNN_RELU": "relu", "RNN_TANH": "tanh", "GRU": "gru", "LSTM": "lstm"}
# Layer shapes (cell, hidden size, dtype) "auto" already warned about, so a training loop warns once, not every step.
_warned_fallbacks = set()


class _BackendChoice:
    """Mixin placed before a torch.nn RNN class: adds the `backend` keyword and `lengths` to forward.

    forward(input, hx=None, lengths=None):
        input: (T, B, F), or (B, T, F) with batch_first.
        hx: (num_layers * num_directions, B, H) in input's dtype (any under autocast), for LSTM a tuple (h0, c0);
            zeros if None.
        lengths: (B,) integers, the valid steps per sample, 1 <= lengths[b] <= T: a tensor on any device or a
            sequence (prnn_kernels.checked_lengths); None means every sample has T steps.
    Returns (output, h_n) as torch.nn does: output (T, B, num_directions * H) (batch-first if batch_first), zero at
    t >= lengths[b]; h_n the state after each sample's last valid step, for LSTM a tuple (h_n, c_n).
    With batch_slice=N, a batch of more than N runs as consecutive slices of at most N (see the module docstring).
    """

    def __init__(self, *args, backend="auto", batch_slice=None, **kwargs):
        self.backend = backend  # checked before torch.nn allocates the weights
        super().__init__(*args, **kwargs)
        # As torch.nn checks bias and batch_first: the reference would run 2 as two directions, torch's own forward
        # refuses any but a bool deep inside ("gru() received an invalid combination of arguments").
        if not isinstance(self.bidirectional, bool):
            raise TypeError(f"prnn_kernels.{type(self).__name__}: bidirectional should be of type bool, got: "
                            f"{type(self.bidirectional).__name__}")
        if self.proj_size:
            raise ValueError(f"prnn_kernels.{type(self).__name__}: proj_size={self.proj_size} is not supported; use "
                             "proj_size=0")
        self.batch_slice = batch_slice
        self.cell = _CELL_OF_MODE[self.mode]

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value):  # checked here, so that setting it on a built model is checked too
        if value not in BACKENDS:
            raise ValueError(f"prnn_kernels.{type(self).__name__}: backend={value!r} is not one of {BACKENDS}")
        self._backend = value

    @property
    def batch_slice(self) -> int | None:
        return self._batch_slice

    @batch_slice.setter
    def batch_slice(self, value):  # checked here, so that setting it on a built model is checked too
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"prnn_kernels.{type(self).__name__}: batch_slice={value!r} must be a positive integer "
                             "or None")
        self._batch_slice = value

    def extra_repr(self):
        return f"{super().extra_repr()}, backend={self.backend!r}, batch_slice={self.batch_slice}"

    def forward(self, input, hx=None, lengths=None):
        name = f"prnn_kernels.{type(self).__name__}"
        if isinstance(input, PackedSequence):
            raise ValueError(f"{name}: a PackedSequence is not taken; pass the padded tensor and lengths=")
        if input.dim() != 3:
            raise ValueError(f"{name}: input must be 3-D, got shape {tuple(input.shape)}")
        batch_dim = 0 if self.batch_first else 1
        batch_size = input.shape[batch_dim]
        if self.cell == "lstm" and hx is not None and not (isinstance(hx, tuple) and len(hx) == 2):
            got = f"a tuple of {len(hx)}" if isinstance(hx, tuple) else type(hx).__name__
            raise ValueError(f"{name}: hx must be a tuple (h0, c0), got {got}")
        initial_states = () if hx is None else hx if self.cell == "lstm" else (hx,)
        not_tensors = [state for state in initial_states if not isinstance(state, torch.Tensor)]
        if not_tensors:  # torch.nn's size check fails on it with "'tuple' object has no attribute 'size'"
            shape = (self.num_layers * (2 if self.bidirectional else 1), batch_size, self.hidden_size)
            expected = "a tuple of two tensors" if self.cell == "lstm" else "a tensor"
            raise ValueError(f"{name}: hx must be {expected} {shape}, got {type(not_tensors[0]).__name__}")
        if input.shape[1 - batch_dim] == 0:
            raise ValueError(f"{name}: input has no time steps, shape {tuple(input.shape)}")
        # torch.nn's own checks of the input's and the state's sizes, with its messages, made once for every backend
        # and against the whole batch: batch_slice hands each slice its part.
        if hx is None:
            self.check_input(input, None)
        else:
            self.check_forward_args(input, hx, None)
            # As torch.nn's cuDNN path does ("Input and hidden tensors are not the same dtype"), for every backend:
            # ATen's CPU recurrence failed inside (get_mkldnn_dtype), the reference ran an LSTM's c0 of another dtype
            # at T = 1, and the persistent kernel casts. Autocast casts the state with the input.
            if not _autocast_enabled(input.device.type):
                for index, state in enumerate(initial_states):
                    if state.dtype != input.dtype:
                        argument = f"hx[{index}]" if self.cell == "lstm" else "hx"
                        raise ValueError(f"{name}: {argument} must have the input's dtype {input.dtype}, got "
                                         f"{state.dtype}")
        if lengths is not None:
            lengths = checked_lengths(name, lengths, batch_size, input.shape[1 - batch_dim])
        backend = self.backend_for(batch_size, _compute_dtype(input), input.device)
        if self.batch_slice is None or batch_size <= self.batch_slice:
            return self._forward_on(backend, input, hx, lengths)
        outputs, states = [], []
        for start in range(0, batch_size, self.batch_slice):
            size = min(self.batch_slice, batch_size - start)
            slice_lengths = None if lengths is None else lengths[start:start + size]
            output, state = self._forward_on(backend, input.narrow(batch_dim, start, size),
                                             _state_slice(hx, start, size), slice_lengths)
            outputs.append(output)
            states.append(state)
        if self.cell == "lstm":
            h_n, c_n = zip(*states)
            return torch.cat(outputs, batch_dim), (torch.cat(h_n, 1), torch.cat(c_n, 1))
        return torch.cat(outputs, batch_dim), torch.cat(states, 1)

    def _forward_on(self, backend, input, hx, lengths):
        if backend == "cudnn":
            return self._torch_forward(input, hx, lengths)
        return self._stacked_forward(backend, input, hx, lengths)

    def backend_for(self, batch_size: int, dtype: torch.dtype, device) -> str:
        """The backend an input of this batch size, dtype and device runs on: "cudnn", "reference" or "persistent";
        with batch_slice, the backend each slice runs on, the last one too. Raises ValueError where
        backend="persistent" cannot run it."""
        if self.backend in ("cudnn", "reference"):
            return self.backend
        if batch_size == 0 or self.backend == "auto" and torch.device(device).type != "cuda":
            return "cudnn"  # an empty batch has nothing to run, nor a fallback worth the layer's one warning
        from prnn_kernels.persistent import support

        verdicts = [support(self.cell, self.hidden_size, size, dtype, device) for size in self._slice_sizes(batch_size)]
        verdict = next((verdict for verdict in verdicts if not verdict.ok), None)
        if verdict is None:
            return "persistent"
        if self.backend == "persistent":
            raise ValueError(f"prnn_kernels.{type(self).__name__}: backend='persistent' cannot run: {verdict.reason}")
        layer = (self.cell, self.hidden_size, dtype)
        if layer not in _warned_fallbacks:  # once per layer shape, not once per batch size the loader makes
            _warned_fallbacks.add(layer)
            warnings.warn(f"prnn_kernels: {self.cell} H={self.hidden_size} {dtype} runs on cuDNN, not the persistent "
                          f"kernel: {verdict.reason}", stacklevel=2)
        return "cudnn"

    def _slice_sizes(self, batch_size: int) -> list[int]:
        """The batch sizes a batch runs at, each of which the support query is asked: with batch_slice, its slices
        and a shorter last one (7 as 4 and 3). The kernels' plans are no simpler for fewer utterances: bf16 runs 1-16
        and 17-32 on different variants, fp32 runs 1-2 on the chained engine where the plain one runs 3."""
        if self.batch_slice is None or batch_size <= self.batch_slice:
            return [batch_size]
        last = batch_size % self.batch_slice
        return [self.batch_slice, last] if last else [self.batch_slice]

    def _torch_forward(self, input, hx, lengths):
        if lengths is None or lengths.numel() == 0:  # torch cannot pack an empty batch, and it has no padding
            return super().forward(input, hx)
        num_steps = input.shape[1 if self.batch_first else 0]
        # pack_padded_sequence wants lengths on the CPU.
        packed = pack_padded_sequence(input, lengths.cpu(), batch_first=self.batch_first, enforce_sorted=False)
        output, h_n = super().forward(packed, hx)
        output, _ = pad_packed_sequence(output, batch_first=self.batch_first, total_length=num_steps)
        return output, h_n

    def _stacked_forward(self, backend, input, hx, lengths):
        """The stack as torch.nn composes it, layer by layer on the "reference" or "persistent" backend."""
        num_directions = 2 if self.bidirectional else 1
        if self.batch_first:
            input = input.transpose(0, 1)
        num_steps, batch_size, _ = input.shape
        if hx is None:
            zeros = input.new_zeros(self.num_layers * num_directions, batch_size, self.hidden_size)
            hx = (zeros, zeros) if self.cell == "lstm" else zeros
        if lengths is None:
            lengths = torch.full((batch_size,), num_steps, dtype=torch.int64, device=input.device)
        else:
            lengths = lengths.to(input.device)
            # Padding zeroed, as torch.nn's packed sequences never read it: the input projection's weight gradient
            # sums over every row, and an infinite or NaN padding row would make it NaN (0 x inf).
            padding = torch.arange(num_steps, device=input.device)[:, None] >= lengths[None, :]  # (T, B)
            input = input.masked_fill(padding[:, :, None], 0)
        layer_input = input  # (T, B, F) for the first layer, (T, B, num_directions * H) after
        final_states = []
        all_weights = self.all_weights  # a property that rebuilds its lists on every access
        for layer in range(self.num_layers):
            if layer > 0 and self.training and self.dropout > 0:
                layer_input = F.dropout(layer_input, self.dropout, training=True)
            indices = range(layer * num_directions, (layer + 1) * num_directions)
            weights = [all_weights[index] for index in indices]  # per direction: w_ih, w_hh[, b_ih, b_hh]
            states = [(hx[0][index], hx[1][index]) if self.cell == "lstm" else hx[index] for index in indices]
            layer_input, finals = self._layer(backend, layer_input, weights, states, lengths)
            final_states.extend(finals)
        output = layer_input.transpose(0, 1) if self.batch_first else layer_input
        if self.cell == "lstm":
            h_n, c_n = zip(*final_states)
            return output, (torch.stack(h_n), torch.stack(c_n))
        return output, torch.stack(final_states)

    def _layer(self, backend, layer_input, weights, states, lengths):
        """Every direction of one layer: (output (T, B, num_directions * H), final state of each direction)."""
        weight_ih = [w[0] for w in weights]
        weight_hh = [w[1] for w in weights]
        bias_ih = [w[2] for w in weights] if self.bias else [None] * len(weights)
        bias_hh = [w[3] for w in weights] if self.bias else [None] * len(weights)
        if backend == "persistent":
            from prnn_kernels.persistent import persistent_bidirectional_layer, persistent_layer as layer_function
            from prnn_kernels.products import input_projection

            if self.bidirectional:
                # One GEMM for both directions' input projections, one launch for both recurrences.
                input_proj = input_projection(layer_input, torch.cat(weight_ih),
                                              torch.cat(bias_ih) if self.bias else None)
                return persistent_bidirectional_layer(self.cell, input_proj, states, weight_hh, bias_hh, lengths)
        else:
            input_projection, layer_function = F.linear, reference_layer
        outputs, finals = [], []
        for direction in range(len(weights)):
            input_proj = input_projection(layer_input, weight_ih[direction], bias_ih[direction])  # (T, B, G*H)
            output, final_state = layer_function(
                self.cell, input_proj, states[direction], weight_hh[direction], bias_hh[direction], lengths,
                reverse=direction == 1,
            )
            outputs.append(output)
            finals.append(final_state)
        return torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0], finals


def _compute_dtype(input):
    """The dtype the recurrence runs in: under autocast the input projection comes out in autocast's dtype, whatever
    the input's, but for float64, which autocast leaves as it is."""
    device_type = input.device.type
    if input.is_floating_point() and input.dtype != torch.float64 and _autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return input.dtype


def _autocast_enabled(device_type):
    """Whether autocast is on for a device type; off on the meta device (a model built there to size it), where
    torch.is_autocast_enabled raises "unknown device type for autocast". Not torch.amp.is_autocast_available, which
    torch.compile (torch 2.11) cannot trace: it warned so from every compiled model with these layers."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def _state_slice(hx, start, size):
    """Samples start .. start + size - 1 of an initial state (its dimension 1), for LSTM of both tensors; None stays.
    Contiguous: cuDNN refuses a state that is not ("rnn: hx is not contiguous"), as a slice of a stack's is."""
    if hx is None:
        return None
    if isinstance(hx, tuple):
        return tuple(h[:, start:start + size].contiguous() for h in hx)
    return hx[:, start:start + size].contiguous()


class RNN(_BackendChoice, nn.RNN):
    __doc__ = "torch.nn.RNN (tanh or relu) with `backend` and `lengths`.\n\n" + _BackendChoice.__doc__


class GRU(_BackendChoice, nn.GRU):
    __doc__ = "torch.nn.GRU with `backend` and `lengths`.\n\n" + _BackendChoice.__doc__


class LSTM(_BackendChoice, nn.LSTM):
    __doc__ = "torch.nn.LSTM with `backend` and `lengths`.\n\n" + _BackendChoice.__doc__
