// FlashAttention-2 backward on tensor cores: bf16/fp16 in, fp32 accumulate,
// mma.sync.aligned.m16n8k16 (sm_80+, run here on sm_90).
//
// Four launches (include/fa/backward.cuh holds the shared pieces):
//   mma_f16_bwd_preprocess  D = rowsum(dO * O), LSE to log2, dQ accumulators (and counters) zeroed
//   mma_f16_bwd_attention   per key tile: dK, dV in registers, dQ added to float32
//   mma_f16_bwd_dq          dQ = scale * accumulator, cast
//   mma_f16_bwd_dkv         (GROUP_SPLIT > 1) the dK/dV partials of the group's shares summed
// and mma_f16_bwd_sinks for the sinks' gradient.
//
// The main kernel: a block of WARPS warps owns BLOCK_N keys of one KV head, KEYS_PER_WARP
// (16 or 32: one or two m16 tiles) a warp, and loops over the query blocks of BLOCK_M rows
// that see them, for each query head of its share of the group. Per query block, Q and dO
// (and the rows' LSE and D) arrive in shared memory by cp.async (double-buffered with
// STAGES = 2: the next block's loads run under this one's math); each warp then works
// through the block Q_CHUNK queries at a time, in the transposed (key-major) layout:
//   S^T  = K_w Q^T          A: K rows (ldmatrix),   B: Q rows (ldmatrix)
//   dP^T = V_w dO^T         A: V rows,              B: dO rows
//   P^T  = exp2(S^T * scale_log2 - lse2), dS^T = P^T * (dP^T - D)   (fp32, registers)
//   dV  += P^T dO           A: P^T from registers,  B: dO (ldmatrix.trans)
//   dK  += dS^T Q           A: dS^T from registers, B: Q (ldmatrix.trans)
// so a warp's dK and dV rows are its own: no reduction across warps. dS^T also goes to
// shared memory ([key][query], 16-bit), and after a barrier the warps split
//   dQ   = dS K             A: dS (ldmatrix.trans of dS^T), B: K (ldmatrix.trans)
// into m16 x (8 DQ_TILES) units whose fp32 results are added to the global accumulator
// (red.global.add.v2.f32). DETERMINISTIC=1 orders those additions per query block by key
// tile (a counter per (head, query block), include/fa/backward.cuh's dq_turn), so two runs
// give identical bits. The softmax scale multiplies dK at the end and dQ in its cast; the
// softcap's derivative (1 - tanh^2) multiplies dS per element.
//
// Layout contract with tuner/planner/families/mma_f16_bwd.py (shared elements of 2 bytes):
//   K, V tiles:      2 * BLOCK_N * (HEAD_DIM + 8)
//   dS^T:            BLOCK_N * (BLOCK_M + 8)
//   Q, dO per stage: 2 * BLOCK_M * (HEAD_DIM + 8)
//   then float32 lse_log2, D per stage: 2 * BLOCK_M
//   q, dout, dq: [batch * heads][seq_len][HEAD_DIM]; k, v, dk, dv: [batch * kv_heads][kv_len][HEAD_DIM].
// Masks (bottom-right causal, window), softcap and ALiBi are the forward's (variant.cuh).

#include "fa/backward.cuh"
#include "fa/fragment.cuh"
#include "fa/tile_load.cuh"
#include "fa/variant_switches.cuh"

// Defaults: the planner's default plan at head_dim 128 (tuner/planner/families/mma_f16_bwd.py).
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_M
#define BLOCK_M 64
#endif
#ifndef BLOCK_N
#define BLOCK_N 128
#endif
#ifndef WARPS
#define WARPS 8
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef Q_CHUNK
#define Q_CHUNK 16
#endif
#ifndef DETERMINISTIC
#define DETERMINISTIC 0
#endif
#ifndef IS_FP16
#define IS_FP16 0
#endif

