// FlashAttention backward on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a): bf16/fp16 in,
// fp32 accumulate. FlashAttention-2's backward loop (include/fa/backward.cuh) with every
// product on wgmma, the transposed scores and the dQ product read from shared memory through
// swizzled descriptors, in the layout FlashAttention-3's backward uses.
//
// Four launches, as mma_f16_bwd (the same preprocess and postprocesses, backward.cuh):
//   wgmma_f16_bwd_preprocess  D = rowsum(dO * O), LSE to log2, the tiled dQ accumulator (and
//                             the counters) zeroed
//   wgmma_f16_bwd_attention   per key tile: dK, dV in registers, dQ added to float32
//   wgmma_f16_bwd_dq          dQ = scale * accumulator, cast (backward_dq_tiled)
//   wgmma_f16_bwd_dkv         (group_split > 1) the dK/dV partials of the group's shares summed
// and wgmma_f16_bwd_sinks for the sinks' gradient.
//
// The main kernel: two warpgroups (256 threads) own BLOCK_N = 128 keys of one KV head, 64 a
// warpgroup (the M of wgmma m64nNk16), and loop over the query blocks of BLOCK_M rows that
// see them, for each query head of the block's share of the group (KeyBlock). Every thread
// copies its share of the next query block's Q, dO, lse_log2 and D into the other stage by
// cp.async while this block's products run (double-buffered). Per query block, warpgroup w
// (keys 64 w .. 64 w + 63 of the tile):
//   S^T  = K_w Q^T      wgmma m64n{BLOCK_M}k16 x HEAD_DIM/16, A = K rows, B = Q (both K-major)
//   dP^T = V_w dO^T     the same with V and dO
//   P^T, dS^T           elementwise in registers (fa::transposed_probabilities, then
//                       fa::transposed_score_gradients)
//   dV  += P^T dO       wgmma m64n{HEAD_DIM}k16 x BLOCK_M/16, A = P^T from registers (the
//                       accumulator layout is the register-A layout, as P in the forward),
//                       B = dO MN-major (head_dim contiguous: imm-trans-b = 1)
//   dK  += dS^T Q       the same with dS^T and Q
//   dS (queries x keys) to shared memory by stmatrix .trans: K-major for the dQ product
// then, once both warpgroups' dS is stored (one barrier),
//   dQ   = dS K         wgmma m64n{DQ_N}k16 x BLOCK_N/16, A = dS (K-major), B = K MN-major;
//                       warpgroup w takes dQ's columns (head_dim / 2) w ..
// whose fp32 results go through shared memory to the TMA unit, one bulk add.f32 reduction a
// warp into a tiled float32 accumulator (cp.reduce.async.bulk, as FlashAttention-3 adds dQ;
// backward.cuh's backward_dq_tiled casts it), with
// DETERMINISTIC=1 in key-tile order per query block (backward.cuh's dq_turn), as mma_f16_bwd.
// The softmax scale multiplies dK at the end and dQ in its cast.
//
// Shared memory (bytes; base rounded up to 1024): every tile of R rows x C columns (2-byte
// elements) is stored as C / 64 column chunks of R rows x 128 bytes in the 128-byte swizzle
// (16-byte unit u of row r at u ^ (r % 8)), each chunk 1024-aligned: what the wgmma
// descriptors of swizzle mode 1 read (include/fa/hopper.cuh).
//   K, V:           BLOCK_N x HEAD_DIM each
//   Q, dO [stage]:  BLOCK_M x HEAD_DIM each, two stages
//   dS:             BLOCK_M x BLOCK_N (chunk w: warpgroup w's keys)
//   lse_log2, D [stage]: BLOCK_M floats each
//   dQ staging:     per warp 16 rows x DQ_N floats
// In time, per warpgroup: S^T and dP^T are issued as two groups; P^T is computed while dP^T
// is still in the tensor cores, dV's product runs while dS^T is computed and stored, and
// dK's while dQ goes out; the iteration waits for dK before the next one's barrier hands
// its Q tile back to the loads.
//
// Entry contract: mma_f16_bwd_attention's (arguments, buffers, grid (key tiles, group
// shares, batch * kv_heads)), except that dq_accum is the tiled accumulator
// ([batch * heads][query block][warpgroup][warp][chunk][lane][4] floats, rows padded to whole
// blocks); block 256 threads; dynamic shared bytes = SMEM_BYTES.

