// FlashAttention-2 forward on tensor cores: bf16/fp16 in, fp32 accumulate,
// mma.sync.aligned.m16n8k16 (sm_80+, run here on sm_90).
//
// One block owns BLOCK_M query rows of one (batch, head); its WARPS warps own
// BLOCK_M / WARPS rows each (ROWS_PER_WARP = 16 or 32, i.e. M_TILES m16 tiles).
// K and V tiles of BLOCK_N keys stream through a STAGES-deep cp.async ring in
// shared memory; S = Q K^T and O += P V are warp-local mma.sync products, P
// never leaves registers (the S accumulator layout of m16n8 is the A-operand
// layout of the next m16n8k16 once packed to 16-bit pairs), and the online
// softmax runs in fp32 with the 1/sqrt(d) * log2(e) scale folded into exp2.
//
// Shared memory rows are HEAD_DIM + 8 elements long: the 16-byte pad puts the
// eight rows an ldmatrix phase reads in eight distinct 16-byte bank groups,
// for every HEAD_DIM that is a multiple of 16 (64, 96, 128, 256), which an
// XOR swizzle on 128-byte rows cannot do for HEAD_DIM = 96.
//
// Layout contract with tuner/planner/families/mma_f16.py:
//   dynamic shared bytes = 2 * (HEAD_DIM + 8) * (BLOCK_M + 2 * STAGES * BLOCK_N)
//   grid = (ceil(seq_len / BLOCK_M), splits, batch * heads), block = 32 * WARPS
//   keys_per_split is a multiple of BLOCK_N; split s covers keys
//   [s * keys_per_split, min(kv_len, (s + 1) * keys_per_split)).
//   q, out: [batch * heads][seq_len][HEAD_DIM]; k, v: [batch * kv_heads][kv_len][HEAD_DIM];
//   query head bh reads KV head bh / group (group = heads / kv_heads: grouped-query
//   attention). Each block loads its own KV head's tiles: the query heads of a group
//   share K and V through L2 only (their blocks run close together in launch order).
// Causal masking is bottom-right aligned: query row r sees keys
// k <= r + (kv_len - seq_len), as FlashAttention does for a KV cache.
// With one split the kernel writes the normalised output in the input dtype;
// with several it writes float32 partial outputs (normalised per split) and
// their log2-sum-exp, which mma_f16_split_merge combines.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_M
#define BLOCK_M 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 64
#endif
#ifndef WARPS
#define WARPS 8
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif
#ifndef IS_FP16
#define IS_FP16 0
#endif
#ifndef Q_IN_REGISTERS
#define Q_IN_REGISTERS 1
#endif
#ifndef S_GROUPS
#define S_GROUPS 1
#endif

#define THREADS (WARPS * 32)
#define ROWS_PER_WARP (BLOCK_M / WARPS)
#define M_TILES (ROWS_PER_WARP / 16)
#define N_TILES (BLOCK_N / 8)     // n8 tiles of S per m tile
#define D_TILES (HEAD_DIM / 8)    // n8 tiles of O per m tile
#define D_STEPS (HEAD_DIM / 16)   // k16 steps of Q K^T
#define N_STEPS (BLOCK_N / 16)    // k16 steps of P V
#define ROW_STRIDE (HEAD_DIM + 8) // elements per shared-memory row
#define CHUNKS_PER_ROW (HEAD_DIM / 8)
#define MT_PER_GROUP (M_TILES / S_GROUPS)

static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");
static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16");
static_assert(BLOCK_M % (16 * WARPS) == 0, "each warp owns whole m16 tiles");
static_assert(M_TILES >= 1 && M_TILES <= 2, "16 or 32 rows per warp");
static_assert(STAGES >= 2, "the ring needs two stages");
static_assert(S_GROUPS >= 1 && M_TILES % S_GROUPS == 0, "S groups split the m tiles evenly");

#if IS_FP16
typedef __half elem_t;
#define MMA_TYPE "f16"
#else
typedef __nv_bfloat16 elem_t;
#define MMA_TYPE "bf16"
#endif