#define THREADS (WARPS * 32)
#define KEYS_PER_WARP (BLOCK_N / WARPS)
#define K_TILES (KEYS_PER_WARP / 16)  // m16 tiles of keys a warp owns
#define Q_TILES (Q_CHUNK / 8)         // n8 tiles of queries in a chunk
#define Q_STEPS (Q_CHUNK / 16)        // k16 steps over a chunk's queries
#define D_TILES (HEAD_DIM / 8)
#define D_STEPS (HEAD_DIM / 16)
#define N_STEPS (BLOCK_N / 16)        // k16 steps over the keys (dQ)
#define M_TILES (BLOCK_M / 16)        // m16 tiles of queries in a block (dQ)
#define ROW_STRIDE (HEAD_DIM + 8)
#define DS_STRIDE (BLOCK_M + 8)

static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");
static_assert(BLOCK_N % (16 * WARPS) == 0, "each warp owns whole m16 tiles of keys");
static_assert(K_TILES >= 1 && K_TILES <= 2, "16 or 32 keys a warp");
static_assert(BLOCK_M % Q_CHUNK == 0 && Q_CHUNK % 16 == 0, "whole k16 chunks of queries");
static_assert(STAGES == 1 || STAGES == 2, "single or double buffered query tiles");

// dQ units: an m16 tile of queries x DQ_TILES n8 tiles of head_dim. The largest even divisor
// of D_TILES up to 8 that still gives every warp a unit (A fragments reused DQ_TILES / 2 times).
__host__ __device__ constexpr int dq_tiles() {
    int best = 2;
    for (int t = 4; t <= 8 && t <= D_TILES; t += 2)
        if (D_TILES % t == 0 && M_TILES * (D_TILES / t) >= WARPS) best = t;
    return best;
}
constexpr int kDqTiles = dq_tiles();
#define DQ_TILES kDqTiles
#define DQ_UNITS (M_TILES * (D_TILES / DQ_TILES))

struct Traits : fa::SwitchedVariant {
    using Elem = fa::HalfType<IS_FP16>::type;
    using Copy = fa::TileCopy<Elem, HEAD_DIM, ROW_STRIDE, THREADS>;
};
typedef Traits::Elem elem_t;

// Shared memory, in elements: K, V, dS^T, then per stage Q and dO, then float32 rows.
struct SharedTiles {
    elem_t* k;
    elem_t* v;
    elem_t* ds;
    elem_t* tiles;
    float* rows;

    __device__ __forceinline__ explicit SharedTiles(unsigned char* raw)
        : k(reinterpret_cast<elem_t*>(raw)),
          v(k + BLOCK_N * ROW_STRIDE),
          ds(v + BLOCK_N * ROW_STRIDE),
          tiles(ds + BLOCK_N * DS_STRIDE),
          rows(reinterpret_cast<float*>(tiles + STAGES * 2 * BLOCK_M * ROW_STRIDE)) {}
    __device__ __forceinline__ elem_t* q(int stage) const {
        return tiles + stage * 2 * BLOCK_M * ROW_STRIDE;
    }
    __device__ __forceinline__ elem_t* dout(int stage) const {
        return q(stage) + BLOCK_M * ROW_STRIDE;
    }
    __device__ __forceinline__ float* lse(int stage) const { return rows + stage * 2 * BLOCK_M; }
    __device__ __forceinline__ float* delta(int stage) const { return lse(stage) + BLOCK_M; }
};

// Q, dO rows [row0, row0 + BLOCK_M) of head bh (zeros past seq_len) and their lse_log2 and D
// (padded buffers: always in bounds) into `stage`; one commit group is the caller's.
__device__ __forceinline__ void load_query_tile(const SharedTiles& smem, int stage,
                                                const elem_t* q, const elem_t* dout,
                                                const float* lse_log2, const float* delta, int bh,
                                                int row0, int seq_len, int rows_padded, int tid) {
    const size_t offset = (static_cast<size_t>(bh) * seq_len + row0) * HEAD_DIM;
    Traits::Copy::load<BLOCK_M, true>(smem.q(stage), q + offset, seq_len - row0, tid);
    Traits::Copy::load<BLOCK_M, true>(smem.dout(stage), dout + offset, seq_len - row0, tid);
    constexpr int kRowChunks = BLOCK_M / 4;  // 16-byte chunks of one float row vector
    const size_t row_offset = static_cast<size_t>(bh) * rows_padded + row0;
    for (int c = tid; c < 2 * kRowChunks; c += THREADS) {
        const bool is_delta = c >= kRowChunks;
        const int part = (is_delta ? c - kRowChunks : c) * 4;
        const float* src = (is_delta ? delta : lse_log2) + row_offset + part;
        float* dst = (is_delta ? smem.delta(stage) : smem.lse(stage)) + part;
        fa::cp_async_16(fa::smem_addr(dst), src, 16);
    }
}