#include "fa/backward.cuh"
#include "fa/fragment.cuh"
#include "fa/hopper.cuh"
#include "fa/variant_switches.cuh"
#include "fa/wgmma_ops.cuh"

// Defaults: the planner's default plan at head_dim 128 (tuner/planner/families/wgmma_f16_bwd.py).
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_M
#define BLOCK_M 64
#endif
#ifndef DETERMINISTIC
#define DETERMINISTIC 0
#endif
#ifndef IS_FP16
#define IS_FP16 0
#endif

#define BLOCK_N 128
#define WARPGROUPS 2
#define THREADS (128 * WARPGROUPS)
#define SWIZZLE_BYTES 128
#define CHUNK_COLS 64                              // 2-byte columns of a swizzled chunk
#define KV_TILE_BYTES (BLOCK_N * HEAD_DIM * 2)
#define Q_TILE_BYTES (BLOCK_M * HEAD_DIM * 2)
#define DS_TILE_BYTES (BLOCK_M * BLOCK_N * 2)
#define ROWS_BYTES (BLOCK_M * 4)
#define K_OFFSET 0
#define V_OFFSET (K_OFFSET + KV_TILE_BYTES)
#define QDO_OFFSET (V_OFFSET + KV_TILE_BYTES)      // + stage * 2 Q_TILE_BYTES: Q, then dO
#define DS_OFFSET (QDO_OFFSET + 4 * Q_TILE_BYTES)
#define ROWS_OFFSET (DS_OFFSET + DS_TILE_BYTES)    // + stage * 2 ROWS_BYTES: lse_log2, then D
#define DQ_OFFSET (ROWS_OFFSET + 4 * ROWS_BYTES)  // + (4 warpgroup + warp) DQ_WARP_BYTES
#define SMEM_BYTES (DQ_OFFSET + WARPGROUPS * 4 * DQ_WARP_BYTES + 1024)
#define SDP_REGS (BLOCK_M / 2)                     // S^T (and dP^T) accumulators a thread
#define DKV_REGS (HEAD_DIM / 2)                    // dK (and dV) accumulators a thread
// dQ: split by columns, warpgroup w takes head_dim columns w * DQ_N ..
#define DQ_N (HEAD_DIM / 2)
#define DQ_REGS (DQ_N / 2)
// a warp's dQ staging: its 16 rows of the warpgroup's DQ_N columns, in register order
// ([n8 chunk][lane][4] floats: one conflict-free float4 store a chunk), which is also the
// tiled accumulator's order (backward.cuh's backward_dq_tiled)
#define DQ_WARP_BYTES (16 * DQ_N * 4)

// (128 query rows a block would hold S^T and dP^T of 128 columns: ptxas spills them at head_dim
// 64 and they do not fit at 128)
static_assert((HEAD_DIM == 128 || HEAD_DIM == 64) && BLOCK_M == 64,
              "head_dim 64 or 128, 64 query rows a block");
static_assert(SMEM_BYTES <= 232448, "227 KB of shared memory a block on sm_90");

struct Traits : fa::SwitchedVariant {
    using Elem = fa::HalfType<IS_FP16>::type;
    using SdpGemm = fa::Wgmma<BLOCK_M, Elem>;   // S^T, dP^T: m64n{BLOCK_M}
    using DkvGemm = fa::Wgmma<HEAD_DIM, Elem>;  // dK, dV: m64n{HEAD_DIM}
    using DqGemm = fa::Wgmma<DQ_N, Elem>;       // dQ: m64n{DQ_N}
};
typedef Traits::Elem elem_t;

// Rows [0, ROWS) of a tile of ROWS x HEAD_DIM elements from global memory (row stride
// HEAD_DIM; rows >= valid_rows zero-filled) into its swizzled layout at `tile`, by cp.async
// (16-byte units, THREADS threads striding them). One commit group is the caller's.
template <int ROWS>
__device__ __forceinline__ void load_swizzled(uint32_t tile, const elem_t* src, int valid_rows,
                                              int tid) {
    constexpr int UNITS = HEAD_DIM / 8;  // 16-byte units of a row
    static_assert(ROWS * UNITS % THREADS == 0, "whole rounds of units");
#pragma unroll
    for (int i = 0; i < ROWS * UNITS / THREADS; ++i) {
        const int unit = i * THREADS + tid, row = unit / UNITS, u = unit % UNITS;
        const bool valid = row < valid_rows;
        fa::cp_async_16(tile + fa::swizzled_offset<SWIZZLE_BYTES>(ROWS, row, 16 * u),
                        src + (size_t)(valid ? row : 0) * HEAD_DIM + 8 * u, valid ? 16 : 0);
    }
}

