// FlashAttention-2 forward on tensor cores for float32 inputs: TF32 mma.sync
// (m16n8k8, fp32 accumulate, sm_80+, run here on sm_90), one pass or three.
//
// PASSES = 3 is the "3xTF32" split (CUTLASS's OpMultiplyAddFastF32, what
// torch's float32 "efficient" SDPA runs): every operand x becomes
// hi = rna_tf32(x) and lo = rna_tf32(x - hi), and each product accumulates
// lo*hi + hi*lo first, then hi*hi (the small terms first, so they are not lost
// against the large one); lo*lo is below float32's rounding and is dropped.
// The error is float32-class (about 22 significand bits per operand).
// PASSES = 1 is one TF32 product hi*hi (10-bit significands): faster, and
// about 2^-11 relative error per operand.
//
// One block owns BLOCK_M query rows of one (batch, head); its WARPS warps own
// 16 or 32 rows each (M_TILES m16 tiles). K and V tiles of BLOCK_N keys stream
// through a STAGES-deep cp.async ring in shared memory; the online softmax
// runs in fp32 on exp2 with the 1/sqrt(d) * log2(e) scale folded in.
//
// Fragments (PTX ISA, mma.m16n8k8 .tf32; g = lane / 4, t = lane % 4):
//   A (16x8, row): a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)
//   B (8x8, col):  b0 (k=t, n=g), b1 (k=t+4, n=g)
//   C (16x8):      c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)
// ldmatrix (b16, 8x8) hands lane l the 4 bytes at row l/4, bytes 4*(l%4): for
// 32-bit data that is element (g, t) of an 8-row x 4-float block, so Q (row
// major) and K (key major, i.e. B column major) load with plain ldmatrix.x4.
// P = exp(S) sits in C layout (keys 2t, 2t+1) where the A operand wants keys
// t, t+4. The key index is summed over, so the kernel permutes keys instead of
// shuffling: A = (c0, c2, c1, c3) means "A column t is key 2t, column t+4 is
// key 2t+1", and V's B fragment takes the same keys: b0 = V[2t][g],
// b1 = V[2t+1][g], read by scalar loads (ldmatrix.trans is 16-bit only).
//
// Shared memory rows are HEAD_DIM + 4 floats: for HEAD_DIM a multiple of 8 the
// eight rows an ldmatrix phase reads start in eight distinct 16-byte bank
// groups, and the scalar V loads (rows 2t, columns g) hit 32 distinct banks.
//
// Layout contract with tuner/planner/families/mma_tf32.py:
//   dynamic shared bytes = 4 * (HEAD_DIM + 4) * (BLOCK_M + 2 * STAGES * BLOCK_N)
//   grid = (ceil(seq_len / BLOCK_M), splits, batch * heads), block = 32 * WARPS
//   keys_per_split is a multiple of BLOCK_N; split s covers keys
//   [s * keys_per_split, min(kv_len, (s + 1) * keys_per_split)).
//   q, out: [batch * heads][seq_len][HEAD_DIM]; k, v: [batch * kv_heads][kv_len][HEAD_DIM];
//   query head bh reads KV head bh / group (group = heads / kv_heads), sharing K/V
//   with the other heads of its group through L2 only.
// Causal masking is bottom-right aligned (query row r sees keys
// k <= r + kv_len - seq_len) with the heaviest row blocks scheduled first.
// With one split the kernel writes the normalised float32 output; with several
// it writes float32 partial outputs (normalised per split) and their
// log2-sum-exp, which mma_tf32_split_merge combines.

#include <stdint.h>

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_M
#define BLOCK_M 64
#endif
#ifndef BLOCK_N
#define BLOCK_N 64
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif
#ifndef PASSES
#define PASSES 3
#endif