// ---------------------------------------------------------------- primitives

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; src_bytes = 0 zero-fills (rows past the end).
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
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// D = A(16x16, row) * B(16x8, col) + D, fp32 accumulators.
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
#if IS_FP16
    __half2 h = __floats2half2_rn(lo, hi);
#else
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
#endif
    return *reinterpret_cast<uint32_t*>(&h);
}

// A [ROWS x HEAD_DIM] tile global -> shared by cp.async, 16 bytes a thread per
// pass: a thread keeps one column chunk and steps down the rows, so the
// addresses are one base plus compile-time offsets. Rows at or past valid_rows
// are zero-filled (CHECK_ROWS: only the last tile of a sequence needs it).
template <int ROWS, bool CHECK_ROWS>
__device__ __forceinline__ void load_tile_async(elem_t* smem, const elem_t* gmem,
                                                int valid_rows, int tid) {
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS_PER_ROW;
    if constexpr (ROWS_PER_PASS >= 1 && THREADS % CHUNKS_PER_ROW == 0) {
        const int row = tid / CHUNKS_PER_ROW;
        const int col = (tid % CHUNKS_PER_ROW) * 8;
        const uint32_t dst = smem_addr(smem + row * ROW_STRIDE + col);
        const elem_t* src = gmem + row * HEAD_DIM + col;
#pragma unroll
        for (int pass = 0; pass < (ROWS + ROWS_PER_PASS - 1) / ROWS_PER_PASS; ++pass) {
            const int r = row + pass * ROWS_PER_PASS;
            if (ROWS % ROWS_PER_PASS != 0 && r >= ROWS) break;
            const bool valid = !CHECK_ROWS || r < valid_rows;
            cp_async_16(dst + pass * ROWS_PER_PASS * ROW_STRIDE * (int)sizeof(elem_t),
                        valid ? src : gmem, valid ? 16 : 0);
            // Step the pointer through an opaque register: otherwise the compiler
            // hoists one 64-bit address per pass out of the key loop and spills them.
            src += ROWS_PER_PASS * HEAD_DIM;
            asm volatile("" : "+l"(src));
        }
    } else {
        // HEAD_DIM / 8 does not divide the block (e.g. 96 with 128 threads).
        for (int c = tid; c < ROWS * CHUNKS_PER_ROW; c += THREADS) {
            const int r = c / CHUNKS_PER_ROW;
            const int col = (c % CHUNKS_PER_ROW) * 8;
            const bool valid = !CHECK_ROWS || r < valid_rows;
            cp_async_16(smem_addr(smem + r * ROW_STRIDE + col),
                        valid ? gmem + r * HEAD_DIM + col : gmem, valid ? 16 : 0);
        }
    }
}