// The query block `row0` of head bh into `stage`: Q and dO rows (zeros past seq_len) and their
// lse_log2 and D (padded buffers: always in bounds).
__device__ __forceinline__ void load_query_block(uint32_t base, int stage, const elem_t* q,
                                                 const elem_t* dout, const float* lse_log2,
                                                 const float* delta, int bh, int row0,
                                                 int seq_len, int rows_padded, int tid) {
    const uint32_t q_tile = base + QDO_OFFSET + stage * 2 * Q_TILE_BYTES;
    const size_t offset = ((size_t)bh * seq_len + row0) * HEAD_DIM;
    load_swizzled<BLOCK_M>(q_tile, q + offset, seq_len - row0, tid);
    load_swizzled<BLOCK_M>(q_tile + Q_TILE_BYTES, dout + offset, seq_len - row0, tid);
    constexpr int ROW_UNITS = ROWS_BYTES / 16;
    if (tid < 2 * ROW_UNITS) {
        const bool is_delta = tid >= ROW_UNITS;
        const int unit = is_delta ? tid - ROW_UNITS : tid;
        const float* src = (is_delta ? delta : lse_log2) + (size_t)bh * rows_padded + row0 + 4 * unit;
        fa::cp_async_16(base + ROWS_OFFSET + stage * 2 * ROWS_BYTES + is_delta * ROWS_BYTES +
                            16 * unit,
                        src, 16);
    }
}

