// Hopper (sm_90a) primitives: mbarriers, TMA tensor loads, the wgmma fences and shared-memory
// matrix descriptors, and setmaxnreg. Operand meanings are the PTX ISA's.
#pragma once

#include <cuda.h>
#include <stdint.h>

namespace fa {

// ---------------------------------------------------------------- mbarrier

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Makes initialised barriers visible to the TMA (the async proxy).
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones
// (a TMA load into shared memory the thread has written or read).
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Returns once the phase of parity `parity` has completed (for a fresh barrier, parity 1
// counts as the completed phase before the first: a producer's first pass over a ring).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// ---------------------------------------------------------------- TMA

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// A box of the tensor map at coordinates (c0, c1, c2) (innermost first) into shared memory,
// completing its bytes on `bar`.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}

// A box of shared memory at `src` (laid out as a load of the same map would leave it) to the
// tensor map's coordinates (c0, c1, c2), in this thread's current bulk group: elements outside
// the map's dims are not written. The writing threads' fence.proxy.async and a barrier must
// come first; bulk_wait_read before `src` is written again (or the block exits).
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                             int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                 ::"l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}

// ---------------------------------------------------------------- bulk reductions

// `bytes` (a multiple of 16) of float32 at shared `src` added element by element to global
// `dst` (both 16-byte aligned) by the TMA unit (cp.reduce.async.bulk .add.f32, sm_90), in this
// thread's current bulk group: the thread goes on at once, and no register waits for the
// memory system (what per-element red.global.add costs).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                     dst),
                 "r"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Returns once at most N of this thread's bulk groups have not yet read their shared source
// (it may be written again) ...
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// ... or not yet completed (their writes performed).
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---------------------------------------------------------------- wgmma fences

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Ties accumulator registers to this point of the program: the compiler may not move
// their reads above a wgmma_wait or their writes below a wgmma issue (CUTLASS's
// warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void fence_registers(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// ---------------------------------------------------------------- descriptors

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address,
// leading and stride byte offsets, all >> 4 in 14 bits; bits 62-63 the swizzle mode
// (1 = 128-byte, 2 = 64-byte, 3 = 32-byte).
template <int SWIZZLE_BYTES>
__device__ __forceinline__ uint64_t make_descriptor(uint32_t addr, uint32_t leading_bytes,
                                                    uint32_t stride_bytes) {
    static_assert(SWIZZLE_BYTES == 128 || SWIZZLE_BYTES == 64 || SWIZZLE_BYTES == 32,
                  "a 128-, 64- or 32-byte swizzle");
    constexpr uint64_t mode = SWIZZLE_BYTES == 128 ? 1 : SWIZZLE_BYTES == 64 ? 2 : 3;
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((leading_bytes & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)((stride_bytes & 0x3FFFF) >> 4) << 32) | (mode << 62);
}
// Tiles are stored as column chunks of `rows` rows x SWIZZLE_BYTES bytes in that swizzle
// (16-byte unit u of row r at unit u ^ ((r / (128 / SWIZZLE_BYTES)) % (SWIZZLE_BYTES / 16)):
// the pattern repeats every 8 rows x SWIZZLE_BYTES), each chunk aligned to that atom: what
// the TMA writes with CU_TENSOR_MAP_SWIZZLE_{128,64}B and a {SWIZZLE_BYTES / 2, rows, 1} box.
// 128 bytes (64 two-byte columns) where head_dim allows; 64 bytes for head_dim 96, as
// CUTLASS's smem selector and FlashAttention-3 choose for a K extent of 96.
//
// K-major operand (head_dim contiguous: Q, K), k16 step j (32 bytes of a row): chunk
// j / (SWIZZLE_BYTES / 32), that column within it; LBO unused by swizzled K-major layouts,
// SBO = the next 8 rows (one atom).
template <int SWIZZLE_BYTES>
__device__ __forceinline__ uint64_t swizzled_k_major(uint32_t tile, int rows, int j) {
    constexpr int steps = SWIZZLE_BYTES / 32;
    return make_descriptor<SWIZZLE_BYTES>(
        tile + (j / steps) * rows * SWIZZLE_BYTES + (j % steps) * 32, 16, 8 * SWIZZLE_BYTES);
}
// MN-major operand (V: keys x head_dim, head_dim contiguous, used as B[keys][head_dim]),
// k16 step j (keys 16 j .. 16 j + 15): LBO = the next SWIZZLE_BYTES / 2 head_dim columns
// (the next chunk of `rows` keys), SBO = the next 8 keys, as CUTLASS's and ThunderKittens'
// MN-major swizzled descriptors have it (CUTLASS make_gmma_desc: ((T,8|4,m),(8,k)) :
// ((1,T,LBO),(8T|4T,SBO))). Confirmed on the H200 for 128 bytes (2026-12-03): the other
// reading (the PTX ISA's one-line LBO/SBO definitions taken literally) faulted with an
// illegal address.
template <int SWIZZLE_BYTES>
__device__ __forceinline__ uint64_t swizzled_mn_major(uint32_t tile, int rows, int j) {
    return make_descriptor<SWIZZLE_BYTES>(tile + j * 16 * SWIZZLE_BYTES, rows * SWIZZLE_BYTES,
                                          8 * SWIZZLE_BYTES);
}

// The same descriptors as a base (make_descriptor once per tile) plus a per-step constant:
// the start-address field (bits 0-13, address >> 4) takes a byte offset >> 4 without carrying
// into LBO, as shared addresses stay below 256 KB. With j unrolled each step is one 64-bit add
// of an immediate, where make_descriptor per wgmma costs a dozen dependent instructions
// (ptxas's SASS: uniform-register masks and shifts between consecutive HGMMAs).
template <int SWIZZLE_BYTES>
__device__ __forceinline__ uint64_t k_major_base(uint32_t tile) {
    return make_descriptor<SWIZZLE_BYTES>(tile, 16, 8 * SWIZZLE_BYTES);
}
template <int SWIZZLE_BYTES, int Rows>
__host__ __device__ constexpr uint64_t k_major_step(int j) {
    return (uint64_t)((j / (SWIZZLE_BYTES / 32)) * Rows * SWIZZLE_BYTES +
                      (j % (SWIZZLE_BYTES / 32)) * 32) >> 4;
}
template <int SWIZZLE_BYTES, int Rows>
__device__ __forceinline__ uint64_t mn_major_base(uint32_t tile) {
    return make_descriptor<SWIZZLE_BYTES>(tile, Rows * SWIZZLE_BYTES, 8 * SWIZZLE_BYTES);
}
template <int SWIZZLE_BYTES>
__host__ __device__ constexpr uint64_t mn_major_step(int j) {
    return (uint64_t)(j * 16 * SWIZZLE_BYTES) >> 4;
}

// ---------------------------------------------------------------- named barriers

// bar.sync / bar.arrive on barrier `id` (1..15; 0 is __syncthreads) of `threads` threads, a
// multiple of 32 counted in whole warps: sync waits for the phase to complete, arrive counts
// the calling warps in without waiting (PTX ISA, "bar, barrier").
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Byte `byte` of row `row` of a tile stored as above (column chunks of `rows` rows x
// SWIZZLE_BYTES, 16-byte units permuted by the swizzle): its offset from the tile's start.
// What the TMA wrote, for code that reads or writes the tile itself (an epilogue staging
// its output in a Q tile).
template <int SWIZZLE_BYTES>
__device__ __forceinline__ uint32_t swizzled_offset(int rows, int row, int byte) {
    const int chunk = byte / SWIZZLE_BYTES, in_row = byte % SWIZZLE_BYTES;
    const int phase = (row / (128 / SWIZZLE_BYTES)) % (SWIZZLE_BYTES / 16);
    return chunk * rows * SWIZZLE_BYTES + row * SWIZZLE_BYTES +
           (((in_row / 16) ^ phase) * 16 | (in_row % 16));
}

// ---------------------------------------------------------------- stmatrix

// Four 8x8 b16 matrices to shared memory, transposed (stmatrix .trans, sm_90): register i of
// lane l holds row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix i (the m16n8
// accumulator layout, packed); lanes 8i..8i+7 give the addresses of matrix i's stored rows,
// and stored row r (16 bytes) receives column r of the matrix. What turns a fragment of
// dS^T (keys x queries) into rows of dS (queries x keys) in the backward.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                     addr),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// ---------------------------------------------------------------- registers

// Warpgroup-wide register budget changes (the producer gives, the consumers take).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

}  // namespace fa
