"""Batch norm over padded sequences whose statistics count only valid frames, optionally averaged across ranks."""
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable


def _per_channel_shape(num_dims: int, channel_dim: int) -> list[int]:
    """The view shape that broadcasts a (C,) vector along channel_dim of a tensor of num_dims dimensions."""
    shape = [1] * num_dims
    shape[channel_dim] = -1
    return shape


class _BatchStatisticsNorm(torch.autograd.Function):
    """Training mode's normalisation by the statistics of the valid positions, with its gradient written out (as
    torch.nn.SyncBatchNorm does). Autograd composing the same arithmetic ran 75 kernel-launching operators for a
    forward and backward in bf16, this runs 42, and the eager training step at a small batch is bound by the host's
    launches.

    forward(x, mask, weight, bias, shift, eps, channel_dim, sync) -> (y in x's dtype, and per channel the mean, the
    biased variance and the count of valid positions); statistics and normalisation in at least float32, the sums
    taken of x - shift (the running mean: near the batch's, so that the variance, the mean square less the squared
    mean, keeps its digits where a channel's mean is far from zero). With sync, the sums behind the statistics and, in
    the backward, the sums behind the input's gradient are all-reduced, so every rank computes the global batch's
    function. Padded positions of y and of the input's gradient are zero, and their values never reach a sum.
    """

    @staticmethod
    def forward(ctx, x, mask, weight, bias, shift, eps, channel_dim, sync):
        stats_dtype = torch.promote_types(x.dtype, torch.float32)
        reduce_dims = [d for d in range(x.dim()) if d != channel_dim]
        per_channel = _per_channel_shape(x.dim(), channel_dim)
        padding = ~mask
        # masked_fill rather than a multiply, so non-finite padding cannot leak into the sums.
        # One kernel for the cast and the shift: a bf16 x less the fp32 running mean comes out in stats_dtype.
        values = (x - shift.to(stats_dtype).view(per_channel)).masked_fill(padding, 0)
        count = torch.broadcast_to(mask, x.shape).sum(reduce_dims, dtype=stats_dtype)  # (C,), equal entries
        sums = torch.cat([values.sum(reduce_dims), values.square().sum(reduce_dims), count])  # (3C,)
        if sync:
            dist.all_reduce(sums)
        total, total_square, count = sums.chunk(3)
        shifted_mean = total / count
        var = (total_square / count - shifted_mean.square()).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        # Finite at padding (values are zero there), where y and both gradients are masked.
        normalised = (values - shifted_mean.view(per_channel)) * invstd.view(per_channel)
        mean = shifted_mean + shift.to(stats_dtype)
        y = torch.addcmul(bias.view(per_channel), normalised, weight.view(per_channel)).masked_fill(padding, 0)
        ctx.save_for_backward(normalised, invstd, weight, padding, count)
        ctx.reduce_dims, ctx.per_channel, ctx.sync, ctx.dtype = reduce_dims, per_channel, sync, x.dtype
        ctx.mark_non_differentiable(mean, var, count)
        ctx.set_materialize_grads(False)  # the statistics get no gradient: no zeros to launch for them
        return y.to(x.dtype), mean, var, count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, _grad_mean, _grad_var, _grad_count):
        normalised, invstd, weight, padding, count = ctx.saved_tensors
        dims, per_channel = ctx.reduce_dims, ctx.per_channel
        if grad_y is None:  # y did not reach the loss
            return None, None, None, None, None, None, None, None
        # y is zero at padding whatever x is, so the gradient arriving there counts for nothing.
        grad = grad_y.to(normalised.dtype).masked_fill(padding, 0)
        sum_grad = grad.sum(dims)
        sum_grad_normalised = (grad * normalised).sum(dims)
        # This rank's shares: the trainer's DDP sums parameter gradients over ranks.
        grad_weight, grad_bias = sum_grad_normalised.to(weight.dtype), sum_grad.to(weight.dtype)
        if ctx.sync:
            sums = torch.cat([sum_grad, sum_grad_normalised])
            dist.all_reduce(sums)
            sum_grad, sum_grad_normalised = sums.chunk(2)
        grad_x = torch.addcmul(
            grad - (sum_grad / count).view(per_channel), normalised, (sum_grad_normalised / count).view(per_channel),
            value=-1,
        )
        grad_x = (grad_x * (weight * invstd).view(per_channel)).masked_fill(padding, 0)
        return grad_x.to(ctx.dtype), None, grad_weight, grad_bias, None, None, None, None


class MaskedBatchNorm(nn.Module):
    """Batch norm whose batch statistics use only the positions a mask marks valid, so padding never changes an output.

    Serves as DeepSpeech2's sequence-wise batch norm on (T, B, H) (channel_dim=2) and as the conv front end's
    batch norm on (B, C, F, T) (channel_dim=1). Training normalises with the batch mean and (biased) variance over
    valid positions and updates running statistics with the unbiased variance, as torch.nn.BatchNorm does; eval uses
    the running statistics. Padded positions of the output are zero.

    sync_stats: when True and torch.distributed is initialised, the per-channel sums, sums of squares and counts are
    all-reduced so every rank normalises with the statistics of the global batch, and in the backward the sums that
    the input's gradient needs, so that gradient is the global batch's too. The trainer switches it on; it is off by
    default so a single process needs no process group.
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
        channel_dim = self.channel_dim % x.dim()
        if self.training:
            sync = self.sync_stats and dist.is_available() and dist.is_initialized()
            y, mean, var, count = _BatchStatisticsNorm.apply(x, mask, self.weight, self.bias, self.running_mean,
                                                             self.eps, channel_dim, sync)
            if x.numel() == 0 and not sync:
                # An empty batch has no statistics (its mean is 0 / 0, which made every later evaluation NaN): the
                # running ones stay as they were, as torch.nn's do. Told by the shape, so without a host sync.
                return y
            with torch.no_grad():
                # One valid value has no unbiased variance (torch.nn refuses the batch; telling would take a host
                # sync): the running variance is left as it was rather than pulled towards 0.
                unbiased_var = torch.where(count > 1, var * count / (count - 1).clamp_min(1), self.running_var)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), self.momentum)
                self.running_var.lerp_(unbiased_var.to(self.running_var.dtype), self.momentum)
            return y
        per_channel = _per_channel_shape(x.dim(), channel_dim)
        stats_dtype = torch.promote_types(x.dtype, torch.float32)
        scale = (self.weight * torch.rsqrt(self.running_var + self.eps)).to(stats_dtype).view(per_channel)
        # Centred in at least float32, as in training: a bf16 x * scale less the mean's share cancelled to a few
        # digits for a channel whose mean stands many standard deviations from zero (0.75 off at 100 of them).
        centred = x.to(stats_dtype) - self.running_mean.to(stats_dtype).view(per_channel)
        padding = ~mask
        # Padding zeroed before the multiply too, so that a non-finite value there cannot reach the weight's gradient.
        y = centred.masked_fill(padding, 0) * scale + self.bias.to(stats_dtype).view(per_channel)
        return y.to(x.dtype).masked_fill(padding, 0)