// The K and V tiles starting at key0 into ring slot `slot` (one commit group is the caller's).
__device__ __forceinline__ void load_kv_async(elem_t* s_kv, const elem_t* k_bh,
                                              const elem_t* v_bh, int key0, int kv_len,
                                              int slot, int tid) {
    elem_t* s_k = s_kv + (2 * slot) * BLOCK_N * ROW_STRIDE;
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
mma_f16_attention(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                  const elem_t* __restrict__ v, elem_t* __restrict__ out,
                  float* __restrict__ partial_o, float* __restrict__ partial_lse, int seq_len,
                  int kv_len, int group, int keys_per_split, float scale_log2) {
    extern __shared__ __align__(128) unsigned char shared_raw[];
    elem_t* s_q = reinterpret_cast<elem_t*>(shared_raw);
    elem_t* s_kv = s_q + BLOCK_M * ROW_STRIDE;  // STAGES x (K tile, V tile)

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    // Under causal masking the row blocks near the end of the sequence carry
    // the most keys: hand them out first, across every (batch, head), so the
    // last wave holds the light blocks (blockIdx.x varies fastest in launch order).
    int m_block = blockIdx.x;
    int bh = blockIdx.z;
    if (CAUSAL) {
        const int linear = blockIdx.z * gridDim.x + blockIdx.x;
        m_block = gridDim.x - 1 - linear / gridDim.z;
        bh = linear % gridDim.z;
    }
    const int split = blockIdx.y;
    const int splits = gridDim.y;
    const int row0 = m_block * BLOCK_M;

    const elem_t* q_bh = q + (size_t)bh * seq_len * HEAD_DIM;
    const elem_t* k_bh = k + (size_t)(bh / group) * kv_len * HEAD_DIM;
    const elem_t* v_bh = v + (size_t)(bh / group) * kv_len * HEAD_DIM;

    // This block's key range: its split, cut by the causal diagonal.
    const int causal_offset = kv_len - seq_len;
    const int key_begin = split * keys_per_split;
    int key_end = min(kv_len, key_begin + keys_per_split);
    if (CAUSAL) key_end = min(key_end, row0 + BLOCK_M + causal_offset);
    const int n_tiles = key_end > key_begin ? (key_end - key_begin + BLOCK_N - 1) / BLOCK_N : 0;

    load_tile_async<BLOCK_M, true>(s_q, q_bh + (size_t)row0 * HEAD_DIM, seq_len - row0, tid);
    cp_async_commit();
    // Prologue: the first STAGES - 1 tiles of K and V, one commit group each.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_tiles) load_kv_async(s_kv, k_bh, v_bh, key_begin + s * BLOCK_N, kv_len, s, tid);
        cp_async_commit();
    }

    // Per-lane ldmatrix row/column offsets (see the PTX ISA's fragment layouts).
    const int a_row = lane % 16;          // A (Q): 16 rows, two k8 halves
    const int a_col = (lane / 16) * 8;
    const int b_row = (lane / 16) * 8 + (lane % 8);  // B (K): two n8 tiles, two k8 halves
    const int b_col = ((lane / 8) % 2) * 8;
    const int v_row = ((lane / 8) % 2) * 8 + (lane % 8);  // B (V, transposed): two k8, two n8
    const int v_col = (lane / 16) * 8;

    // Wait for Q (the oldest group) and bring the warp's rows to registers.
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    const elem_t* s_q_warp = s_q + warp * ROWS_PER_WARP * ROW_STRIDE;
#if Q_IN_REGISTERS
    uint32_t q_frag[M_TILES][D_STEPS][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int ds = 0; ds < D_STEPS; ++ds)
            ldmatrix_x4(q_frag[mt][ds][0], q_frag[mt][ds][1], q_frag[mt][ds][2],
                        q_frag[mt][ds][3],
                        smem_addr(s_q_warp + (mt * 16 + a_row) * ROW_STRIDE + ds * 16 + a_col));
#endif

    float o_acc[M_TILES][D_TILES][4];
    float row_max[M_TILES][2];  // scaled (log2 domain) running max of rows lane/4, lane/4 + 8
    float row_sum[M_TILES][2];  // this thread's share of the running sum
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

    for (int t = 0; t < n_tiles; ++t) {
        // Tile t has landed for this thread; the barrier makes it everyone's and
        // frees the slot of tile t - 1 for the load of tile t + STAGES - 1.
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            const int next = t + STAGES - 1;
            if (next < n_tiles)
                load_kv_async(s_kv, k_bh, v_bh, key_begin + next * BLOCK_N, kv_len, next % STAGES,
                              tid);
            cp_async_commit();
        }
        const elem_t* s_k = s_kv + (2 * (t % STAGES)) * BLOCK_N * ROW_STRIDE;
        const elem_t* s_v = s_k + BLOCK_N * ROW_STRIDE;
        const int key0 = key_begin + t * BLOCK_N;

        // A warp whose rows all precede this tile's first visible key skips it.
        if (CAUSAL && key0 > warp_row0 + ROWS_PER_WARP - 1 + causal_offset) continue;

        // With S_GROUPS = M_TILES, each m16 tile runs S, softmax and P.V on its own:
        // K fragments are read once per m tile instead of once a warp, but only
        // one m tile's scores are live at a time (the register file is what
        // limits 32-row warps at head_dim 128).
#pragma unroll
        for (int group = 0; group < S_GROUPS; ++group) {
            // ---- S = Q K^T
            float s_acc[M_TILES][N_TILES][4];
#pragma unroll
            for (int mt = group * MT_PER_GROUP; mt < (group + 1) * MT_PER_GROUP; ++mt)
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) s_acc[mt][nt][i] = 0.f;
#pragma unroll
            for (int ds = 0; ds < D_STEPS; ++ds) {
#if !Q_IN_REGISTERS
                uint32_t q_frag_ds[M_TILES][4];
#pragma unroll
                for (int mt = group * MT_PER_GROUP; mt < (group + 1) * MT_PER_GROUP; ++mt)
                    ldmatrix_x4(q_frag_ds[mt][0], q_frag_ds[mt][1], q_frag_ds[mt][2],
                                q_frag_ds[mt][3],
                                smem_addr(s_q_warp + (mt * 16 + a_row) * ROW_STRIDE + ds * 16 + a_col));
#endif
#pragma unroll
                for (int np = 0; np < N_TILES / 2; ++np) {
                    uint32_t b0, b1, b2, b3;
                    ldmatrix_x4(b0, b1, b2, b3,
                                smem_addr(s_k + (np * 16 + b_row) * ROW_STRIDE + ds * 16 + b_col));
#pragma unroll
                    for (int mt = group * MT_PER_GROUP; mt < (group + 1) * MT_PER_GROUP; ++mt) {
#if Q_IN_REGISTERS
                        const uint32_t* a = q_frag[mt][ds];
#else
                        const uint32_t* a = q_frag_ds[mt];
#endif
                        mma_16816(s_acc[mt][2 * np], a, b0, b1);
                        mma_16816(s_acc[mt][2 * np + 1], a, b2, b3);
                    }
                }
            }

            // ---- mask: keys past kv_len (last tile) and, under causal, past the diagonal
            const bool tail = key0 + BLOCK_N > kv_len;
            const bool diagonal = CAUSAL && (key0 + BLOCK_N - 1 > warp_row0 + causal_offset);
            if (tail || diagonal) {
#pragma unroll
                for (int mt = group * MT_PER_GROUP; mt < (group + 1) * MT_PER_GROUP; ++mt)
#pragma unroll
                    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int key = key0 + nt * 8 + (lane % 4) * 2 + (i % 2);
                            const int row = warp_row0 + mt * 16 + lane / 4 + (i / 2) * 8;
                            bool masked = key >= kv_len;
                            if (CAUSAL) masked = masked || key > row + causal_offset;
                            if (masked) s_acc[mt][nt][i] = -INFINITY;
                        }
            }

            // ---- online softmax (fp32, log2 domain) and O += P V, one m16 tile at a
            // time: P stays in registers as the A fragments of the next mma, and the
            // softmax of tile mt + 1 has no dependence on the P V products of tile mt,
            // so the scheduler interleaves that ALU work with those tensor-core ops.
            // V fragments are re-read per m tile (shared memory has the headroom;
            // registers do not).