#define THREADS (WARPS * 32)
#define ROWS_PER_WARP (BLOCK_M / WARPS)
#define M_TILES (ROWS_PER_WARP / 16)
#define N_TILES (BLOCK_N / 8)     // n8 tiles of S per m tile (= k8 steps of P V)
#define D_TILES (HEAD_DIM / 8)    // n8 tiles of O per m tile (= k8 steps of Q K^T)
#define ROW_STRIDE (HEAD_DIM + 4) // floats per shared-memory row
#define CHUNKS_PER_ROW (HEAD_DIM / 4)

static_assert(HEAD_DIM % 8 == 0, "HEAD_DIM must be a multiple of 8");
static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16");
static_assert(BLOCK_M % (16 * WARPS) == 0, "each warp owns whole m16 tiles");
static_assert(M_TILES >= 1 && M_TILES <= 2, "16 or 32 rows per warp");
static_assert(STAGES >= 2, "the ring needs two stages");
static_assert(PASSES == 1 || PASSES == 3, "one TF32 pass or the 3xTF32 split");

// ---------------------------------------------------------------- primitives

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                            uint32_t& r3, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// Round to TF32 (10 explicit significand bits), to nearest with ties away from
// zero: add half a TF32 ulp to the bit pattern, then clear the 13 low bits.
// This is cvt.rna.tf32.f32 without its inf/NaN guards, which cost ptxas four
// instructions a value (CUTLASS's round_half_ulp_truncate does the same); a
// finite input that rounds past the largest float becomes inf, as it should.
__device__ __forceinline__ uint32_t to_tf32(uint32_t bits) {
    return (bits + 0x1000u) & 0xffffe000u;
}

// One operand register as (hi, lo) TF32 parts; with one pass only hi exists.
struct Split {
    uint32_t hi;
#if PASSES == 3
    uint32_t lo;
#endif
};

__device__ __forceinline__ Split split(uint32_t bits) {
    Split s;
    s.hi = to_tf32(bits);
#if PASSES == 3
    // x - hi is exact in float32 (Sterbenz); its own rounding keeps 11 more bits.
    s.lo = to_tf32(__float_as_uint(__uint_as_float(bits) - __uint_as_float(s.hi)));
#endif
    return s;
}

