"""Batch norm over padded sequences whose statistics count only valid frames, optionally averaged across ranks."""
import torch
import torch.distributed as dist
from torch import nn


class AllReduceSum(torch.autograd.Function):
    """The sum over ranks, differentiable: every rank's loss depends on every rank's input, so a rank's gradient is
    the sum over ranks of the output gradients. (torch.distributed.nn's all_reduce does the same and is deprecated.)"""

    @staticmethod
    def forward(ctx, tensor):
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad = grad_total.clone()
        dist.all_reduce(grad)
        return grad


class MaskedBatchNorm(nn.Module):
    """Batch norm whose batch statistics use only the positions a mask marks valid, so padding never changes an output.

    Serves as DeepSpeech2's sequence-wise batch norm on (T, B, H) (channel_dim=2) and as the conv front end's
    batch norm on (B, C, F, T) (channel_dim=1). Training normalises with the batch mean and (biased) variance over
    valid positions and updates running statistics with the unbiased variance, as torch.nn.BatchNorm does; eval uses
    the running statistics. Padded positions of the output are zero.

    sync_stats: when True and torch.distributed is initialised, the per-channel sums, sums of squares and counts are
    all-reduced (differentiably) so every rank normalises with the statistics of the global batch. The trainer
    switches it on; it is off by default so a single process needs no process group.
    """

    def __init__(self, num_features: int, channel_dim: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.channel_dim = channel_dim
        self.eps = eps
        self.momentum = momentum
        self.sync_stats = False
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def extra_repr(self):
        return f"{self.weight.numel()}, channel_dim={self.channel_dim}, eps={self.eps}, momentum={self.momentum}"

    def forward(self, x, mask):
        """x: channels at `channel_dim`; mask: bool, broadcastable to x with size 1 at channel_dim, True = valid."""
        if self.training:
            mean, var = self._batch_statistics(x, mask)
        else:
            mean, var = self.running_mean, self.running_var
        per_channel = [1] * x.dim()  # reshapes a (C,) vector to broadcast along channel_dim
        per_channel[self.channel_dim] = -1
        scale = self.weight * torch.rsqrt(var + self.eps)
        shift = self.bias - mean * scale
        y = x * scale.to(x.dtype).view(per_channel) + shift.to(x.dtype).view(per_channel)
        return y.masked_fill(~mask, 0)

    def _batch_statistics(self, x, mask):
        """Per-channel (mean, biased variance) over valid positions, in at least float32; updates running statistics."""
        stats_dtype = torch.promote_types(x.dtype, torch.float32)
        reduce_dims = [d for d in range(x.dim()) if d != self.channel_dim % x.dim()]
        # torch.where rather than a multiply, so non-finite padding cannot leak into the sums.
        values = torch.where(mask, x.to(stats_dtype), 0)
        count = torch.broadcast_to(mask, x.shape).sum(reduce_dims, dtype=stats_dtype)  # (C,), equal entries
        sums = torch.cat([values.sum(reduce_dims), values.square().sum(reduce_dims), count])  # (3C,)
        if self.sync_stats and dist.is_available() and dist.is_initialized():
            sums = AllReduceSum.apply(sums)
        total, total_square, count = sums.chunk(3)
        mean = total / count
        var = (total_square / count - mean.square()).clamp_min(0)
        with torch.no_grad():
            unbiased_var = var * count / (count - 1).clamp_min(1)
            self.running_mean.lerp_(mean.to(self.running_mean.dtype), self.momentum)
            self.running_var.lerp_(unbiased_var.to(self.running_var.dtype), self.momentum)
        return mean, var
