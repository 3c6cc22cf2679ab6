// kernels/include/fa/ptx.cuh emulated on host threads (../../emulator.hpp): the same functions,
// each doing what the PTX ISA says its instruction does, so the kernels that include the
// real header compile against this one unchanged. Warp-synchronous instructions exchange
// their operands across the warp's 32 threads.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "emulator.hpp"

namespace fa {

inline uint32_t smem_addr(const void* p) {
    const auto offset = static_cast<const unsigned char*>(p) - shared_raw;
    if (offset < 0 || offset >= static_cast<std::ptrdiff_t>(emu::kSharedBytes)) {
        std::fprintf(stderr, "smem_addr of a pointer outside shared memory\n");
        std::abort();
    }
    return static_cast<uint32_t>(offset);
}

template <typename T>
inline void opaque(const T*&) {}
inline void opaque(int&) {}

// ---------------------------------------------------------------- cp.async: copies land at once

inline void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
    if (dst % 16 || reinterpret_cast<uintptr_t>(src) % 16 || dst + 16 > emu::kSharedBytes) {
        std::fprintf(stderr, "cp.async of 16 bytes to %u from %p: misaligned or out of range\n",
                     dst, src);
        std::abort();
    }
    std::memset(shared_raw + dst, 0, 16);
    std::memcpy(shared_raw + dst, src, src_bytes);
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}

// ---------------------------------------------------------------- shared stores and loads

inline void check_shared(uint32_t addr, uint32_t bytes, const char* what) {
    if (addr % bytes || addr + bytes > emu::kSharedBytes) {
        std::fprintf(stderr, "%s at shared byte %u: misaligned or out of range\n", what, addr);
        std::abort();
    }
}
inline void st_shared_u32(uint32_t addr, uint32_t value) {
    check_shared(addr, 4, "st.shared.u32");
    std::memcpy(shared_raw + addr, &value, 4);
}
inline uint4 ld_shared_v4(uint32_t addr) {
    check_shared(addr, 16, "ld.shared.v4.u32");
    uint4 value;
    std::memcpy(&value, shared_raw + addr, 16);
    return value;
}

inline void st_shared_v4_f32(uint32_t addr, float a, float b, float c, float d) {
    check_shared(addr, 16, "st.shared.v4.f32");
    const float values[4] = {a, b, c, d};
    std::memcpy(shared_raw + addr, values, 16);
}

// ---------------------------------------------------------------- ldmatrix

// A 16-bit element of shared memory (ldmatrix's rows, wgmma's operands).
inline uint16_t shared_half(uint32_t address) {
    check_shared(address, 2, "a 16-bit shared read");
    uint16_t value;
    std::memcpy(&value, shared_raw + address, 2);
    return value;
}

// Four 8x8 b16 matrices, row r of matrix i at the address lane 8 i + r gives (16-byte rows).
// Plain: lane l receives row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of each matrix.
// .trans: lane l receives column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1 (the transposed
// matrix's fragment).
inline void ldmatrix(uint32_t (&r)[4], uint32_t address, bool transposed) {
    emu::exchange(&address, 1, [&](const uint32_t (*words)[12]) {
        const int lane = emu::lane_id();
        for (int i = 0; i < 4; ++i) {
            uint16_t lo, hi;
            if (!transposed) {
                const uint32_t row = words[8 * i + lane / 4][0];
                if (row % 16) {
                    std::fprintf(stderr, "ldmatrix row address %u is not 16-byte aligned\n", row);
                    std::abort();
                }
                lo = shared_half(row + 4 * (lane % 4));
                hi = shared_half(row + 4 * (lane % 4) + 2);
            } else {
                lo = shared_half(words[8 * i + 2 * (lane % 4)][0] + 2 * (lane / 4));
                hi = shared_half(words[8 * i + 2 * (lane % 4) + 1][0] + 2 * (lane / 4));
            }
            r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
        }
    });
}

inline void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr) {
    uint32_t r[4];
    ldmatrix(r, addr, false);
    r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
inline void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                              uint32_t addr) {
    uint32_t r[4];
    ldmatrix(r, addr, true);
    r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}

// ---------------------------------------------------------------- mma.sync m16n8k16

template <typename Elem>
inline float half_value(uint32_t word, int which) {
    const uint16_t bits = static_cast<uint16_t>(which ? word >> 16 : word & 0xFFFF);
    Elem value;
    std::memcpy(&value, &bits, 2);
    return static_cast<float>(value);
}

// D = A (16x16) B (16x8) + D with the PTX ISA's fragments (g = lane / 4, t = lane % 4):
// a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..);
// b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g); d0,d1 (g, 2t..2t+1), d2,d3 (g+8, 2t..).
template <typename Elem>
inline void mma_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
    float A[16][16], B[16][8];
    emu::exchange(mine, 6, [&](const uint32_t (*words)[12]) {
        for (int lane = 0; lane < 32; ++lane) {
            const int g = lane / 4, t = lane % 4;
            for (int j = 0; j < 2; ++j) {
                A[g][2 * t + j] = half_value<Elem>(words[lane][0], j);
                A[g + 8][2 * t + j] = half_value<Elem>(words[lane][1], j);
                A[g][2 * t + 8 + j] = half_value<Elem>(words[lane][2], j);
                A[g + 8][2 * t + 8 + j] = half_value<Elem>(words[lane][3], j);
                B[2 * t + j][g] = half_value<Elem>(words[lane][4], j);
                B[2 * t + 8 + j][g] = half_value<Elem>(words[lane][5], j);
            }
        }
    });
    const int g = emu::lane_id() / 4, t = emu::lane_id() % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
        float sum = d[i];
        for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
        d[i] = sum;
    }
}

// ---------------------------------------------------------------- SFU math

inline float fast_exp2(float x) { return std::exp2(x); }
inline float fast_tanh(float x) { return std::tanh(x); }

// ---------------------------------------------------------------- global reductions

inline void red_add_f32x2(float* dst, float a, float b) {
    if (reinterpret_cast<uintptr_t>(dst) % 8) {
        std::fprintf(stderr, "red.global.add.v2.f32 to a misaligned address\n");
        std::abort();
    }
    std::atomic_ref<float>(dst[0]).fetch_add(a);
    std::atomic_ref<float>(dst[1]).fetch_add(b);
}

inline int load_acquire(const int* flag) {
    // A wait that never ends is a deadlock on the GPU: here, a failure with a message.
    static thread_local long spins = 0;
    if (++spins > (1L << 28)) {
        std::fprintf(stderr, "a flag never reached its value (deadlock)\n");
        std::abort();
    }
    return std::atomic_ref<int>(*const_cast<int*>(flag)).load(std::memory_order_acquire);
}
inline void red_release_add(int* flag, int value) {
    std::atomic_ref<int>(*flag).fetch_add(value, std::memory_order_release);
}

// ---------------------------------------------------------------- quad reductions

inline float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
inline float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}

}  // namespace fa
