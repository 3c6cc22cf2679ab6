// A warp's two products on mma.sync m16n8k16 over operands in shared memory (padded rows of
// RowStride elements, head_dim HeadDim), for MTiles m16 tiles of query rows at once:
//   warp_qk: S = Q K^T, Q's A fragments read per k16 step (ldmatrix), K key-major (ldmatrix);
//   warp_pv: O += P V, P in registers (the S accumulators packed to A fragments), V read
//            transposed (ldmatrix.trans), each V fragment used by every m tile.
// Lane offsets follow the PTX ISA's fragment layouts. The decode-style kernels (a warp scores
// its slice of a key tile for a few packed query rows) are built from these two.
#pragma once

#include "fa/fragment.cuh"
#include "fa/ptx.cuh"

namespace fa {

template <typename Elem, int MTiles, int NTiles, int HeadDim, int RowStride>
__device__ __forceinline__ void warp_qk(float (&s)[MTiles][NTiles][4], const Elem* s_q,
                                        const Elem* s_k, int lane) {
    const int a_row = lane % 16, a_col = (lane / 16) * 8;                  // A (Q)
    const int b_row = (lane / 16) * 8 + (lane % 8), b_col = ((lane / 8) % 2) * 8;  // B (K)
    fill_zero<MTiles * NTiles * 4>(&s[0][0][0]);
#pragma unroll
    for (int ds = 0; ds < HeadDim / 16; ++ds) {
        uint32_t a[MTiles][4];
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt)
            ldmatrix_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3],
                        smem_addr(s_q + (mt * 16 + a_row) * RowStride + ds * 16 + a_col));
#pragma unroll
        for (int np = 0; np < NTiles / 2; ++np) {
            uint32_t b0, b1, b2, b3;
            ldmatrix_x4(b0, b1, b2, b3,
                        smem_addr(s_k + (np * 16 + b_row) * RowStride + ds * 16 + b_col));
#pragma unroll
            for (int mt = 0; mt < MTiles; ++mt) {
                mma_16816<Elem>(s[mt][2 * np], a[mt], b0, b1);
                mma_16816<Elem>(s[mt][2 * np + 1], a[mt], b2, b3);
            }
        }
    }
}

template <typename Elem, int MTiles, int NTiles, int DTiles, int RowStride>
__device__ __forceinline__ void warp_pv(float (&o)[MTiles][DTiles][4],
                                        const float (&p)[MTiles][NTiles][4], const Elem* s_v,
                                        int lane) {
    const int v_row = ((lane / 8) % 2) * 8 + (lane % 8), v_col = (lane / 16) * 8;  // B (V^T)
#pragma unroll
    for (int ks = 0; ks < NTiles / 2; ++ks) {
        uint32_t p_frag[MTiles][4];
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt) pack_a_fragment<Elem>(&p[mt][2 * ks][0], p_frag[mt]);
#pragma unroll
        for (int dp = 0; dp < DTiles / 2; ++dp) {
            uint32_t b0, b1, b2, b3;
            ldmatrix_x4_trans(b0, b1, b2, b3,
                              smem_addr(s_v + (ks * 16 + v_row) * RowStride + dp * 16 + v_col));
#pragma unroll
            for (int mt = 0; mt < MTiles; ++mt) {
                mma_16816<Elem>(o[mt][2 * dp], p_frag[mt], b0, b1);
                mma_16816<Elem>(o[mt][2 * dp + 1], p_frag[mt], b2, b3);
            }
        }
    }
}

}  // namespace fa
