"""Drop-in torch.nn.RNN / GRU / LSTM that take sequence lengths and run on a chosen backend.

The classes subclass the torch modules, so constructor arguments, parameter names and weight layout are torch's
and state dicts load both ways. Backends:
  "cudnn"      torch.nn's own forward (cuDNN on a GPU, ATen's native recurrence on a CPU).
  "reference"  the stack composed from `reference_layer`, one call per layer and direction.
  "persistent" the same composition over `prnn_kernels.persistent.persistent_layer`; an unsupported shape raises.
  "auto"       persistent where the support query says it can run a CUDA input, otherwise cudnn, warning once per
               reason why a CUDA input did not get the persistent kernel.
"""
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from prnn_kernels.reference import reference_layer

BACKENDS = ("auto", "persistent", "cudnn", "reference")
_CELL_OF_MODE = {"RNN_RELU": "relu", "RNN_TANH": "tanh", "GRU": "gru", "LSTM": "lstm"}
# Reasons "auto" already warned about, so a training loop warns once rather than every step.
_warned_fallbacks = set()


class _BackendChoice:
    """Mixin placed before a torch.nn RNN class: adds the `backend` keyword and `lengths` to forward.

    forward(input, hx=None, lengths=None):
        input: (T, B, F), or (B, T, F) with batch_first.
        hx: (num_layers * num_directions, B, H), for LSTM a tuple (h0, c0); zeros if None.
        lengths: (B,) integer tensor of valid steps per sample, 1 <= lengths[b] <= T, on any device; None means
            every sample has T steps.
    Returns (output, h_n) as torch.nn does: output (T, B, num_directions * H) (batch-first if batch_first), zero at
    t >= lengths[b]; h_n the state after each sample's last valid step, for LSTM a tuple (h_n, c_n).
    """

    def __init__(self, *args, backend="auto", **kwargs):
        name = type(self).__name__
        if backend not in BACKENDS:
            raise ValueError(f"prnn_kernels.{name}: backend={backend!r} is not one of {BACKENDS}")
        super().__init__(*args, **kwargs)
        if self.proj_size:
            raise ValueError(f"prnn_kernels.{name}: proj_size={self.proj_size} is not supported; use proj_size=0")
        self.backend = backend
        self.cell = _CELL_OF_MODE[self.mode]

    def extra_repr(self):
        return f"{super().extra_repr()}, backend={self.backend!r}"

    def forward(self, input, hx=None, lengths=None):
        if input.dim() != 3:
            raise ValueError(f"prnn_kernels.{type(self).__name__}: input must be 3-D, got shape {tuple(input.shape)}")
        backend = self._resolve_backend(input)
        if backend == "cudnn":
            return self._torch_forward(input, hx, lengths)
        if backend == "reference":
            return self._stacked_forward(reference_layer, input, hx, lengths)
        from prnn_kernels.persistent import persistent_layer

        return self._stacked_forward(persistent_layer, input, hx, lengths)

    def _resolve_backend(self, input):
        """The backend this input runs on: "cudnn", "reference" or "persistent"."""
        if self.backend in ("cudnn", "reference"):
            return self.backend
        if self.backend == "auto" and input.device.type != "cuda":
            return "cudnn"
        from prnn_kernels.persistent import support

        batch_size = input.shape[0 if self.batch_first else 1]
        verdict = support(self.cell, self.hidden_size, batch_size, input.dtype, input.device)
        if verdict.ok:
            return "persistent"
        if self.backend == "persistent":
            raise ValueError(f"prnn_kernels.{type(self).__name__}: backend='persistent' cannot run: {verdict.reason}")
        if verdict.reason not in _warned_fallbacks:
            _warned_fallbacks.add(verdict.reason)
            warnings.warn(f"prnn_kernels: using cuDNN, not the persistent kernel: {verdict.reason}", stacklevel=2)
        return "cudnn"

    def _torch_forward(self, input, hx, lengths):
        if lengths is None:
            return super().forward(input, hx)
        num_steps = input.shape[1 if self.batch_first else 0]
        # pack_padded_sequence wants lengths on the CPU.
        packed = pack_padded_sequence(input, lengths.cpu(), batch_first=self.batch_first, enforce_sorted=False)
        output, h_n = super().forward(packed, hx)
        output, _ = pad_packed_sequence(output, batch_first=self.batch_first, total_length=num_steps)
        return output, h_n

    def _stacked_forward(self, layer_function, input, hx, lengths):
        """The stack as torch.nn composes it, from one `layer_function` call per layer and direction."""
        num_directions = 2 if self.bidirectional else 1
        if hx is None:
            batch_size = input.shape[0 if self.batch_first else 1]
            zeros = input.new_zeros(self.num_layers * num_directions, batch_size, self.hidden_size)
            hx = (zeros, zeros) if self.cell == "lstm" else zeros
        # torch.nn's own checks of input and state sizes, with its error messages.
        self.check_forward_args(input, hx, None)
        if self.batch_first:
            input = input.transpose(0, 1)
        num_steps, batch_size, _ = input.shape
        if lengths is None:
            lengths = torch.full((batch_size,), num_steps, dtype=torch.int64, device=input.device)
        else:
            lengths = lengths.to(input.device)
        layer_input = input  # (T, B, F) for the first layer, (T, B, num_directions * H) after
        final_states = []
        for layer in range(self.num_layers):
            if layer > 0 and self.training and self.dropout > 0:
                layer_input = F.dropout(layer_input, self.dropout, training=True)
            direction_outputs = []
            for direction in range(num_directions):
                index = layer * num_directions + direction
                weight_ih, weight_hh, *biases = self.all_weights[index]
                bias_ih, bias_hh = biases if self.bias else (None, None)
                state = (hx[0][index], hx[1][index]) if self.cell == "lstm" else hx[index]
                input_proj = F.linear(layer_input, weight_ih, bias_ih)  # (T, B, G*H)
                output, final_state = layer_function(
                    self.cell, input_proj, state, weight_hh, bias_hh, lengths, reverse=direction == 1
                )
                direction_outputs.append(output)
                final_states.append(final_state)
            layer_input = torch.cat(direction_outputs, dim=2) if self.bidirectional else direction_outputs[0]
        output = layer_input.transpose(0, 1) if self.batch_first else layer_input
        if self.cell == "lstm":
            h_n, c_n = zip(*final_states)
            return output, (torch.stack(h_n), torch.stack(c_n))
        return output, torch.stack(final_states)


class RNN(_BackendChoice, nn.RNN):
    __doc__ = "torch.nn.RNN (tanh or relu) with `backend` and `lengths`.\n\n" + _BackendChoice.__doc__


class GRU(_BackendChoice, nn.GRU):
    __doc__ = "torch.nn.GRU with `backend` and `lengths`.\n\n" + _BackendChoice.__doc__


class LSTM(_BackendChoice, nn.LSTM):
    __doc__ = "torch.nn.LSTM with `backend` and `lengths`.\n\n" + _BackendChoice.__doc__
