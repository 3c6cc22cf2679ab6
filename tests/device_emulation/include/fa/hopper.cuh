// kernels/include/fa/hopper.cuh emulated on host threads (../../emulator.hpp). The real header
// is included with its instructions renamed away, so its arithmetic (the shared-memory matrix
// descriptors, their steps, the swizzled offsets) is what the emulated kernels use; the
// instructions the emulated kernels issue are redefined below as the PTX ISA says they act.
// wgmma's asynchrony is not emulated: a product lands when issued, every wait is a no-op
// (as cp.async here), and so are the fences; stmatrix, the bulk reductions and the products
// themselves do what they do on the GPU. No mbarriers or TMA: kernels that use them do not
// run here.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fa/ptx.cuh"

#define fence_proxy_async_shared real_fence_proxy_async_shared
#define wgmma_fence real_wgmma_fence
#define wgmma_commit real_wgmma_commit
#define wgmma_wait real_wgmma_wait
#define fence_registers real_fence_registers
#define stmatrix_x4_trans real_stmatrix_x4_trans
#define bulk_reduce_add_f32 real_bulk_reduce_add_f32
#define bulk_commit real_bulk_commit
#define bulk_wait_read real_bulk_wait_read
#define bulk_wait real_bulk_wait
#include "../../../../kernels/include/fa/hopper.cuh"
#undef fence_proxy_async_shared
#undef wgmma_fence
#undef wgmma_commit
#undef wgmma_wait
#undef fence_registers
#undef stmatrix_x4_trans
#undef bulk_reduce_add_f32
#undef bulk_commit
#undef bulk_wait_read
#undef bulk_wait

namespace fa {

inline void fence_proxy_async_shared() {}
inline void wgmma_fence() {}
inline void wgmma_commit() {}
template <int N>
inline void wgmma_wait() {}
template <int N>
inline void fence_registers(float*) {}

// Four 8x8 b16 matrices, transposed: register i of lane l holds row l / 4, columns 2 (l % 4)
// and 2 (l % 4) + 1 of matrix i; lane 8 i + r gives the address of stored row r of matrix i,
// which receives column r of the matrix (8 b16, 16 bytes).
inline void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
    const uint32_t mine[5] = {r[0], r[1], r[2], r[3], addr};
    emu::exchange(mine, 5, [&](const uint32_t (*words)[12]) {
        const int lane = emu::lane_id(), matrix = lane / 8, column = lane % 8;
        const uint32_t row = words[lane][4];
        if (row % 16 || row + 16 > emu::kSharedBytes) {
            std::fprintf(stderr, "stmatrix row address %u is misaligned or out of range\n", row);
            std::abort();
        }
        for (int q = 0; q < 8; ++q) {
            const uint32_t word = words[4 * q + column / 2][matrix];
            const uint16_t bits = static_cast<uint16_t>(column % 2 ? word >> 16 : word & 0xFFFF);
            std::memcpy(shared_raw + row + 2 * q, &bits, 2);
        }
    });
}

// cp.reduce.async.bulk .add.f32: `bytes` of float32 at shared `src` added to global `dst`.
inline void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
    if (src % 16 || bytes % 16 || reinterpret_cast<uintptr_t>(dst) % 16 ||
        src + bytes > emu::kSharedBytes) {
        std::fprintf(stderr, "bulk reduction of %u bytes from %u: misaligned or out of range\n",
                     bytes, src);
        std::abort();
    }
    for (uint32_t i = 0; i < bytes / 4; ++i) {
        float value;
        std::memcpy(&value, shared_raw + src + 4 * i, 4);
        std::atomic_ref<float>(dst[i]).fetch_add(value);
    }
}
inline void bulk_commit() {}
template <int N>
inline void bulk_wait_read() {}
template <int N>
inline void bulk_wait() {}

}  // namespace fa