__device__ __forceinline__ void mma_1688(float* d, uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D += A B with A, B split: lo*hi + hi*lo, then hi*hi (or hi*hi alone).
__device__ __forceinline__ void mma_split(float* d, const Split* a, Split b0, Split b1) {
#if PASSES == 3
    mma_1688(d, a[0].lo, a[1].lo, a[2].lo, a[3].lo, b0.hi, b1.hi);
    mma_1688(d, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.lo, b1.lo);
#endif
    mma_1688(d, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.hi, b1.hi);
}

// The small products alone (lo*hi + hi*lo) and the large one alone, for
// accumulators kept apart (see S = Q K^T).
__device__ __forceinline__ void mma_small(float* d, const Split* a, Split b0, Split b1) {
#if PASSES == 3
    mma_1688(d, a[0].lo, a[1].lo, a[2].lo, a[3].lo, b0.hi, b1.hi);
    mma_1688(d, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.lo, b1.lo);
#endif
}
__device__ __forceinline__ void mma_big(float* d, const Split* a, Split b0, Split b1) {
    mma_1688(d, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.hi, b1.hi);
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// A [ROWS x HEAD_DIM] float tile global -> shared by cp.async, 16 bytes a
// thread per pass; rows at or past valid_rows are zero-filled.
template <int ROWS, bool CHECK_ROWS>
__device__ __forceinline__ void load_tile_async(float* smem, const float* gmem, int valid_rows,
                                                int tid) {
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS_PER_ROW;
    if constexpr (ROWS_PER_PASS >= 1 && THREADS % CHUNKS_PER_ROW == 0) {
        const int row = tid / CHUNKS_PER_ROW;
        const int col = (tid % CHUNKS_PER_ROW) * 4;
        const uint32_t dst = smem_addr(smem + row * ROW_STRIDE + col);
        const float* src = gmem + row * HEAD_DIM + col;
#pragma unroll
        for (int pass = 0; pass < (ROWS + ROWS_PER_PASS - 1) / ROWS_PER_PASS; ++pass) {
            const int r = row + pass * ROWS_PER_PASS;
            if (ROWS % ROWS_PER_PASS != 0 && r >= ROWS) break;
            const bool valid = !CHECK_ROWS || r < valid_rows;
            cp_async_16(dst + pass * ROWS_PER_PASS * ROW_STRIDE * 4, valid ? src : gmem,
                        valid ? 16 : 0);
            // An opaque step keeps the compiler from hoisting one 64-bit address per pass.
            src += ROWS_PER_PASS * HEAD_DIM;
            asm volatile("" : "+l"(src));
        }
    } else {
        for (int c = tid; c < ROWS * CHUNKS_PER_ROW; c += THREADS) {
            const int r = c / CHUNKS_PER_ROW;
            const int col = (c % CHUNKS_PER_ROW) * 4;
            const bool valid = !CHECK_ROWS || r < valid_rows;
            cp_async_16(smem_addr(smem + r * ROW_STRIDE + col),
                        valid ? gmem + r * HEAD_DIM + col : gmem, valid ? 16 : 0);
        }
    }
}

__device__ __forceinline__ void load_kv_async(float* s_kv, const float* k_bh, const float* v_bh,
                                              int key0, int kv_len, int slot, int tid) {
    float* s_k = s_kv + (2 * slot) * BLOCK_N * ROW_STRIDE;
    const size_t offset = (size_t)key0 * HEAD_DIM;
    if (key0 + BLOCK_N <= kv_len) {
        load_tile_async<BLOCK_N, false>(s_k, k_bh + offset, BLOCK_N, tid);
        load_tile_async<BLOCK_N, false>(s_k + BLOCK_N * ROW_STRIDE, v_bh + offset, BLOCK_N, tid);
    } else {
        load_tile_async<BLOCK_N, true>(s_k, k_bh + offset, kv_len - key0, tid);
        load_tile_async<BLOCK_N, true>(s_k + BLOCK_N * ROW_STRIDE, v_bh + offset,
                                       kv_len - key0, tid);
    }
}

// ---------------------------------------------------------------- attention

extern "C" __global__ void __launch_bounds__(THREADS, 1)
mma_tf32_attention(const float* __restrict__ q, const float* __restrict__ k,
                   const float* __restrict__ v, float* __restrict__ out,
                   float* __restrict__ partial_o, float* __restrict__ partial_lse, int seq_len,
                   int kv_len, int group, int keys_per_split, float scale_log2) {
    extern __shared__ __align__(128) unsigned char shared_raw[];
    float* s_q = reinterpret_cast<float*>(shared_raw);
    float* s_kv = s_q + BLOCK_M * ROW_STRIDE;  // STAGES x (K tile, V tile)

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    int m_block = blockIdx.x;
    int bh = blockIdx.z;
    if (CAUSAL) {
        // Heaviest row blocks first, across every (batch, head).
        const int linear = blockIdx.z * gridDim.x + blockIdx.x;
        m_block = gridDim.x - 1 - linear / gridDim.z;
        bh = linear % gridDim.z;
    }
    const int split_index = blockIdx.y;
    const int splits = gridDim.y;
    const int row0 = m_block * BLOCK_M;

    const float* q_bh = q + (size_t)bh * seq_len * HEAD_DIM;
    // Query head bh reads KV head bh / group (grouped-query attention).
    const float* k_bh = k + (size_t)(bh / group) * kv_len * HEAD_DIM;
    const float* v_bh = v + (size_t)(bh / group) * kv_len * HEAD_DIM;

    const int causal_offset = kv_len - seq_len;
    const int key_begin = split_index * keys_per_split;
    int key_end = min(kv_len, key_begin + keys_per_split);
    if (CAUSAL) key_end = min(key_end, row0 + BLOCK_M + causal_offset);
    const int n_tiles = key_end > key_begin ? (key_end - key_begin + BLOCK_N - 1) / BLOCK_N : 0;

    load_tile_async<BLOCK_M, true>(s_q, q_bh + (size_t)row0 * HEAD_DIM, seq_len - row0, tid);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_tiles) load_kv_async(s_kv, k_bh, v_bh, key_begin + s * BLOCK_N, kv_len, s, tid);
        cp_async_commit();
    }

    // ldmatrix row addresses: lanes 8i..8i+7 address matrix i.
    const int a_row = (lane % 8) + ((lane / 8) % 2) * 8;  // Q: a0 a1 a2 a3
    const int a_col = (lane / 16) * 4;
    const int b_row = (lane % 8) + (lane / 16) * 8;       // K: (b0 b1) of two n8 tiles
    const int b_col = ((lane / 8) % 2) * 4;

    cp_async_wait<STAGES - 1>();
    __syncthreads();
    const float* s_q_warp = s_q + warp * ROWS_PER_WARP * ROW_STRIDE;

    float o_acc[M_TILES][D_TILES][4];
    float row_max[M_TILES][2];
    float row_sum[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
            for (int i = 0; i < 4; ++i) o_acc[mt][dt][i] = 0.f;
        row_max[mt][0] = row_max[mt][1] = -INFINITY;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }
    const int warp_row0 = row0 + warp * ROWS_PER_WARP;

    for (int tile = 0; tile < n_tiles; ++tile) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            const int next = tile + STAGES - 1;
            if (next < n_tiles)
                load_kv_async(s_kv, k_bh, v_bh, key_begin + next * BLOCK_N, kv_len, next % STAGES,
                              tid);
            cp_async_commit();
        }
        const float* s_k = s_kv + (2 * (tile % STAGES)) * BLOCK_N * ROW_STRIDE;
        const float* s_v = s_k + BLOCK_N * ROW_STRIDE;
        const int key0 = key_begin + tile * BLOCK_N;

        if (CAUSAL && key0 > warp_row0 + ROWS_PER_WARP - 1 + causal_offset) continue;

        // ---- S = Q K^T, k8 steps over the head dimension. The tensor cores add
        // into an fp32 accumulator by truncation (not round to nearest), so every
        // mma on a large accumulator loses up to an ulp of it, always toward zero.
        // With three passes the small products go to an accumulator of their own
        // (2^-11 of S's size: its truncation is negligible) and only the hi*hi
        // products touch S's: a third of the truncations on the large value.
        float s_acc[M_TILES][N_TILES][4];
