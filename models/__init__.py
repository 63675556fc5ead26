"""The DeepSpeech2 model, built on prnn_kernels recurrent layers."""
from models.batch_norm import MaskedBatchNorm
from models.deepspeech2 import DeepSpeech2

__all__ = ["DeepSpeech2", "MaskedBatchNorm"]
