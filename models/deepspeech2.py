"""DeepSpeech2 (Amodei et al., 2016): 2-D conv front end, deep recurrent stack, lookahead conv, per-frame classifier.

Shapes: B utterances, T input frames of F features, T' = output frames after the front end's stride in time,
H = hidden size, V = num_classes. Padding is masked everywhere: a padded frame never changes any output, so a
sample's log-probs over its valid frames are the same in any batch (in eval mode, where batch norm uses running
statistics), up to rounding: the persistent kernels' tiling, and with it their rounding, depends on the batch size.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

import prnn_kernels
from models.batch_norm import MaskedBatchNorm

CELLS = tuple(prnn_kernels.NUM_GATES)  # relu, tanh, gru, lstm
BACKENDS = prnn_kernels.BACKENDS
# The clipped ReLU of DeepSpeech2: min(max(x, 0), 20).
CLIP = 20.0


def sequence_mask(lengths, num_steps):
    """(B, num_steps) bool: True at t < lengths[b]."""
    return torch.arange(num_steps, device=lengths.device)[None, :] < lengths[:, None]


def conv_output_lengths(conv, lengths, dim: int = -1):
    """Valid output positions of `conv` along its kernel's dimension `dim` (time, the last, by default) for `lengths`
    valid input positions."""
    return (lengths + 2 * conv.padding[dim] - conv.kernel_size[dim]) // conv.stride[dim] + 1


class ConvFrontEnd(nn.Module):
    """Two Conv2d layers over (B, 1, F, T), each followed by batch norm and the clipped ReLU.

    The kernels, strides and paddings are DeepSpeech2's, given as (frequency, time).
    """

    # (kernel, stride, padding) per layer.
    LAYERS = (((41, 11), (2, 2), (20, 5)), ((21, 11), (2, 1), (10, 5)))

    def __init__(self, num_features: int, channels: int, batch_norm: bool):
        super().__init__()
        self.convs = nn.ModuleList()
        in_channels, frequencies = 1, num_features
        for kernel, stride, padding in self.LAYERS:
            # Batch norm's shift makes a conv bias redundant.
            self.convs.append(nn.Conv2d(in_channels, channels, kernel, stride, padding, bias=not batch_norm))
            in_channels = channels
            frequencies = conv_output_lengths(self.convs[-1], frequencies, dim=0)
        self.norms = nn.ModuleList(MaskedBatchNorm(channels, channel_dim=1) for _ in self.convs) if batch_norm else None
        self.output_size = channels * frequencies
        self.time_stride = math.prod(conv.stride[1] for conv in self.convs)

    def output_lengths(self, lengths):
        """(B,) valid output frames for (B,) valid input frames: conv arithmetic along time."""
        for conv in self.convs:
            lengths = conv_output_lengths(conv, lengths)
        return lengths

    def forward(self, features, lengths):
        """features: (B, T, F); lengths: (B,) on features' device. Returns (T', B, output_size), zero past lengths."""
        x = features.transpose(1, 2).unsqueeze(1)  # (B, 1, F, T)
        x = x.masked_fill(~sequence_mask(lengths, x.shape[3])[:, None, None, :], 0)
        for index, conv in enumerate(self.convs):
            if index > 0 and x.is_cuda:
                # cuDNN's bf16 NCHW data gradient of this layer takes ~20 ms at batch 4 on an H100, 70x its time in
                # channels-last, which is as fast or faster at every batch (measured; not so for the 1-channel first
                # layer).
                x = x.contiguous(memory_format=torch.channels_last)
            x = conv(x)  # (B, C, F_i, T_i)
            lengths = conv_output_lengths(conv, lengths)
            mask = sequence_mask(lengths, x.shape[3])[:, None, None, :]  # (B, 1, 1, T_i)
            if self.norms is not None:
                x = self.norms[index](x, mask)
            # Zeroing padded frames keeps them from reaching valid frames through the next kernel.
            x = F.hardtanh(x, 0.0, CLIP).masked_fill(~mask, 0)
        batch_size, channels, frequencies, num_steps = x.shape
        return x.permute(3, 0, 1, 2).reshape(num_steps, batch_size, channels * frequencies)


class RecurrentLayer(nn.Module):
    """One layer of the stack: sequence-wise batch norm of its input (optional), then a one-layer prnn_kernels RNN.

    A bidirectional layer sums its two directions, so the width stays H whatever the direction count.
    """

    def __init__(self, cell: str, input_size: int, hidden: int, bidirectional: bool, backend: str, batch_norm: bool,
                 batch_slice: int | None = None):
        super().__init__()
        self.norm = MaskedBatchNorm(input_size, channel_dim=2) if batch_norm else None
        choice = dict(bidirectional=bidirectional, backend=backend, batch_slice=batch_slice)
        if cell in ("relu", "tanh"):
            self.rnn = prnn_kernels.RNN(input_size, hidden, nonlinearity=cell, **choice)
        else:
            rnn_class = {"gru": prnn_kernels.GRU, "lstm": prnn_kernels.LSTM}[cell]
            self.rnn = rnn_class(input_size, hidden, **choice)

    def forward(self, x, lengths, mask):
        """x: (T', B, input_size), lengths: (B,), mask: (T', B, 1) bool. Returns (T', B, H), zero past lengths."""
        if self.norm is not None:
            x = self.norm(x, mask)
        output, _ = self.rnn(x, lengths=lengths)  # (T', B, num_directions * H)
        if self.rnn.bidirectional:
            forward_output, backward_output = output.chunk(2, dim=2)
            output = forward_output + backward_output
        return output


class Lookahead(nn.Module):
    """DeepSpeech2's lookahead (row) convolution: gives a unidirectional stack a little future context.

    Each channel mixes the current frame and the next `lookahead` frames with its own weights (a depthwise Conv1d).
    """

    def __init__(self, channels: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv = nn.Conv1d(channels, channels, kernel_size=lookahead + 1, groups=channels, bias=False)

    def forward(self, x):
        """x: (T', B, H), zero past each length. Returns (T', B, H), still zero past each length (no bias)."""
        x = x.permute(1, 2, 0)  # (B, H, T')
        # Frames past the end read as zeros, exactly as a sample's padded frames do, so batching changes nothing.
        x = F.pad(x, (0, self.lookahead))
        return self.conv(x).permute(2, 0, 1)


def _check_arguments(cell: str, sizes: dict[str, object], flags: dict[str, object]) -> None:
    """ValueError naming the argument where `cell` is not one of CELLS, a size is not an integer of at least 1 (0 for
    lookahead) or a flag is not True or False. Checked here, by the names a caller gave: torch.nn names a zero
    conv_channels or num_features input_size, and takes a float size or a string flag ("no" is true) deep inside a
    layer, or not at all."""
    if cell not in CELLS:
        raise ValueError(f"DeepSpeech2: cell={cell!r} is not one of {CELLS}")
    for name, value in sizes.items():
        least = 0 if name == "lookahead" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"DeepSpeech2: {name}={value!r} must be an integer of at least {least}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"DeepSpeech2: {name}={value!r} must be True or False")


class DeepSpeech2(nn.Module):
    """Conv front end -> `depth` recurrent layers -> lookahead conv (unidirectional only) -> Linear to classes.

    Args:
        num_features: F, features per input frame.
        num_classes: V, output classes (CTC blank included).
        depth: recurrent layers.
        hidden: H, hidden size of every recurrent layer.
        cell: "relu" | "tanh" (torch.nn.RNN nonlinearities) | "gru" | "lstm".
        bidirectional: run each layer both ways and sum the directions; otherwise add the lookahead conv.
        lookahead: future frames the lookahead conv sees (unidirectional only).
        residual: add each layer's input to its output, for every layer after the first (deep stacks need it).
        backend: prnn_kernels backend of the recurrent layers: "auto" | "persistent" | "cudnn" | "reference".
        batch_slice: run each recurrent layer on slices of at most this many utterances (None: the whole batch at
            once), as a GPU with that per-GPU batch would; batch norm and everything else still see the whole batch.
        conv_channels: channels of both conv layers.
        batch_norm: batch norm in the front end and on the input of every recurrent layer after the first.

    `sync_batch_norm(True)` makes the batch norms average their statistics over the job's ranks.
    """

    def __init__(
        self,
        num_features: int,
        num_classes: int,
        depth: int = 5,
        hidden: int = 800,
        cell: str = "gru",
        bidirectional: bool = True,
        lookahead: int = 20,
        residual: bool = False,
        backend: str = "auto",
        conv_channels: int = 32,
        batch_norm: bool = True,
        batch_slice: int | None = None,
    ):
        super().__init__()
        _check_arguments(cell, sizes=dict(num_features=num_features, num_classes=num_classes, depth=depth,
                                          hidden=hidden, conv_channels=conv_channels, lookahead=lookahead),
                         flags=dict(bidirectional=bidirectional, residual=residual, batch_norm=batch_norm))
        self.residual = residual
        self.num_features = num_features
        self.front_end = ConvFrontEnd(num_features, conv_channels, batch_norm)
        self.time_stride = self.front_end.time_stride
        # The first layer's input comes out of the front end's batch norm already.
        self.layers = nn.ModuleList(
            RecurrentLayer(
                cell,
                self.front_end.output_size if index == 0 else hidden,
                hidden,
                bidirectional,
                backend,
                batch_norm=batch_norm and index > 0,
                batch_slice=batch_slice,
            )
            for index in range(depth)
        )
        self.lookahead = None if bidirectional else Lookahead(hidden, lookahead)
        self.classifier = nn.Linear(hidden, num_classes)

    def sync_batch_norm(self, enabled: bool) -> None:
        """Whether the batch norms average their statistics over the ranks of torch.distributed (a multi-GPU job)."""
        for module in self.modules():
            if isinstance(module, MaskedBatchNorm):
                module.sync_stats = enabled

    def recurrent_backend(self, batch_size: int, dtype: torch.dtype, device) -> str:
        """The backend the recurrent layers run a batch of this size and dtype on, on `device`: "persistent", "cudnn"
        (torch.nn: cuDNN on a GPU) or "reference". The layers share cell, size and backend, so one answers for all.
        Raises ValueError, naming why, where backend="persistent" cannot run it."""
        return self.layers[0].rnn.backend_for(batch_size, dtype, device)

    def output_lengths(self, lengths):
        """(B,) output frames T'_b for (B,) input frames, on lengths' device."""
        return self.front_end.output_lengths(lengths)

    def forward(self, features, lengths):
        """
        Args:
            features: (B, T, F), padded past each utterance's length.
            lengths: (B,) int64 valid frames per utterance, on either device. Layers on cuDNN pack their sequences
                by lengths on the host, copying GPU lengths there (a host sync a layer); the persistent and reference
                backends use them on the model's device, and CUDA graphs need them there.
        Returns:
            log_probs: (T', B, V) log-softmax over classes, in float32 (float64 for a float64 model), as CTC wants.
            out_lengths: (B,) valid output frames, on lengths' device.
        """
        if features.dim() != 3 or features.shape[2] != self.num_features:
            # Checked here: the front end's stride maps neighbouring widths to one (13, 14 and 15 features alike), so
            # a wrong width could run unnoticed, and the others failed naming the first recurrent layer's input size.
            raise ValueError(f"DeepSpeech2: features must have shape (B, T, num_features={self.num_features}), "
                             f"got {tuple(features.shape)}")
        lengths = prnn_kernels.checked_lengths("DeepSpeech2", lengths, features.shape[0], features.shape[1])
        out_lengths = self.output_lengths(lengths)
        x = self.front_end(features, lengths.to(features.device))  # (T', B, C * F')
        mask = sequence_mask(out_lengths.to(x.device), x.shape[0]).t().unsqueeze(2)  # (T', B, 1)
        for index, layer in enumerate(self.layers):
            output = layer(x, out_lengths, mask)  # (T', B, H)
            x = x + output if self.residual and index > 0 else output
        if self.lookahead is not None:
            x = F.hardtanh(self.lookahead(x), 0.0, CLIP)
        logits = self.classifier(x)  # (T', B, V)
        return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=2), out_lengths