#if PASSES == 3
        float s_small[M_TILES][N_TILES][4];
#endif
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    s_acc[mt][nt][i] = 0.f;
#if PASSES == 3
                    s_small[mt][nt][i] = 0.f;
#endif
                }
#pragma unroll
        for (int ds = 0; ds < D_TILES; ++ds) {
            Split a[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                uint32_t r[4];
                ldmatrix_x4(r[0], r[1], r[2], r[3],
                            smem_addr(s_q_warp + (mt * 16 + a_row) * ROW_STRIDE + ds * 8 + a_col));
#pragma unroll
                for (int i = 0; i < 4; ++i) a[mt][i] = split(r[i]);
            }
#pragma unroll
            for (int np = 0; np < N_TILES / 2; ++np) {
                uint32_t r[4];
                ldmatrix_x4(r[0], r[1], r[2], r[3],
                            smem_addr(s_k + (np * 16 + b_row) * ROW_STRIDE + ds * 8 + b_col));
                const Split b0 = split(r[0]), b1 = split(r[1]), b2 = split(r[2]),
                            b3 = split(r[3]);
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
#if PASSES == 3
                    mma_small(s_small[mt][2 * np], a[mt], b0, b1);
                    mma_small(s_small[mt][2 * np + 1], a[mt], b2, b3);
#endif
                    mma_big(s_acc[mt][2 * np], a[mt], b0, b1);
                    mma_big(s_acc[mt][2 * np + 1], a[mt], b2, b3);
                }
            }
        }
