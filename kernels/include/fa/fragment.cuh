// The m16n8 accumulator fragment that mma.sync (m16n8k16, m16n8k8) and wgmma (a warp's 16
// rows of m64nN) share, and what the kernels do with it besides the math: a thread holds, of
// each n8 chunk c, registers 4 c + 2 half + j = row lane / 4 + 8 half, column 8 c + 2 (lane % 4) + j.
#pragma once

#include <stdint.h>

#include "fa/dtype.cuh"

namespace fa {

// N accumulator registers (an array of fragments, flattened) set to zero.
template <int N>
__device__ __forceinline__ void fill_zero(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = 0.f;
}

// The two rows (half 0 and half 1) of an m16 tile a thread holds, as absolute row indices.
struct FragmentRows {
    int row[2];
    __device__ __forceinline__ int operator[](int half) const { return row[half]; }
};

// Rows of a thread within its 16-row tile.
__device__ __forceinline__ int fragment_row(int lane, int half) { return lane / 4 + 8 * half; }
// The first of the two columns a thread holds in each n8 chunk.
__device__ __forceinline__ int fragment_column(int lane) { return 2 * (lane % 4); }

// P of one k16 step (chunks 2 j, 2 j + 1 of the scores, as 16-bit pairs) as the A operand of
// the next m16n8k16 (or register-A wgmma): the accumulator layout of two n8 chunks is the
// A fragment layout of one k16 step (PTX ISA fragment tables).
template <typename Elem>
__device__ __forceinline__ void pack_a_fragment(const float* p, uint32_t (&a)[4]) {
    a[0] = pack_pair<Elem>(p[0], p[1]);  // row g, k 0-7
    a[1] = pack_pair<Elem>(p[2], p[3]);  // row g + 8, k 0-7
    a[2] = pack_pair<Elem>(p[4], p[5]);  // row g, k 8-15
    a[3] = pack_pair<Elem>(p[6], p[7]);  // row g + 8, k 8-15
}

// One of a thread's rows of DChunks n8 chunks, times `scale`, to global memory: `row`
// points at the row's first element; each chunk stores the thread's two adjacent values
// (4 bytes of Elem pairs, or a float2).
template <int DChunks, typename Out>
__device__ __forceinline__ void store_fragment_row(Out* row, const float* o, int half, float scale,
                                                   int lane) {
    Out* dst = row + fragment_column(lane);
#pragma unroll
    for (int c = 0; c < DChunks; ++c)
        store_pair<Out>(dst + 8 * c, o[4 * c + 2 * half] * scale, o[4 * c + 2 * half + 1] * scale);
}

}  // namespace fa
