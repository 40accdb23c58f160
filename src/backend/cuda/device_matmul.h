// Weight products on a CUDA device for the CUDA backend's forward pass. A GGUF weight matrix is
// dequantized once at load (model::dequantize_row, the values the CPU backend multiplies) and
// kept on the device as two bf16 terms, W = W_hi + W_lo (W_hi = bf16(W), W_lo = bf16(W - W_hi));
// float activation rows are split the same way, and three bf16 tensor-core products through
// cuBLAS, with fp32 accumulation, give
//   y[t][o] = (W_hi x_hi + W_hi x_lo) + W_lo x_hi,  t < rows, o < n_out
// (x_hi and x_lo stacked as one product's rows, so W_hi is read once). The terms left out,
// W_lo x_lo and the lows' own rounding, are about 2^-16 of |W| |x| per product: the products are
// fp32-accurate, where a plain bf16 product (each operand rounded to 8 bits) moved SmolLM2's
// logits by a KL of up to 4e-3 against the CPU's f32 activations (docs/bench/cuda_history.md).
// Batch invariance: cublasGemmEx picks its kernel per shape, and another kernel sums a row's
// products in another order (on the H200 with CUDA 13.0 rows kept their bits from 1 to 64 rows,
// not at 512). The forward pass therefore pins one cuBLASLt algorithm per weight shape
// (ProductKernel::kPinned: chosen once, split-K off) and runs every row count through it, so a
// row's sums never depend on the rows beside it, by construction; the test is
// DeviceMatmul.APinnedRowsProductDoesNotDependOnTheRowCount (every count from 1 to 80, and up to
// two chunks and a row). Pinned at 64 rows, its products take as long as the heuristic's at 1 to
// 64 rows and 3-8x less at 1,024 rows on Qwen2.5-0.5B's shapes (bench/cuda/matmul_bench.cc,
// docs/bench/h200_device_matmul_*.jsonl). The heuristic kernel, in chunks of kProductRows
// rows, remains for a cuBLASLt that cannot pin a shape.
// Reference: device_matmul_ref (the float weights and activations, sums in double).
// Thread safety: one owner; launches go to the stream given at create.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cache/cuda/device_pool.h"
#include "core/cuda_status.h"
#include "model/matmul.h"

namespace certkv::backend::cuda {

// One weight matrix on the device: [2 (hi, lo)][n_out][n_in] bf16.
struct DeviceMatrix {
  cache::cuda::DeviceBuffer data;
  int64_t n_in = 0, n_out = 0;
};

// The float values of w ([n_out][n_in]), as model::dequantize_row gives them.
std::vector<float> dequantized_weights(const model::WeightMatrix& w);

// Bytes a DeviceMatrix of w takes on the device.
inline uint64_t device_matrix_bytes(const model::WeightMatrix& w) { return uint64_t(w.n_in) * uint64_t(w.n_out) * 4; }

// Uploads the two bf16 terms of dequantized_weights(w). kUnsupported for a type
// model::dequantize_row does not read, kOutOfMemory when the device cannot hold it.
CudaStatus upload_matrix(const model::WeightMatrix& w, DeviceMatrix* out);
// The same for matrices of one input width stacked as one ([w0 rows; w1 rows; ...]): products
// that share their input (q, k, v; gate, up) in one. kInvalidArgument for differing n_in.
CudaStatus upload_stacked(const std::vector<const model::WeightMatrix*>& ws, DeviceMatrix* out);

// The most rows one product runs at once (ProductKernel::kHeuristic).
inline constexpr int64_t kProductRows = 64;
// The most rows one product runs at once with ProductKernel::kPinned.
inline constexpr int64_t kPinnedProductRows = 2048;

// How the three bf16 products run:
//  - kHeuristic: cublasGemmEx, whose kernel cuBLAS picks per shape and row count, in chunks of
//    kProductRows rows, every chunk's products run at the whole chunk's size (the rows past the
//    chunk's own read stale scratch and are not used): cuBLAS then picks one kernel per shape, so a
//    row keeps its bits whatever the rows beside it (on the H100 the kernel picked per row count
//    moved row 0's bits at 60 rows);
//  - kPinned: cublasLt with one algorithm per weight shape, chosen once (from cuBLASLt's
//    heuristic at pin_rows rows, split-K off) and used for every row count, in chunks of
//    kPinnedProductRows: a row's sums run through the same kernel whatever the rows beside it.
enum class ProductKernel : uint8_t { kHeuristic = 0, kPinned = 1 };

class DeviceMatmul {
 public:
  // kInternal when cuBLAS cannot start (its status named).
  static CudaStatus create(void* stream, std::unique_ptr<DeviceMatmul>* out,
                           ProductKernel kernel = ProductKernel::kHeuristic, int64_t pin_rows = 64);
  ~DeviceMatmul();
  DeviceMatmul(const DeviceMatmul&) = delete;
  DeviceMatmul& operator=(const DeviceMatmul&) = delete;