// ---------------------------------------------------------------- main kernel

extern "C" __global__ void __launch_bounds__(THREADS, 1)
mma_f16_bwd_attention(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                      const elem_t* __restrict__ v, const elem_t* __restrict__ dout,
                      const float* __restrict__ lse_log2, const float* __restrict__ delta,
                      float* __restrict__ dq_accum, elem_t* __restrict__ dk,
                      elem_t* __restrict__ dv, float* __restrict__ dkv_partial,
                      int* __restrict__ counters, int seq_len, int kv_len, int group,
                      float scale_log2, int heads, int window_left, int window_right,
                      float softcap, const float* __restrict__ alibi_slopes) {
    extern __shared__ __align__(128) unsigned char shared_raw[];
    const SharedTiles smem(shared_raw);
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const fa::KeyBlock<Traits, BLOCK_M, BLOCK_N> block(seq_len, kv_len, group, window_left,
                                                       window_right);
    const Traits::MaskType& mask = block.mask;
    const int key0 = block.key0;
    const int rows_padded = fa::padded_rows<BLOCK_M>(seq_len);

    // This block's K and V tiles, once; then the first query tile.
    const size_t kv_offset = (static_cast<size_t>(block.kv_bh) * kv_len + key0) * HEAD_DIM;
    Traits::Copy::load<BLOCK_N, true>(smem.k, k + kv_offset, kv_len - key0, tid);
    Traits::Copy::load<BLOCK_N, true>(smem.v, v + kv_offset, kv_len - key0, tid);
    if (block.count > 0)
        load_query_tile(smem, 0, q, dout, lse_log2, delta, block.bh_of(0),
                        block.m_block_of(0) * BLOCK_M, seq_len, rows_padded, tid);
    fa::cp_async_commit();

    // Per-lane ldmatrix offsets (the PTX ISA's fragment layouts; see mma_f16.cu).
    const int a_row = lane % 16;                          // A from row-major rows
    const int a_col = (lane / 16) * 8;
    const int b_row = (lane / 16) * 8 + (lane % 8);       // B from n-major rows; A (.trans) of dS
    const int b_col = ((lane / 8) % 2) * 8;
    const int t_row = ((lane / 8) % 2) * 8 + (lane % 8);  // B (.trans) from k-major rows
    const int t_col = (lane / 16) * 8;

    const int warp_key = warp * KEYS_PER_WARP;  // the warp's first key within the tile
    const int key_first = key0 + warp_key;
    float dk_acc[K_TILES][D_TILES][4];
    float dv_acc[K_TILES][D_TILES][4];
    fa::fill_zero<K_TILES * D_TILES * 4>(&dk_acc[0][0][0]);
    fa::fill_zero<K_TILES * D_TILES * 4>(&dv_acc[0][0][0]);

    for (int it = 0; it < block.count; ++it) {
        const int stage = STAGES == 2 ? it % 2 : 0;
        const int bh = block.bh_of(it);
        const int m_block = block.m_block_of(it);
        const int row0 = m_block * BLOCK_M;
        // Tile `it` has landed for every thread; every warp is done with iteration it - 1
        // (its Q/dO stage and dS^T are free).
        fa::cp_async_wait<0>();
        __syncthreads();
        if (STAGES == 2 && it + 1 < block.count) {
            load_query_tile(smem, stage ^ 1, q, dout, lse_log2, delta, block.bh_of(it + 1),
                            block.m_block_of(it + 1) * BLOCK_M, seq_len, rows_padded, tid);
            fa::cp_async_commit();
        }
        Traits::ScoreModType score_mod(scale_log2, softcap, seq_len, kv_len);
        score_mod.set_heads(alibi_slopes, bh % heads, bh % heads);
        const elem_t* s_q = smem.q(stage);
        const elem_t* s_do = smem.dout(stage);
        const float* s_lse = smem.lse(stage);
        const float* s_delta = smem.delta(stage);

#pragma unroll 1
        for (int qc = 0; qc < BLOCK_M; qc += Q_CHUNK) {
            const int q_first = row0 + qc;
            const int q_last = q_first + Q_CHUNK - 1;
            if (q_first >= seq_len || key_first >= kv_len ||
                mask.skipped(key_first, KEYS_PER_WARP, q_first, q_last)) {
                // No visible pair: dS is 0 here (dQ reads it), dK and dV gain nothing.
#pragma unroll
                for (int kt = 0; kt < K_TILES; ++kt)
#pragma unroll
                    for (int half = 0; half < 2; ++half)
#pragma unroll
                        for (int c = 0; c < Q_TILES; ++c)
                            *reinterpret_cast<uint32_t*>(
                                smem.ds + (warp_key + kt * 16 + fa::fragment_row(lane, half)) *
                                              DS_STRIDE +
                                qc + 8 * c + fa::fragment_column(lane)) = 0u;
                continue;
            }

            // ---- S^T = K_w Q^T and dP^T = V_w dO^T
            float st[K_TILES][Q_TILES][4];
            float dpt[K_TILES][Q_TILES][4];
            fa::fill_zero<K_TILES * Q_TILES * 4>(&st[0][0][0]);
            fa::fill_zero<K_TILES * Q_TILES * 4>(&dpt[0][0][0]);
#pragma unroll
            for (int ds = 0; ds < D_STEPS; ++ds) {
                uint32_t ka[K_TILES][4], va[K_TILES][4];
#pragma unroll
                for (int kt = 0; kt < K_TILES; ++kt) {
                    const int at = (warp_key + kt * 16 + a_row) * ROW_STRIDE + ds * 16 + a_col;
                    fa::ldmatrix_x4(ka[kt][0], ka[kt][1], ka[kt][2], ka[kt][3],
                                    fa::smem_addr(smem.k + at));
                    fa::ldmatrix_x4(va[kt][0], va[kt][1], va[kt][2], va[kt][3],
                                    fa::smem_addr(smem.v + at));
                }
#pragma unroll
                for (int np = 0; np < Q_TILES / 2; ++np) {
                    const int at = (qc + np * 16 + b_row) * ROW_STRIDE + ds * 16 + b_col;
                    uint32_t b0, b1, b2, b3;
                    fa::ldmatrix_x4(b0, b1, b2, b3, fa::smem_addr(s_q + at));
#pragma unroll
                    for (int kt = 0; kt < K_TILES; ++kt) {
                        fa::mma_16816<elem_t>(st[kt][2 * np], ka[kt], b0, b1);
                        fa::mma_16816<elem_t>(st[kt][2 * np + 1], ka[kt], b2, b3);
                    }
                    fa::ldmatrix_x4(b0, b1, b2, b3, fa::smem_addr(s_do + at));
#pragma unroll
                    for (int kt = 0; kt < K_TILES; ++kt) {
                        fa::mma_16816<elem_t>(dpt[kt][2 * np], va[kt], b0, b1);
                        fa::mma_16816<elem_t>(dpt[kt][2 * np + 1], va[kt], b2, b3);
                    }
                }
            }

            // ---- P^T = exp2(logit - lse2) (0 where masked), dS^T = P^T * (dP^T - D) [* (1 - tanh^2)]
            // (include/fa/backward.cuh): key_first + 16 kt + lane / 4 + 8 (i / 2) against query
            // row0 + qc + 8 c + 2 (lane % 4) + i % 2.
            const bool partial = mask.partial(key_first, KEYS_PER_WARP, q_first, q_last);
#pragma unroll
            for (int kt = 0; kt < K_TILES; ++kt)
                fa::transposed_gradients<Traits, Q_TILES>(
                    &st[kt][0][0], &dpt[kt][0][0], score_mod, mask, partial, key_first + kt * 16,
                    q_first, s_lse + qc, s_delta + qc, scale_log2, lane);

            // ---- dV += P^T dO, then dS^T to shared memory and dK += dS^T Q
#pragma unroll
            for (int ks = 0; ks < Q_STEPS; ++ks) {
                uint32_t pa[K_TILES][4], da[K_TILES][4];
#pragma unroll
                for (int kt = 0; kt < K_TILES; ++kt) {
                    fa::pack_a_fragment<elem_t>(&st[kt][2 * ks][0], pa[kt]);
                    fa::pack_a_fragment<elem_t>(&dpt[kt][2 * ks][0], da[kt]);
                    // A fragment registers: (row g, k 0-7), (g + 8, k 0-7), (g, k 8-15), (g + 8, k 8-15)
                    elem_t* row = smem.ds + (warp_key + kt * 16 + fa::fragment_row(lane, 0)) *
                                                DS_STRIDE +
                                  qc + ks * 16 + fa::fragment_column(lane);
                    *reinterpret_cast<uint32_t*>(row) = da[kt][0];
                    *reinterpret_cast<uint32_t*>(row + 8 * DS_STRIDE) = da[kt][1];
                    *reinterpret_cast<uint32_t*>(row + 8) = da[kt][2];
                    *reinterpret_cast<uint32_t*>(row + 8 * DS_STRIDE + 8) = da[kt][3];
                }
#pragma unroll
                for (int dp = 0; dp < D_TILES / 2; ++dp) {
                    const int at = (qc + ks * 16 + t_row) * ROW_STRIDE + dp * 16 + t_col;
                    uint32_t b0, b1, b2, b3;
                    fa::ldmatrix_x4_trans(b0, b1, b2, b3, fa::smem_addr(s_do + at));
#pragma unroll
                    for (int kt = 0; kt < K_TILES; ++kt) {
                        fa::mma_16816<elem_t>(dv_acc[kt][2 * dp], pa[kt], b0, b1);
                        fa::mma_16816<elem_t>(dv_acc[kt][2 * dp + 1], pa[kt], b2, b3);
                    }
                    fa::ldmatrix_x4_trans(b0, b1, b2, b3, fa::smem_addr(s_q + at));
#pragma unroll
                    for (int kt = 0; kt < K_TILES; ++kt) {
                        fa::mma_16816<elem_t>(dk_acc[kt][2 * dp], da[kt], b0, b1);
                        fa::mma_16816<elem_t>(dk_acc[kt][2 * dp + 1], da[kt], b2, b3);
                    }
                }
            }
        }

        // ---- dQ += dS K: every warp's dS^T is in shared memory.
        __syncthreads();
        if (STAGES == 1 && it + 1 < block.count) {
            // Q and dO of this block are read: the next block's loads run under dQ.
            load_query_tile(smem, 0, q, dout, lse_log2, delta, block.bh_of(it + 1),
                            block.m_block_of(it + 1) * BLOCK_M, seq_len, rows_padded, tid);
            fa::cp_async_commit();
        }
#if DETERMINISTIC
        int* counter = counters + static_cast<size_t>(bh) * (rows_padded / BLOCK_M) + m_block;
        if (tid == 0) {
            const int turn = fa::dq_turn<BLOCK_M, BLOCK_N>(mask, block.key_tile, m_block);
            while (fa::load_acquire(counter) != turn) {
            }
        }
        __syncthreads();
#endif
        float* dq_bh = dq_accum + static_cast<size_t>(bh) * seq_len * HEAD_DIM;
#pragma unroll 1
        for (int unit = warp; unit < DQ_UNITS; unit += WARPS) {
            const int mt = unit % M_TILES;
            const int col0 = (unit / M_TILES) * DQ_TILES * 8;
            float acc[DQ_TILES][4];
            fa::fill_zero<DQ_TILES * 4>(&acc[0][0]);
#pragma unroll
            for (int ks = 0; ks < N_STEPS; ++ks) {
                uint32_t a[4];
                fa::ldmatrix_x4_trans(a[0], a[1], a[2], a[3],
                                      fa::smem_addr(smem.ds + (ks * 16 + b_row) * DS_STRIDE +
                                                    mt * 16 + b_col));
#pragma unroll
                for (int dp = 0; dp < DQ_TILES / 2; ++dp) {
                    uint32_t b0, b1, b2, b3;
                    fa::ldmatrix_x4_trans(b0, b1, b2, b3,
                                          fa::smem_addr(smem.k + (ks * 16 + t_row) * ROW_STRIDE +
                                                        col0 + dp * 16 + t_col));
                    fa::mma_16816<elem_t>(acc[2 * dp], a, b0, b1);
                    fa::mma_16816<elem_t>(acc[2 * dp + 1], a, b2, b3);
                }
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = row0 + mt * 16 + fa::fragment_row(lane, half);
                if (row >= seq_len) continue;
                float* dst = dq_bh + static_cast<size_t>(row) * HEAD_DIM + col0 +
                             fa::fragment_column(lane);
#pragma unroll
                for (int c = 0; c < DQ_TILES; ++c)
                    fa::red_add_f32x2(dst + 8 * c, acc[c][2 * half], acc[c][2 * half + 1]);
            }
        }
#if DETERMINISTIC
        __threadfence();
        __syncthreads();
        if (tid == 0) fa::red_release_add(counter, 1);
#endif
    }
    fa::cp_async_wait<0>();

    // ---- epilogue: dK (scaled) and dV of the warp's keys; with several shares of the
    // group, float32 partials that mma_f16_bwd_dkv sums.
    const float scale = scale_log2 * fa::kLn2;
    const int splits = gridDim.y;
    const size_t partial_half = static_cast<size_t>(gridDim.z) * splits * kv_len * HEAD_DIM;
#pragma unroll
    for (int kt = 0; kt < K_TILES; ++kt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int key = key_first + kt * 16 + fa::fragment_row(lane, half);
            if (key >= kv_len) continue;
            if (splits == 1) {
                const size_t at = (static_cast<size_t>(block.kv_bh) * kv_len + key) * HEAD_DIM;
                fa::store_fragment_row<D_TILES>(dk + at, &dk_acc[kt][0][0], half, scale, lane);
                fa::store_fragment_row<D_TILES>(dv + at, &dv_acc[kt][0][0], half, 1.f, lane);
            } else {
                const size_t at =
                    ((static_cast<size_t>(block.kv_bh) * splits + blockIdx.y) * kv_len + key) *
                    HEAD_DIM;
                fa::store_fragment_row<D_TILES>(dkv_partial + at, &dk_acc[kt][0][0], half, scale,
                                                lane);
                fa::store_fragment_row<D_TILES>(dkv_partial + partial_half + at,
                                                &dv_acc[kt][0][0], half, 1.f, lane);
            }
        }
}

