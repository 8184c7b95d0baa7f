// KV store on CUDA: row i of k / v goes to row indices[i] of the dense caches.
//
// One warp per token row, 16-byte vector copies when every pointer, stride and the
// row length allow it, narrower words otherwise. int32 or int64 indices. Launched on
// the caller's stream (torch's current stream). optimized/build_cuda.py builds it with nvcc;
// optimized/store.py loads it through cffi ABI mode (its declarations are csrc/store_cuda.h).
// The kernel guards its range itself (skip and flag), so it needs no pre-pass and no host
// sync; the checked mode validates indices before launching (optimized/store.py).
#include <cuda_runtime.h>
#include <stdint.h>

#include "store_cuda.h"

namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarp * kWarpsPerBlock;

template <typename IndexT, typename WordT>
__global__ void store_rows_kernel(char *__restrict__ k_cache, char *__restrict__ v_cache,
                                  const IndexT *__restrict__ indices, const char *__restrict__ k,
                                  const char *__restrict__ v, int64_t n, int64_t num_slots, int64_t row_bytes,
                                  int64_t k_stride, int64_t v_stride, int32_t *__restrict__ errors) {
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
    const int lane = threadIdx.x % kWarp;
    if (row >= n) {
        return;
    }
    const int64_t slot = static_cast<int64_t>(indices[row]);
    if (slot < 0 || slot >= num_slots) {
        if (lane == 0) {
            atomicOr(errors, RADIX_STORE_FLAG_OUT_OF_RANGE);
        }
        return;
    }
    const int64_t words = row_bytes / static_cast<int64_t>(sizeof(WordT));
    const WordT *ks = reinterpret_cast<const WordT *>(k + row * k_stride);
    const WordT *vs = reinterpret_cast<const WordT *>(v + row * v_stride);
    WordT *kd = reinterpret_cast<WordT *>(k_cache + slot * row_bytes);
    WordT *vd = reinterpret_cast<WordT *>(v_cache + slot * row_bytes);
    for (int64_t i = lane; i < words; i += kWarp) {
        const WordT kw = ks[i];
        const WordT vw = vs[i];
        kd[i] = kw;
        vd[i] = vw;
    }
}

int64_t widest_word(uintptr_t alignment) {
    for (int64_t width = 16; width > 1; width /= 2) {
        if (alignment % static_cast<uintptr_t>(width) == 0) {
            return width;
        }
    }
    return 1;
}

template <typename IndexT>
cudaError_t launch_store(char *k_cache, char *v_cache, const IndexT *indices, const char *k, const char *v, int64_t n,
                         int64_t num_slots, int64_t row_bytes, int64_t k_stride, int64_t v_stride,
                         int32_t *errors, cudaStream_t stream) {
    const uintptr_t alignment = reinterpret_cast<uintptr_t>(k_cache) | reinterpret_cast<uintptr_t>(v_cache) |
                                reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v) |
                                static_cast<uintptr_t>(row_bytes) | static_cast<uintptr_t>(k_stride) |
                                static_cast<uintptr_t>(v_stride);
    const dim3 grid(static_cast<unsigned int>((n + kWarpsPerBlock - 1) / kWarpsPerBlock));
    switch (widest_word(alignment)) {
        case 16:
            store_rows_kernel<IndexT, uint4><<<grid, kThreads, 0, stream>>>(
                k_cache, v_cache, indices, k, v, n, num_slots, row_bytes, k_stride, v_stride, errors);
            break;
        case 8:
            store_rows_kernel<IndexT, uint2><<<grid, kThreads, 0, stream>>>(
                k_cache, v_cache, indices, k, v, n, num_slots, row_bytes, k_stride, v_stride, errors);
            break;
        case 4:
            store_rows_kernel<IndexT, uint32_t><<<grid, kThreads, 0, stream>>>(
                k_cache, v_cache, indices, k, v, n, num_slots, row_bytes, k_stride, v_stride, errors);
            break;
        case 2:
            store_rows_kernel<IndexT, uint16_t><<<grid, kThreads, 0, stream>>>(
                k_cache, v_cache, indices, k, v, n, num_slots, row_bytes, k_stride, v_stride, errors);
            break;
        default:
            store_rows_kernel<IndexT, uint8_t><<<grid, kThreads, 0, stream>>>(
                k_cache, v_cache, indices, k, v, n, num_slots, row_bytes, k_stride, v_stride, errors);
            break;
    }
    return cudaGetLastError();
}

}  // namespace

int radix_store_launch(void *k_cache, void *v_cache, const void *indices, int index_bytes, int64_t n,
                       int64_t num_slots, int64_t row_bytes, const void *k, int64_t k_stride, const void *v,
                       int64_t v_stride, int32_t *errors, void *stream) {
    if (n < 0 || num_slots < 0 || row_bytes <= 0 || k_stride < 0 || v_stride < 0 || errors == nullptr ||
        (index_bytes != 4 && index_bytes != 8)) {
        return RADIX_STORE_BAD_ARGS;
    }
    if (n == 0) {
        return RADIX_STORE_OK;
    }
    // an empty pool may have no memory at all: the kernel then skips and flags every row
    if ((num_slots > 0 && (k_cache == nullptr || v_cache == nullptr)) || indices == nullptr || k == nullptr ||
        v == nullptr) {
        return RADIX_STORE_BAD_ARGS;
    }
    auto s = static_cast<cudaStream_t>(stream);
    auto kc = static_cast<char *>(k_cache);
    auto vc = static_cast<char *>(v_cache);
    auto ks = static_cast<const char *>(k);
    auto vs = static_cast<const char *>(v);
    cudaError_t status =
        index_bytes == 4
            ? launch_store(kc, vc, static_cast<const int32_t *>(indices), ks, vs, n, num_slots, row_bytes, k_stride,
                           v_stride, errors, s)
            : launch_store(kc, vc, static_cast<const int64_t *>(indices), ks, vs, n, num_slots, row_bytes, k_stride,
                           v_stride, errors, s);
    return static_cast<int>(status);
}

const char *radix_cuda_error_string(int status) { return cudaGetErrorString(static_cast<cudaError_t>(status)); }