#if PASSES == 3
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) s_acc[mt][nt][i] += s_small[mt][nt][i];
#endif

        // ---- mask: keys past kv_len and, under causal, past the diagonal
        const bool tail = key0 + BLOCK_N > kv_len;
        const bool diagonal = CAUSAL && (key0 + BLOCK_N - 1 > warp_row0 + causal_offset);
        if (tail || diagonal) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int key = key0 + nt * 8 + 2 * t + (i % 2);
                        const int row = warp_row0 + mt * 16 + g + (i / 2) * 8;
                        bool masked = key >= kv_len;
                        if (CAUSAL) masked = masked || key > row + causal_offset;
                        if (masked) s_acc[mt][nt][i] = -INFINITY;
                    }
        }

        // ---- online softmax and O += P V, one m16 tile at a time
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            float corrections[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float tile_max = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
                    tile_max = fmaxf(tile_max,
                                     fmaxf(s_acc[mt][nt][2 * half], s_acc[mt][nt][2 * half + 1]));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 2));
                const float new_max = fmaxf(row_max[mt][half], tile_max * scale_log2);
                const float base = new_max == -INFINITY ? 0.f : new_max;
                const float correction = fast_exp2(row_max[mt][half] - base);
                row_max[mt][half] = new_max;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt) {
                    const float p0 = fast_exp2(s_acc[mt][nt][2 * half] * scale_log2 - base);
                    const float p1 = fast_exp2(s_acc[mt][nt][2 * half + 1] * scale_log2 - base);
                    s_acc[mt][nt][2 * half] = p0;
                    s_acc[mt][nt][2 * half + 1] = p1;
                    sum += p0 + p1;
                }
                row_sum[mt][half] = row_sum[mt][half] * correction + sum;
                corrections[half] = correction;
            }
            // A column t is key 2t, column t + 4 is key 2t + 1 (see the head comment).
            const float* v_rows = s_v + 2 * t * ROW_STRIDE + g;
#if PASSES == 3
            // P V of this tile into a fresh accumulator per n8 tile of O, folded into
            // O by an FFMA (round to nearest) with the rescale: the tensor cores'
            // truncating adds then see one tile's keys, never the whole key range
            // (over thousands of keys their bias toward zero grew past float32's
            // error: 8.6e-6 at 32768 keys against torch's 6.7e-8 on the H200).
            Split p[N_TILES][4];
#pragma unroll
            for (int ks = 0; ks < N_TILES; ++ks) {
                p[ks][0] = split(__float_as_uint(s_acc[mt][ks][0]));
                p[ks][1] = split(__float_as_uint(s_acc[mt][ks][2]));
                p[ks][2] = split(__float_as_uint(s_acc[mt][ks][1]));
                p[ks][3] = split(__float_as_uint(s_acc[mt][ks][3]));
            }
#pragma unroll
            for (int dt = 0; dt < D_TILES; ++dt) {
                float tile_o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int ks = 0; ks < N_TILES; ++ks) {
                    const Split b0 = split(__float_as_uint(v_rows[ks * 8 * ROW_STRIDE + dt * 8]));
                    const Split b1 =
                        split(__float_as_uint(v_rows[(ks * 8 + 1) * ROW_STRIDE + dt * 8]));
                    mma_split(tile_o, p[ks], b0, b1);
                }
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    o_acc[mt][dt][i] = fmaf(o_acc[mt][dt][i], corrections[i / 2], tile_o[i]);
            }
#else
            // One pass: TF32's own rounding (2^-11) dwarfs the truncation bias, so O
            // accumulates in place, every n8 tile of O an independent mma chain.
#pragma unroll
            for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
                for (int i = 0; i < 4; ++i) o_acc[mt][dt][i] *= corrections[i / 2];
