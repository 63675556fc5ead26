"""Persistent RNN kernels for PyTorch: drop-in RNN / GRU / LSTM modules and the pure-PyTorch reference recurrence.

The CUDA extension behind `prnn_kernels.persistent` is built just in time, when a module first asks for it on a GPU,
so this package imports on machines without a GPU or a compiler.
"""
from prnn_kernels.modules import BACKENDS, GRU, LSTM, RNN
from prnn_kernels.reference import NUM_GATES, checked_lengths, reference_layer, relative_error

__all__ = ["BACKENDS", "GRU", "LSTM", "NUM_GATES", "RNN", "checked_lengths", "reference_layer", "relative_error"]