#pragma unroll
            for (int mt = group * MT_PER_GROUP; mt < (group + 1) * MT_PER_GROUP; ++mt) {
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
                    // A row with no visible key yet keeps max -inf: subtract 0, not -inf.
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
#pragma unroll
                    for (int dt = 0; dt < D_TILES; ++dt) {
                        o_acc[mt][dt][2 * half] *= correction;
                        o_acc[mt][dt][2 * half + 1] *= correction;
                    }
                }
#pragma unroll
                for (int ks = 0; ks < N_STEPS; ++ks) {
                    uint32_t p_frag[4];
                    p_frag[0] = pack_pair(s_acc[mt][2 * ks][0], s_acc[mt][2 * ks][1]);
                    p_frag[1] = pack_pair(s_acc[mt][2 * ks][2], s_acc[mt][2 * ks][3]);
                    p_frag[2] = pack_pair(s_acc[mt][2 * ks + 1][0], s_acc[mt][2 * ks + 1][1]);
                    p_frag[3] = pack_pair(s_acc[mt][2 * ks + 1][2], s_acc[mt][2 * ks + 1][3]);
#pragma unroll
                    for (int dp = 0; dp < D_TILES / 2; ++dp) {
                        uint32_t b0, b1, b2, b3;
                        ldmatrix_x4_trans(
                            b0, b1, b2, b3,
                            smem_addr(s_v + (ks * 16 + v_row) * ROW_STRIDE + dp * 16 + v_col));
                        mma_16816(o_acc[mt][2 * dp], p_frag, b0, b1);
                        mma_16816(o_acc[mt][2 * dp + 1], p_frag, b2, b3);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();

    // ---- epilogue: finish the row sums across the four lanes of a row
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float s = row_sum[mt][half];
            s += __shfl_xor_sync(0xffffffff, s, 1);
            s += __shfl_xor_sync(0xffffffff, s, 2);
            row_sum[mt][half] = s;
        }

    if (splits == 1) {
        // Stage the warp's rows in its own slice of s_q (Q is no longer read),
        // then write 16-byte chunks per lane.
#if !Q_IN_REGISTERS
        __syncwarp();
#endif
        elem_t* stage = const_cast<elem_t*>(s_q_warp);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float inv = row_sum[mt][half] > 0.f ? 1.f / row_sum[mt][half] : 0.f;
                const int r = mt * 16 + lane / 4 + half * 8;
#pragma unroll
                for (int dt = 0; dt < D_TILES; ++dt) {
                    const uint32_t packed = pack_pair(o_acc[mt][dt][2 * half] * inv,
                                                      o_acc[mt][dt][2 * half + 1] * inv);
                    *reinterpret_cast<uint32_t*>(stage + r * ROW_STRIDE + dt * 8 +
                                                 (lane % 4) * 2) = packed;
                }
            }
        __syncwarp();
        elem_t* out_bh = out + (size_t)bh * seq_len * HEAD_DIM;
#pragma unroll
        for (int c = lane; c < ROWS_PER_WARP * CHUNKS_PER_ROW; c += 32) {
            const int r = c / CHUNKS_PER_ROW;
            const int col = (c % CHUNKS_PER_ROW) * 8;
            const int row = warp_row0 + r;
            if (row < seq_len)
                *reinterpret_cast<uint4*>(out_bh + (size_t)row * HEAD_DIM + col) =
                    *reinterpret_cast<const uint4*>(stage + r * ROW_STRIDE + col);
        }
        return;
    }

    // Several splits: float32 partial output (normalised by this split's sum)
    // and the split's log2-sum-exp (-inf where the split saw no key of the row).
    const size_t part_row0 = ((size_t)bh * splits + split) * seq_len;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp_row0 + mt * 16 + lane / 4 + half * 8;
            if (row >= seq_len) continue;
            const float l = row_sum[mt][half];
            const float inv = l > 0.f ? 1.f / l : 0.f;
            float* dst = partial_o + (part_row0 + row) * HEAD_DIM + (lane % 4) * 2;
