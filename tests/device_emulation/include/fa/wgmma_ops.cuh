// kernels/include/fa/wgmma_ops.cuh emulated on host threads: Wgmma<N, Elem>::ss, ss_bt and rs
// as the PTX ISA defines wgmma.mma_async m64nNk16 (f32 accumulators), operands read through
// the shared-memory matrix descriptors (start address, LBO, SBO, swizzle mode) in the
// canonical layouts:
//   K-major (A, or B stored N x K): element (row, k) at start + (row / 8) SBO
//     + (row % 8) S + 2 k, with S the swizzle span in bytes;
//   MN-major (B stored K x N, imm-trans-b = 1): element (k, n) at start + (n / (S / 2)) LBO
//     + (k / 8) SBO + (k % 8) S + 2 (n % (S / 2));
// then swizzled as an address: its 16-byte unit XOR (address / 128) modulo S / 16. A from
// registers (rs) is each warp's m16n8k16 A fragment of its 16 rows (exchanged across the
// warp). A thread's accumulator register i: row 16 warp + lane / 4 + 8 ((i % 4) / 2), column
// 8 (i / 4) + 2 (lane % 4) + i % 2.
//
// Asynchrony as the PTX ISA allows it at its latest: a product is queued when issued, its
// group closed by wgmma.commit_group, and the products of a group run (reading shared memory,
// the A registers and the accumulators then, and writing the accumulators) only at the
// wgmma.wait_group that retires it. A kernel that reads an accumulator, or writes an operand
// (registers or shared memory), before the wait that retires its product sees it here.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <vector>

#include "fa/hopper.cuh"

namespace fa {

struct EmulatedDescriptor {
    uint32_t start, leading, stride, span;

    explicit EmulatedDescriptor(uint64_t d)
        : start(static_cast<uint32_t>(d & 0x3FFF) << 4),
          leading(static_cast<uint32_t>((d >> 16) & 0x3FFF) << 4),
          stride(static_cast<uint32_t>((d >> 32) & 0x3FFF) << 4) {
        const int mode = static_cast<int>(d >> 62);
        if (mode == 0) {
            std::fprintf(stderr, "a wgmma descriptor without a swizzle (not emulated)\n");
            std::abort();
        }
        span = mode == 1 ? 128 : mode == 2 ? 64 : 32;
    }
    uint32_t swizzled(uint32_t address) const { return emulated_swizzle(address, span); }
    uint32_t k_major(int row, int k) const {
        return swizzled(start + (row / 8) * stride + (row % 8) * span + 2 * k);
    }
    uint32_t mn_major(int k, int n) const {
        const int per = static_cast<int>(span / 2);
        return swizzled(start + (n / per) * leading + (k / 8) * stride + (k % 8) * span +
                        2 * (n % per));
    }
};

template <typename Elem>
inline float shared_element(uint32_t address) {
    return half_value<Elem>(shared_half(address), 0);
}

// A product waiting for the wait that retires its group.
struct QueuedProduct {
    void (*run)(float*, const uint32_t*, uint64_t, uint64_t, bool, int);
    float* d;
    const uint32_t* a;
    uint64_t desc_a, desc_b;
    bool b_mn_major;
    int scale_d;
};
inline thread_local std::vector<QueuedProduct> open_products;                // not yet committed
inline thread_local std::deque<std::vector<QueuedProduct>> committed_groups;  // oldest first

template <int N, typename Elem>
struct Wgmma {
    static void ss(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
        open_products.push_back({&product, d, nullptr, desc_a, desc_b, false, scale_d});
    }
    static void ss_bt(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
        open_products.push_back({&product, d, nullptr, desc_a, desc_b, true, scale_d});
    }
    static void rs(float* d, const uint32_t* a, uint64_t desc_b, int scale_d) {
        open_products.push_back({&product, d, a, 0, desc_b, true, scale_d});
    }

   private:
    static void product(float* d, const uint32_t* a_registers, uint64_t desc_a, uint64_t desc_b,
                        bool b_mn_major, int scale_d) {
        const int warp = static_cast<int>(threadIdx.x % 128) / 32, lane = emu::lane_id();
        float A[16][16];  // this warp's 16 rows of A
        if (a_registers != nullptr) {
            emu::exchange(a_registers, 4, [&](const uint32_t (*words)[12]) {
                for (int l = 0; l < 32; ++l) {
                    const int g = l / 4, t = l % 4;
                    for (int j = 0; j < 2; ++j) {
                        A[g][2 * t + j] = half_value<Elem>(words[l][0], j);
                        A[g + 8][2 * t + j] = half_value<Elem>(words[l][1], j);
                        A[g][2 * t + 8 + j] = half_value<Elem>(words[l][2], j);
                        A[g + 8][2 * t + 8 + j] = half_value<Elem>(words[l][3], j);
                    }
                }
            });
        } else {
            const EmulatedDescriptor da(desc_a);
            for (int r = 0; r < 16; ++r)
                for (int k = 0; k < 16; ++k)
                    A[r][k] = shared_element<Elem>(da.k_major(16 * warp + r, k));
        }
        const EmulatedDescriptor db(desc_b);
        for (int i = 0; i < N / 2; ++i) {
            const int row = lane / 4 + 8 * ((i % 4) / 2);
            const int column = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
            float sum = scale_d ? d[i] : 0.f;
            for (int k = 0; k < 16; ++k) {
                const uint32_t at = b_mn_major ? db.mn_major(k, column) : db.k_major(column, k);
                sum += A[row][k] * shared_element<Elem>(at);
            }
            d[i] = sum;
        }
    }
};

// wgmma.commit_group closes the open products into a group; wgmma.wait_group N runs the
// oldest groups until at most N remain (the whole warpgroup retires the same groups in the
// same order, so a warp's register exchanges stay collective).
inline void wgmma_commit() {
    committed_groups.push_back(std::move(open_products));
    open_products.clear();
}
template <int N>
inline void wgmma_wait() {
    while (committed_groups.size() > static_cast<size_t>(N)) {
        for (const QueuedProduct& p : committed_groups.front())
            p.run(p.d, p.a, p.desc_a, p.desc_b, p.b_mn_major, p.scale_d);
        committed_groups.pop_front();
    }
}

}  // namespace fa