  // y = x W^T: x [rows][w.n_in] float, y [rows][w.n_out] float (device pointers; y must not be
  // x). Enqueued on the stream; its scratch grows to the largest product. kInvalidArgument for
  // null pointers or rows < 0.
  CudaStatus multiply(const DeviceMatrix& w, const float* x, int64_t rows, float* y);
  // Grows the scratch to products of n_in inputs and n_out outputs now (whole chunks), and pins
  // the shape's algorithm (kPinned), so that multiply() allocates nothing (and can be captured in
  // a CUDA graph). kInternal (kPinned) when cuBLASLt offers no algorithm for the shape that runs
  // every row count without split-K.
  CudaStatus reserve(int64_t n_in, int64_t n_out);
  // The three products of an input already split in its two bf16 terms (hi_lo [2][rows][n_in],
  // e.g. rms_norm_split_rows's), as multiply() runs them on one chunk: *t = [2][rows][n_out]
  // (W_hi x_hi, W_hi x_lo), *u = [rows][n_out] (W_lo x_hi), in the scratch until the next product.
  // The caller sums them (sum_split_products or a fused form): multiply()'s bits. kInvalidArgument
  // for the heuristic kernel (whose chunks are not one product) or rows outside [1,
  // kPinnedProductRows].
  CudaStatus products(const DeviceMatrix& w, const uint16_t* hi_lo, int64_t rows, const float** t, const float** u);
  // Scratch for an input's terms, [2][kPinnedProductRows][the widest n_in reserved]: what
  // products() may read (multiply() overwrites it).
  uint16_t* input_terms() const { return reinterpret_cast<uint16_t*>(split_.data()); }
  ProductKernel kernel() const { return kernel_; }
  int64_t chunk_rows() const { return kernel_ == ProductKernel::kPinned ? kPinnedProductRows : kProductRows; }
  // Counts the scratch's moves: graphs captured before a move are stale.
  uint64_t scratch_generation() const { return generation_; }

 private:
  DeviceMatmul() = default;
  // Floats from the scratch's start to the third product's output (256-byte aligned).
  int64_t lo_product_offset(int64_t n_out) const;
  CudaStatus gemm(const uint16_t* w, int64_t n_in, int64_t n_out, const uint16_t* x, int64_t rows, float* y);
  CudaStatus pin(int64_t n_in, int64_t n_out);
  struct Pinned {
    int64_t n_in = 0, n_out = 0;
    uint64_t algo[8] = {};  // cublasLtMatmulAlgo_t
  };
  const Pinned* pinned(int64_t n_in, int64_t n_out) const;
  void* handle_ = nullptr;     // cublasHandle_t
  void* lt_handle_ = nullptr;  // cublasLtHandle_t (kPinned)
  void* stream_ = nullptr;
  ProductKernel kernel_ = ProductKernel::kHeuristic;
  int64_t pin_rows_ = 64;
  std::vector<Pinned> pinned_;
  cache::cuda::DeviceBuffer split_, partial_;  // the activations' terms; the three products
  cache::cuda::DeviceBuffer workspace_;        // cuBLAS's, set once (no allocation in a capture)
  uint64_t generation_ = 0;
};

// y[t][o] = sum_i x[t][i] * w[o][i] in double over the float values.
void device_matmul_ref(const float* w, int64_t n_in, int64_t n_out, const float* x, int64_t rows, double* y);

}  // namespace certkv::backend::cuda