// Ties 16-bit A fragments to this point (as fa::fence_registers the accumulators): a wgmma
// that reads them may still run until the wgmma_wait before this.
__device__ __forceinline__ void fence_fragments(uint32_t (&frag)[BLOCK_M / 16][4]) {
#pragma unroll
    for (int j = 0; j < BLOCK_M / 16; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(frag[j][i])::"memory");
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
wgmma_f16_bwd_attention(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                        const elem_t* __restrict__ v, const elem_t* __restrict__ dout,
                        const float* __restrict__ lse_log2, const float* __restrict__ delta,
                        float* __restrict__ dq_accum, elem_t* __restrict__ dk,
                        elem_t* __restrict__ dv, float* __restrict__ dkv_partial,
                        int* __restrict__ counters, int seq_len, int kv_len, int group,
                        float scale_log2, int heads, int window_left, int window_right,
                        float softcap, const float* __restrict__ alibi_slopes) {
    extern __shared__ __align__(1024) unsigned char shared_raw[];
    // the swizzle atoms need 1024-byte alignment; the dynamic base is only 16-byte aligned
    const uint32_t base = (fa::smem_addr(shared_raw) + 1023) & ~1023u;
    const float* rows_raw = reinterpret_cast<const float*>(
        shared_raw + (base - fa::smem_addr(shared_raw)) + ROWS_OFFSET);
    const uint32_t s_k = base + K_OFFSET, s_v = base + V_OFFSET, s_ds = base + DS_OFFSET;

    const int tid = threadIdx.x;
    // (a shuffle from lane 0 tells the compiler the warpgroup is warp-uniform, as CUTLASS's
    // canonical_warp_group_idx: its descriptors then live in uniform registers)
    const int wg = __shfl_sync(0xffffffff, tid / 128, 0);
    const int warp = (tid % 128) / 32;
    const int lane = tid % 32;
    const fa::KeyBlock<Traits, BLOCK_M, BLOCK_N> block(seq_len, kv_len, group, window_left,
                                                       window_right);
    const Traits::MaskType& mask = block.mask;
    const int rows_padded = fa::padded_rows<BLOCK_M>(seq_len);
    const int wg_key0 = block.key0 + 64 * wg;       // the warpgroup's first key
    const int warp_key0 = wg_key0 + 16 * warp;      // the warp's 16 keys (fragment rows)

    // This block's K and V tiles, once; then the first query block.
    const size_t kv_offset = ((size_t)block.kv_bh * kv_len + block.key0) * HEAD_DIM;
    load_swizzled<BLOCK_N>(s_k, k + kv_offset, kv_len - block.key0, tid);
    load_swizzled<BLOCK_N>(s_v, v + kv_offset, kv_len - block.key0, tid);
    if (block.count > 0)
        load_query_block(base, 0, q, dout, lse_log2, delta, block.bh_of(0),
                         block.m_block_of(0) * BLOCK_M, seq_len, rows_padded, tid);
    fa::cp_async_commit();

    // Descriptors of the tiles that stay put: the warpgroup's K and V rows (A of S^T, dP^T), the
    // dS tile (A of dQ) and the warpgroup's K columns (B of dQ: warpgroup w's start at byte
    // 2 w DQ_N of a row, a whole chunk or, at head_dim 64, half of one; the swizzle is a
    // function of the address, so an MN-major operand may start mid-row as a K-major one
    // starts at its k16 step).
    const uint64_t k_rows = fa::k_major_base<SWIZZLE_BYTES>(s_k + 64 * wg * SWIZZLE_BYTES);
    const uint64_t v_rows = fa::k_major_base<SWIZZLE_BYTES>(s_v + 64 * wg * SWIZZLE_BYTES);
    const uint64_t ds_rows = fa::k_major_base<SWIZZLE_BYTES>(s_ds);
    constexpr int DQ_COL_BYTES = 2 * DQ_N;
    const uint64_t k_columns = fa::mn_major_base<SWIZZLE_BYTES, BLOCK_N>(
        s_k + (wg * DQ_COL_BYTES / SWIZZLE_BYTES) * BLOCK_N * SWIZZLE_BYTES +
        wg * DQ_COL_BYTES % SWIZZLE_BYTES);

    float dk_acc[DKV_REGS], dv_acc[DKV_REGS];
    fa::fill_zero<DKV_REGS>(dk_acc);
    fa::fill_zero<DKV_REGS>(dv_acc);

    for (int it = 0; it < block.count; ++it) {
        const int stage = it % 2;
        const int bh = block.bh_of(it);
        const int m_block = block.m_block_of(it);
        const int row0 = m_block * BLOCK_M;
        // Block `it` has landed for every thread (and is visible to the async proxy the wgmma
        // reads through); every warpgroup is done with iteration it - 1 (its stage and dS).
        fa::cp_async_wait<0>();
        fa::fence_proxy_async_shared();
        __syncthreads();
        if (it + 1 < block.count) {
            load_query_block(base, stage ^ 1, q, dout, lse_log2, delta, block.bh_of(it + 1),
                             block.m_block_of(it + 1) * BLOCK_M, seq_len, rows_padded, tid);
            fa::cp_async_commit();
        }
        const uint32_t s_q = base + QDO_OFFSET + stage * 2 * Q_TILE_BYTES;
        const uint32_t s_do = s_q + Q_TILE_BYTES;
        const float* s_lse = rows_raw + stage * 2 * BLOCK_M;
        const float* s_delta = s_lse + BLOCK_M;

        // ---- S^T = K_w Q^T, dP^T = V_w dO^T (the warpgroup's 64 keys: rows 64 wg of each chunk)
        float st[SDP_REGS], dpt[SDP_REGS];
        const uint64_t q_k_major = fa::k_major_base<SWIZZLE_BYTES>(s_q);
        const uint64_t do_k_major = fa::k_major_base<SWIZZLE_BYTES>(s_do);
        fa::wgmma_fence();
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 16; ++j)
            Traits::SdpGemm::ss(st, k_rows + fa::k_major_step<SWIZZLE_BYTES, BLOCK_N>(j),
                                q_k_major + fa::k_major_step<SWIZZLE_BYTES, BLOCK_M>(j), j > 0);
        fa::wgmma_commit();
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 16; ++j)
            Traits::SdpGemm::ss(dpt, v_rows + fa::k_major_step<SWIZZLE_BYTES, BLOCK_N>(j),
                                do_k_major + fa::k_major_step<SWIZZLE_BYTES, BLOCK_M>(j), j > 0);
        fa::wgmma_commit();  // (S^T and dP^T in two groups: P^T starts on S^T alone)

        // ---- P^T while dP^T is in the tensor cores, then dV += P^T dO (B MN-major: queries x
        // head_dim) while dS^T is computed (include/fa/backward.cuh's two passes)
        fa::wgmma_wait<1>();
        fa::fence_registers<SDP_REGS>(st);
        Traits::ScoreModType score_mod(scale_log2, softcap, seq_len, kv_len);
        score_mod.set_heads(alibi_slopes, bh % heads, bh % heads);
        const bool partial = mask.partial(warp_key0, 16, row0, row0 + BLOCK_M - 1);
        uint32_t p_frag[BLOCK_M / 16][4], ds_frag[BLOCK_M / 16][4];
        fa::transposed_probabilities<Traits, BLOCK_M / 8>(st, p_frag, score_mod, mask, partial,
                                                          warp_key0, row0, s_lse, scale_log2,
                                                          lane);
        fa::wgmma_wait<0>();
        fa::fence_registers<SDP_REGS>(dpt);
        fa::fence_registers<DKV_REGS>(dv_acc);
        fa::wgmma_fence();
        const uint64_t do_mn_major = fa::mn_major_base<SWIZZLE_BYTES, BLOCK_M>(s_do);
        const uint64_t q_mn_major = fa::mn_major_base<SWIZZLE_BYTES, BLOCK_M>(s_q);
#pragma unroll
        for (int j = 0; j < BLOCK_M / 16; ++j)
            Traits::DkvGemm::rs(dv_acc, p_frag[j], do_mn_major + fa::mn_major_step<SWIZZLE_BYTES>(j),
                                1);
        fa::wgmma_commit();
        fa::transposed_score_gradients<BLOCK_M / 8>(st, dpt, s_delta, lane);
#pragma unroll
        for (int j = 0; j < BLOCK_M / 16; ++j) fa::pack_a_fragment<elem_t>(dpt + 8 * j, ds_frag[j]);

        // ---- dS (queries x keys) to shared memory: ds_frag[j] holds the four 8x8 matrices
        // (query chunk 2j + m / 2, key half m % 2) of this warp's 16 keys; stored transposed,
        // row = query, 16 bytes = 8 keys, in chunk wg of the dS tile.
        {
            const int m = lane / 8;
#pragma unroll
            for (int j = 0; j < BLOCK_M / 16; ++j) {
                const int query = 16 * j + 8 * (m / 2) + lane % 8;
                const int key_byte = 2 * (16 * warp + 8 * (m % 2));
                fa::stmatrix_x4_trans(
                    s_ds + wg * BLOCK_M * SWIZZLE_BYTES +
                        fa::swizzled_offset<SWIZZLE_BYTES>(BLOCK_M, query, key_byte),
                    ds_frag[j]);
            }
        }
        fa::fence_proxy_async_shared();  // the stores, before the dQ product reads them
#if DETERMINISTIC
        int* counter = counters + (size_t)bh * (rows_padded / BLOCK_M) + m_block;
        if (tid == 0) {
            const int turn = fa::dq_turn<BLOCK_M, BLOCK_N>(mask, block.key_tile, m_block);
            while (fa::load_acquire(counter) != turn) {
            }
        }
#endif
        __syncthreads();  // both warpgroups' dS is stored

        // ---- dQ = dS K (A: dS K-major, B: K MN-major: keys x head_dim), then dK += dS^T Q,
        // which runs while dQ goes out
        float dq[DQ_REGS];
        fa::fence_registers<DKV_REGS>(dk_acc);
        fa::wgmma_fence();
#pragma unroll
        for (int j = 0; j < BLOCK_N / 16; ++j)
            Traits::DqGemm::ss_bt(dq, ds_rows + fa::k_major_step<SWIZZLE_BYTES, BLOCK_M>(j),
                                  k_columns + fa::mn_major_step<SWIZZLE_BYTES>(j), j > 0);
        fa::wgmma_commit();
#pragma unroll
        for (int j = 0; j < BLOCK_M / 16; ++j)
            Traits::DkvGemm::rs(dk_acc, ds_frag[j], q_mn_major + fa::mn_major_step<SWIZZLE_BYTES>(j),
                                1);
        fa::wgmma_commit();
        fa::wgmma_wait<1>();  // dV and dQ have landed; dK may still run
        fa::fence_registers<DQ_REGS>(dq);
        fa::fence_registers<DKV_REGS>(dv_acc);

        // ---- dQ out: each warp stages its 16 rows of the warpgroup's share in shared memory
        // (once its last reduction has read them) in register order, then lane 0 hands the
        // 16 x DQ_N floats to the TMA unit: one bulk add.f32 into the tiled accumulator, whose
        // (bh, query block) tile is [warpgroup][warp][chunk][lane][4] (backward_dq_tiled)
        const uint32_t staging = base + DQ_OFFSET + (4 * wg + warp) * DQ_WARP_BYTES;
        if (lane == 0) fa::bulk_wait_read<0>();
        __syncwarp();
#pragma unroll
        for (int c = 0; c < DQ_N / 8; ++c)
            fa::st_shared_v4_f32(staging + (32 * c + lane) * 16, dq[4 * c], dq[4 * c + 1],
                                 dq[4 * c + 2], dq[4 * c + 3]);
        fa::fence_proxy_async_shared();  // the stores, before the TMA reads them
        __syncwarp();
        if (lane == 0) {
            float* tile = dq_accum + ((size_t)bh * (rows_padded / BLOCK_M) + m_block) * BLOCK_M * HEAD_DIM;
            fa::bulk_reduce_add_f32(tile + (4 * wg + warp) * (DQ_WARP_BYTES / 4), staging,
                                    DQ_WARP_BYTES);
            fa::bulk_commit();
#if DETERMINISTIC
            fa::bulk_wait<0>();  // performed, before the turn passes on
#endif
        }
#if DETERMINISTIC
        __threadfence();
        __syncthreads();
        if (tid == 0) fa::red_release_add(counter, 1);
#endif
        // dK has landed: this stage's Q and the dS fragments are free (the next iteration's
        // barrier hands the stage to the loads)
        fa::wgmma_wait<0>();
        fa::fence_registers<DKV_REGS>(dk_acc);
        fence_fragments(ds_frag);
    }
    fa::cp_async_wait<0>();
    if (lane == 0) fa::bulk_wait<0>();  // the staging stays until the last reduction has read it

    // ---- epilogue: dK (scaled) and dV of the warp's keys; with several shares of the group,
    // float32 partials that wgmma_f16_bwd_dkv sums.
    const float scale = scale_log2 * fa::kLn2;
    const int splits = gridDim.y;
    const size_t partial_half = (size_t)gridDim.z * splits * kv_len * HEAD_DIM;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int key = warp_key0 + fa::fragment_row(lane, half);
        if (key >= kv_len) continue;
        if (splits == 1) {
            const size_t at = ((size_t)block.kv_bh * kv_len + key) * HEAD_DIM;
            fa::store_fragment_row<HEAD_DIM / 8>(dk + at, dk_acc, half, scale, lane);
            fa::store_fragment_row<HEAD_DIM / 8>(dv + at, dv_acc, half, 1.f, lane);
        } else {
            const size_t at =
                (((size_t)block.kv_bh * splits + blockIdx.y) * kv_len + key) * HEAD_DIM;
            fa::store_fragment_row<HEAD_DIM / 8>(dkv_partial + at, dk_acc, half, scale, lane);
            fa::store_fragment_row<HEAD_DIM / 8>(dkv_partial + partial_half + at, dv_acc, half,
                                                 1.f, lane);
        }
    }
}