#pragma unroll
            for (int dt = 0; dt < D_TILES; ++dt)
                *reinterpret_cast<float2*>(dst + dt * 8) =
                    make_float2(o_acc[mt][dt][2 * half] * inv, o_acc[mt][dt][2 * half + 1] * inv);
            if (lane % 4 == 0)
                partial_lse[part_row0 + row] =
                    l > 0.f ? row_max[mt][half] + __log2f(l) : -INFINITY;
        }
}

// ---------------------------------------------------------------- split merge

// out[row] = sum_s 2^(lse_s - lse) * partial_o[s][row], lse = log2 sum_s 2^lse_s.
// One thread per 4 output elements; 128 threads per block.
extern "C" __global__ void __launch_bounds__(128)
mma_f16_split_merge(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
                    elem_t* __restrict__ out, int seq_len, int splits, int total_rows) {
    constexpr int VECS_PER_ROW = HEAD_DIM / 4;
    const long long vec = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec >= (long long)total_rows * VECS_PER_ROW) return;
    const int global_row = (int)(vec / VECS_PER_ROW);
    const int col = (int)(vec % VECS_PER_ROW) * 4;
    const int bh = global_row / seq_len;
    const int row = global_row % seq_len;
    const size_t base = (size_t)bh * splits * seq_len + row;

    float lse_max = -INFINITY;
    for (int s = 0; s < splits; ++s) lse_max = fmaxf(lse_max, partial_lse[base + (size_t)s * seq_len]);
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
    uint2 packed;
    packed.x = pack_pair(acc.x * inv, acc.y * inv);
    packed.y = pack_pair(acc.z * inv, acc.w * inv);
    *reinterpret_cast<uint2*>(out + (size_t)global_row * HEAD_DIM + col) = packed;
}
