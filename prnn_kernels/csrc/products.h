// The fp32 matrix products compiled by Triton (prnn_kernels/products.py), launched from C++ (products.cpp), and the
// copy that lays their operands out for them (k_major_copy.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#ifndef __CUDACC__
#include <torch/extension.h>

#include <string>

// Loads the compiled product, with or without a bias, in its large or small tiling, for a device.
void load_product(int64_t device, bool has_bias, bool small_tiles, const std::string& cubin, const std::string& name,
                  int64_t block_m, int64_t block_n, int64_t warps, int64_t shared_bytes, int64_t scratch_bytes);

// a (M, K) @ b (N, K)^T [+ bias (N,)] -> (M, N) float32 on a's device and current stream, rows padded to a multiple
// of 4. With reverse_b_blocks_of = n, b's K index runs in blocks of n taken in reverse order (a sequence's steps of
// n samples, backwards).
at::Tensor product(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias,
                   int64_t reverse_b_blocks_of);
#endif

// out (rows, columns) = the transpose of source (columns, rows), optionally with source's rows in blocks of
// reverse_blocks_of taken in reverse order (0: as they are).
cudaError_t launch_k_major_copy(const float* source, float* out, int rows, int columns, int64_t source_stride,
                                int64_t out_stride, int reverse_blocks_of, cudaStream_t stream);