// ---------------------------------------------------------------- the other launches

extern "C" __global__ void __launch_bounds__(fa::kPreprocessThreads)
wgmma_f16_bwd_preprocess(const elem_t* __restrict__ out, const elem_t* __restrict__ dout,
                         const float* __restrict__ lse, float* __restrict__ lse_log2,
                         float* __restrict__ delta, float* __restrict__ dq_accum,
                         int* __restrict__ counters, int seq_len, int batch_heads) {
    fa::backward_preprocess<elem_t, HEAD_DIM, BLOCK_M, /*TiledAccumulator=*/true>(
        out, dout, lse, lse_log2, delta, dq_accum, counters, seq_len, batch_heads);
}

extern "C" __global__ void __launch_bounds__(fa::kPostprocessThreads)
wgmma_f16_bwd_dq(const float* __restrict__ dq_accum, elem_t* __restrict__ dq, int seq_len,
                 int batch_heads, float scale) {
    fa::backward_dq_tiled<elem_t, HEAD_DIM, BLOCK_M>(dq_accum, dq, seq_len, batch_heads, scale);
}

extern "C" __global__ void __launch_bounds__(fa::kPostprocessThreads)
wgmma_f16_bwd_dkv(const float* __restrict__ partial, elem_t* __restrict__ dk,
                  elem_t* __restrict__ dv, int kv_len, int splits, int batch_kv_heads) {
    fa::backward_dkv_sum<elem_t, HEAD_DIM>(partial, dk, dv, kv_len, splits, batch_kv_heads);
}

extern "C" __global__ void __launch_bounds__(fa::kSinkThreads)
wgmma_f16_bwd_sinks(const float* __restrict__ lse_log2, const float* __restrict__ delta,
                    const float* __restrict__ sinks, float* __restrict__ d_sinks, int seq_len,
                    int batch, int heads) {
    fa::backward_sink_gradient<BLOCK_M>(lse_log2, delta, sinks, d_sinks, seq_len, batch, heads);
}