#pragma unroll
            for (int ks = 0; ks < N_TILES; ++ks) {
                Split p[4];
                p[0] = split(__float_as_uint(s_acc[mt][ks][0]));
                p[1] = split(__float_as_uint(s_acc[mt][ks][2]));
                p[2] = split(__float_as_uint(s_acc[mt][ks][1]));
                p[3] = split(__float_as_uint(s_acc[mt][ks][3]));
#pragma unroll
                for (int dt = 0; dt < D_TILES; ++dt) {
                    const Split b0 = split(__float_as_uint(v_rows[ks * 8 * ROW_STRIDE + dt * 8]));
                    const Split b1 =
                        split(__float_as_uint(v_rows[(ks * 8 + 1) * ROW_STRIDE + dt * 8]));
                    mma_split(o_acc[mt][dt], p, b0, b1);
                }
            }
#endif
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float s = row_sum[mt][half];
            s += __shfl_xor_sync(0xffffffff, s, 1);
            s += __shfl_xor_sync(0xffffffff, s, 2);
            row_sum[mt][half] = s;
        }

    // One split: the normalised output. Several: float32 partial outputs
    // (normalised by this split's sum) and the split's log2-sum-exp (-inf where
    // the split saw no key of the row). A quad writes 32 contiguous bytes a row.
    const bool partial = splits > 1;
    const size_t part_row0 = ((size_t)bh * splits + split_index) * seq_len;
    float* out_bh = out + (size_t)bh * seq_len * HEAD_DIM;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp_row0 + mt * 16 + g + half * 8;
            if (row >= seq_len) continue;
            const float l = row_sum[mt][half];
            const float inv = l > 0.f ? 1.f / l : 0.f;
            float* dst = (partial ? partial_o + (part_row0 + row) * HEAD_DIM
                                  : out_bh + (size_t)row * HEAD_DIM) +
                         2 * t;
#pragma unroll
            for (int dt = 0; dt < D_TILES; ++dt)
                *reinterpret_cast<float2*>(dst + dt * 8) =
                    make_float2(o_acc[mt][dt][2 * half] * inv, o_acc[mt][dt][2 * half + 1] * inv);
            if (partial && t == 0)
                partial_lse[part_row0 + row] =
                    l > 0.f ? row_max[mt][half] + __log2f(l) : -INFINITY;
        }
}

// ---------------------------------------------------------------- split merge

// out[row] = sum_s 2^(lse_s - lse) * partial_o[s][row] / sum_s 2^(lse_s - lse).
// One thread per 4 output elements; 128 threads per block.
extern "C" __global__ void __launch_bounds__(128)
mma_tf32_split_merge(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
                     float* __restrict__ out, int seq_len, int splits, int total_rows) {
    constexpr int VECS_PER_ROW = HEAD_DIM / 4;
    const long long vec = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec >= (long long)total_rows * VECS_PER_ROW) return;
    const int global_row = (int)(vec / VECS_PER_ROW);
    const int col = (int)(vec % VECS_PER_ROW) * 4;
    const int bh = global_row / seq_len;
    const int row = global_row % seq_len;
    const size_t base = (size_t)bh * splits * seq_len + row;

    float lse_max = -INFINITY;
    for (int s = 0; s < splits; ++s)
        lse_max = fmaxf(lse_max, partial_lse[base + (size_t)s * seq_len]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float weight_sum = 0.f;
    if (lse_max != -INFINITY) {
        for (int s = 0; s < splits; ++s) {
            const size_t r = base + (size_t)s * seq_len;
            const float w = fast_exp2(partial_lse[r] - lse_max);
            const float4 o = *reinterpret_cast<const float4*>(partial_o + r * HEAD_DIM + col);
            acc.x += w * o.x;
            acc.y += w * o.y;
            acc.z += w * o.z;
            acc.w += w * o.w;
            weight_sum += w;
        }
    }
    const float inv = weight_sum > 0.f ? 1.f / weight_sum : 0.f;
    *reinterpret_cast<float4*>(out + (size_t)global_row * HEAD_DIM + col) =
        make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
}