// ---------------------------------------------------------------- the other launches

extern "C" __global__ void __launch_bounds__(fa::kPreprocessThreads)
mma_f16_bwd_preprocess(const elem_t* __restrict__ out, const elem_t* __restrict__ dout,
                       const float* __restrict__ lse, float* __restrict__ lse_log2,
                       float* __restrict__ delta, float* __restrict__ dq_accum,
                       int* __restrict__ counters, int seq_len, int batch_heads) {
    fa::backward_preprocess<elem_t, HEAD_DIM, BLOCK_M>(out, dout, lse, lse_log2, delta, dq_accum,
                                                       counters, seq_len, batch_heads);
}

extern "C" __global__ void __launch_bounds__(fa::kPostprocessThreads)
mma_f16_bwd_dq(const float* __restrict__ dq_accum, elem_t* __restrict__ dq, int quads,
               float scale) {
    fa::backward_dq<elem_t>(dq_accum, dq, quads, scale);
}

extern "C" __global__ void __launch_bounds__(fa::kPostprocessThreads)
mma_f16_bwd_dkv(const float* __restrict__ partial, elem_t* __restrict__ dk,
                elem_t* __restrict__ dv, int kv_len, int splits, int batch_kv_heads) {
    fa::backward_dkv_sum<elem_t, HEAD_DIM>(partial, dk, dv, kv_len, splits, batch_kv_heads);
}

extern "C" __global__ void __launch_bounds__(fa::kSinkThreads)
mma_f16_bwd_sinks(const float* __restrict__ lse_log2, const float* __restrict__ delta,
                  const float* __restrict__ sinks, float* __restrict__ d_sinks, int seq_len,
                  int batch, int heads) {
    fa::backward_sink_gradient<BLOCK_M>(lse_log2, delta, sinks, d_sinks, seq_len, batch, heads);
}
