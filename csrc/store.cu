// KV store on CUDA: row i of k / v goes to row indices[i] of the dense caches.
//
// One warp per token row, 16-byte vector copies when every pointer, stride and the
// row length allow it, narrower words otherwise. int32 or int64 indices. Launched on
// the caller's stream (torch's current stream), loaded through cffi ABI mode
// (optimized/kv_store.py). A separate check kernel validates indices (range and
// duplicates, via a bitmap) before any write; the store kernel also guards its range.
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarp * kWarpsPerBlock;

template <typename IndexT, typename WordT>
__global__ void store_rows_kernel(char *__restrict__ k_cache, char *__restrict__ v_cache,
                                  const IndexT *__restrict__ indices, const char *__restrict__ k,
                                  const char *__restrict__ v, int64_t n, int64_t num_slots, int64_t row_bytes,
                                  int64_t k_stride, int64_t v_stride, int *__restrict__ error) {
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
    const int lane = threadIdx.x % kWarp;
    if (row >= n) {
        return;
    }
    const int64_t slot = static_cast<int64_t>(indices[row]);
    if (slot < 0 || slot >= num_slots) {
        if (lane == 0) {
            atomicOr(error, 1);
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

template <typename IndexT>
__global__ void check_indices_kernel(const IndexT *__restrict__ indices, int64_t n, int64_t num_slots,
                                     unsigned int *__restrict__ bitmap, int *__restrict__ error) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const int64_t slot = static_cast<int64_t>(indices[i]);
    if (slot < 0 || slot >= num_slots) {
        atomicOr(error, 1);
        return;
    }
    const unsigned int bit = 1u << (slot & 31);
    if (atomicOr(&bitmap[slot >> 5], bit) & bit) {
        atomicOr(error, 2);
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
                         int64_t num_slots, int64_t row_bytes, int64_t k_stride, int64_t v_stride, int *error,
                         cudaStream_t stream) {
    const uintptr_t alignment = reinterpret_cast<uintptr_t>(k_cache) | reinterpret_cast<uintptr_t>(v_cache) |
                                reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v) |
                                static_cast<uintptr_t>(row_bytes) | static_cast<uintptr_t>(k_stride) |
                                static_cast<uintptr_t>(v_stride);
    const dim3 grid(static_cast<unsigned int>((n + kWarpsPerBlock - 1) / kWarpsPerBlock));
    switch (widest_word(alignment)) {
        case 16:
            store_rows_kernel<IndexT, uint4><<<grid, kThreads, 0, stream>>>(
                k_cache, v_cache, indices, k, v, n, num_slots, row_bytes, k_stride, v_stride, error);
            break;
        case 8:
            store_rows_kernel<IndexT, uint2><<<grid, kThreads, 0, stream>>>(
                k_cache, v_cache, indices, k, v, n, num_slots, row_bytes, k_stride, v_stride, error);
            break;
        case 4:
            store_rows_kernel<IndexT, uint32_t><<<grid, kThreads, 0, stream>>>(
                k_cache, v_cache, indices, k, v, n, num_slots, row_bytes, k_stride, v_stride, error);
            break;
        case 2:
            store_rows_kernel<IndexT, uint16_t><<<grid, kThreads, 0, stream>>>(
                k_cache, v_cache, indices, k, v, n, num_slots, row_bytes, k_stride, v_stride, error);
            break;
        default:
            store_rows_kernel<IndexT, uint8_t><<<grid, kThreads, 0, stream>>>(
                k_cache, v_cache, indices, k, v, n, num_slots, row_bytes, k_stride, v_stride, error);
            break;
    }
    return cudaGetLastError();
}

}  // namespace

extern "C" {

// Returns a cudaError_t (0 on success); -1 for bad arguments. error: a device int the
// kernel ORs 1 into if it met an out-of-range index (it then skipped that row).
int radix_store_launch(void *k_cache, void *v_cache, const void *indices, int index_bytes, int64_t n,
                       int64_t num_slots, int64_t row_bytes, const void *k, int64_t k_stride, const void *v,
                       int64_t v_stride, void *error, void *stream) {
    if (n < 0 || row_bytes <= 0 || k_stride < row_bytes || v_stride < row_bytes || error == nullptr ||
        (index_bytes != 4 && index_bytes != 8)) {
        return -1;
    }
    if (n == 0) {
        return 0;
    }
    auto s = static_cast<cudaStream_t>(stream);
    auto kc = static_cast<char *>(k_cache);
    auto vc = static_cast<char *>(v_cache);
    auto ks = static_cast<const char *>(k);
    auto vs = static_cast<const char *>(v);
    auto err = static_cast<int *>(error);
    if (index_bytes == 4) {
        return launch_store(kc, vc, static_cast<const int32_t *>(indices), ks, vs, n, num_slots, row_bytes, k_stride,
                            v_stride, err, s);
    }
    return launch_store(kc, vc, static_cast<const int64_t *>(indices), ks, vs, n, num_slots, row_bytes, k_stride,
                        v_stride, err, s);
}

// Clears bitmap (ceil(num_slots / 32) words) and error, then ORs 1 into error for an
// out-of-range index and 2 for an index seen twice. Returns a cudaError_t, or -1.
int radix_check_indices_launch(const void *indices, int index_bytes, int64_t n, int64_t num_slots, void *bitmap,
                               void *error, void *stream) {
    if (n < 0 || num_slots < 0 || bitmap == nullptr || error == nullptr || (index_bytes != 4 && index_bytes != 8)) {
        return -1;
    }
    auto s = static_cast<cudaStream_t>(stream);
    cudaError_t status = cudaMemsetAsync(bitmap, 0, static_cast<size_t>((num_slots + 31) / 32) * 4, s);
    if (status == cudaSuccess) {
        status = cudaMemsetAsync(error, 0, sizeof(int), s);
    }
    if (status != cudaSuccess || n == 0) {
        return static_cast<int>(status);
    }
    const unsigned int blocks = static_cast<unsigned int>((n + kThreads - 1) / kThreads);
    auto words = static_cast<unsigned int *>(bitmap);
    auto err = static_cast<int *>(error);
    if (index_bytes == 4) {
        check_indices_kernel<<<blocks, kThreads, 0, s>>>(static_cast<const int32_t *>(indices), n, num_slots, words,
                                                         err);
    } else {
        check_indices_kernel<<<blocks, kThreads, 0, s>>>(static_cast<const int64_t *>(indices), n, num_slots, words,
                                                         err);
    }
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
