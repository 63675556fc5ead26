"""The model's training forward and backward replayed from CUDA graphs (the trainer's train.cuda_graphs).

At a small per-GPU batch a training step is bound by the host, not the GPU: the AN4 model at batch 4 issues about
750 kernels a step, and Python and ATen take longer to launch them than the GPU takes to run them
(benchmarks.train_step). A graph launches all of a pass's kernels at once. Graphs fix every shape, so each batch is
padded in time to a multiple of `pad_frames` (the model masks padding, so no valid output changes) and one
forward/backward pair is captured per (batch size, padded frames), the first time that shape comes. Everything
after the model (CTC loss, clipping, the optimizer) stays eager.
"""
import contextlib
import gc

import torch
import torch.nn.functional as F
from torch import nn

import prnn_kernels
from prnn_kernels.persistent import graph_replayed

_RECURRENT_MODULES = (prnn_kernels.RNN, prnn_kernels.GRU, prnn_kernels.LSTM)


def check_capturable(model: nn.Module, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Raises ValueError, naming the layer, where a recurrent layer of `model` would run a batch of this size and
    dtype on cuDNN, whose packed sequences need their lengths on the host, which a graph cannot capture."""
    for name, module in model.named_modules():
        if isinstance(module, _RECURRENT_MODULES) and module.backend_for(batch_size, dtype, device) == "cudnn":
            raise ValueError(
                f"CUDA graphs: recurrent layer {name} runs on cuDNN at {_batch_run_at(module, batch_size)} ({dtype}), "
                "whose packed sequences need their lengths on the host, which a graph cannot capture; use "
                "model.backend=persistent (it says why a shape cannot run) or train.cuda_graphs=false"
            )


def _batch_run_at(module: nn.Module, batch_size: int) -> str:
    """The batch a recurrent layer runs, the one its backend was chosen for: with batch_slice, its slices."""
    if module.batch_slice is None or batch_size <= module.batch_slice:
        return f"batch {batch_size}"
    return f"batch {module.batch_slice} (a batch of {batch_size} runs as slices of at most {module.batch_slice})"


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector held off inside the block, for a CUDA graph's capture. A graphed module left
    behind sits in a reference cycle (make_graphed_callables makes one), so a collection may free its graphs at any
    allocation, and freeing a graph during another's capture is a CUDA call that capture forbids: torch warns
    "operation not permitted when stream is capturing" and the capture fails (cudaErrorStreamCaptureInvalidated).
    torch.cuda.graph does not collect before it captures (torch 2.11 and 2.14 here)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _AutocastForward(nn.Module):
    """The model's forward under bf16 autocast without the cast-weight cache, which capture does not allow."""

    def __init__(self, model: nn.Module, amp: bool):
        super().__init__()
        self.model = model
        self.amp = amp

    def forward(self, features, lengths):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.amp, cache_enabled=False):
            return self.model(features, lengths)


class CudaGraphed(nn.Module):
    """Wraps a DeepSpeech2 on a GPU: in training mode its forward, and the backward through it, replay CUDA graphs.

    Same call and outputs as the model: (log_probs (T', B, V), out_lengths). `amp` is whether the step runs under
    bf16 autocast (the graphs carry their own autocast; an enclosing one is ignored). Evaluation mode runs the model
    eagerly. Every recurrent layer must run on the persistent (or reference) backend at each batch size it sees:
    the cuDNN path packs sequences by lengths copied to the host, which a graph cannot hold.

    In a job of several ranks over NCCL, the batch norms' all-reduces (`sync_stats`) are captured with the rest, and
    DistributedDataParallel wraps this module: the graphed backward hands each parameter's gradient to autograd
    outside the graph, where DDP's hooks all-reduce it eagerly. A graph's captured all-reduces pair with the other
    ranks' only if every rank replays the same graph at the same step: each passes the same batch size and, as
    `min_frames`, the longest shard's frames, so all of them pad to the same length.
    """

    def __init__(self, model: nn.Module, pad_frames: int, amp: bool):
        super().__init__()
        if not isinstance(pad_frames, int) or pad_frames < 1:
            raise ValueError(f"CUDA graphs: pad_frames must be a positive integer, not {pad_frames!r}")
        self.model = model
        self.pad_frames = pad_frames
        self.amp = amp
        # (batch size, padded frames) -> graphed _AutocastForward; a plain dict, so the graphs stay out of
        # state_dict() and module traversal.
        self._graphed = {}
        # One memory pool for all graphs, so they take the memory of the largest rather than the sum. Safe because a
        # graph's backward always replays right after its forward, before any other graph: what one graph keeps
        # between replays (inputs, outputs, gradients) stays allocated and is never handed to another, and what it
        # frees at capture holds data only within a forward-backward pair.
        self._pool = None

    def graph_shape(self, batch_size: int, num_frames: int, min_frames: int = 0) -> tuple[int, int]:
        """The (batch size, padded frames) whose graphs a training batch of this size replays."""
        return batch_size, -(-max(num_frames, min_frames) // self.pad_frames) * self.pad_frames

    def is_captured(self, shape: tuple[int, int]) -> bool:
        """Whether graphs of this graph_shape exist; its first batch captures them, which takes a few passes."""
        return shape in self._graphed

    def forward(self, features, lengths, min_frames: int = 0):
        """features: (B, T, F) and lengths: (B,), both on the model's GPU; training mode pads the batch to at least
        `min_frames` frames, rounded up to a multiple of pad_frames."""
        if not self.training:
            return self.model(features, lengths)
        batch_size, num_frames, _ = features.shape
        key = self.graph_shape(batch_size, num_frames, min_frames)
        features = F.pad(features, (0, 0, 0, key[1] - num_frames))
        if key not in self._graphed:
            self._graphed[key] = self._capture(features, lengths)
        with torch.autocast("cuda", enabled=False):
            log_probs, out_lengths = self._graphed[key](features, lengths)
        graph_replayed(features.device)
        # The backward graph replays inside this node's backward; a hook after it checks those kernels too.
        log_probs.grad_fn.register_hook(lambda grad_inputs, grad_outputs: graph_replayed(features.device))
        num_out_frames = int(self.model.output_lengths(torch.tensor(num_frames)))
        return log_probs[:num_out_frames], out_lengths

    def _capture(self, features, lengths):
        dtype = torch.bfloat16 if self.amp else next(self.model.parameters()).dtype
        check_capturable(self.model, features.shape[0], dtype, features.device)
        # The captured autograd graph keeps the parameters' gradient accumulators, made on the capture's side stream,
        # alive, so every backward warns that they run on another stream than the graph's; the engine synchronises
        # the two streams, so the results are right and the warning says nothing a user can act on.
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
        # The warm-up passes before capture update batch-norm running statistics: put them back afterwards.
        saved = [buffer.clone() for buffer in self.model.buffers()]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.autocast("cuda", enabled=False), collector_paused():
            graphed = torch.cuda.make_graphed_callables(
                _AutocastForward(self.model, self.amp), (features, lengths), pool=self._pool
            )
        with torch.no_grad():
            for buffer, value in zip(self.model.buffers(), saved):
                buffer.copy_(value)
        return graphed
