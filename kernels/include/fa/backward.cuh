// The backward pass's half of the shared device layer (FlashAttention-2's backward): a block
// owns one tile of keys of one KV head and loops over the query blocks that see it, so its
// dK and dV stay in registers, while dQ is added to a float32 accumulator. What every
// backward family shares is written here once:
//
//   * which query blocks a key tile visits (KeyBlock), the device half of
//     tuner/planner/backward_span.py, and the order in which key tiles add to a query
//     block's dQ in the deterministic mode (dq_turn);
//   * the preprocess: D = rowsum(dO * O) in fp32, each row's LSE in the log2 domain, the dQ
//     accumulators and the deterministic mode's counters zeroed;
//   * the postprocesses: dQ scaled and cast, the dK/dV partials of a group's query heads
//     summed, and the attention sinks' gradient.
//
// Conventions (FlashAttention's): the forward's LSE is the natural-log log-sum-exp of each
// row's logits (+inf for a row that sees no key); P = exp(logit - LSE); dP = dO V^T,
// D = rowsum(dO * O) = rowsum(P * dP), dS = P * (dP - D) * d logit / d (s * scale),
// dQ = scale * dS K, dK = scale * dS^T Q, dV = P^T dO. With a sink (a logit per head in the
// denominator only), P_sink = exp(sink - LSE) and d sink = -sum over rows of P_sink * D.
//
// Grid of the main kernel: (key tiles, splits of the group, batch * kv_heads); block
// (n, s, b * kv_heads + j) visits query heads j * group + s * group / splits + g for
// g < group / splits. Buffers (float32, rows padded to whole query blocks, rows_padded =
// round_up(seq_len, BlockM)): lse_log2 and delta [batch * heads][rows_padded] (padded rows:
// lse +inf, D 0, so their P is 0), dq_accum [batch * heads][seq_len][head_dim] (or tiled,
// [batch * heads][rows_padded * head_dim] in backward_dq_tiled's order), the
// deterministic mode's counters [batch * heads][rows_padded / BlockM].
#pragma once

#include <math.h>

#include "fa/dtype.cuh"
#include "fa/mask.cuh"
#include "fa/ptx.cuh"
#include "fa/score_mod.cuh"
#include "fa/softmax.cuh"

namespace fa {

// Query rows padded to whole blocks of BlockM: the row count of lse_log2, delta.
template <int BlockM>
__device__ __forceinline__ int padded_rows(int seq_len) {
    return (seq_len + BlockM - 1) / BlockM * BlockM;
}

// Query blocks [begin, end) of BlockM rows.
struct QueryBlocks {
    int begin;
    int end;
};

// The query blocks that see some key of [key0, key0 + BlockN) (clipped at kv_len): row r sees
// keys [r + low, r + high], so the rows that see some key of the tile are
// [key0 - high, key_last - low], one interval (the mask's band is monotone).
template <int BlockM, int BlockN, class MaskT>
__device__ __forceinline__ QueryBlocks visiting_query_blocks(const MaskT& mask, int seq_len,
                                                             int key0) {
    const int blocks = (seq_len + BlockM - 1) / BlockM;
    if (!MaskT::kBanded) return {0, blocks};
    const int key_last = min(key0 + BlockN, mask.kv_len) - 1;
    const int first_row = max(0, key0 - mask.high);
    const int last_row = min(seq_len - 1, key_last - mask.low);
    if (first_row > last_row) return {0, 0};
    return {first_row / BlockM, last_row / BlockM + 1};
}

// Deterministic dQ: the key tiles that visit query block m are the tiles
// [first_key(m's first row) / BlockN, ...], one interval; tile n adds its share of m's dQ when
// the block's counter reaches the number of tiles before it in that interval, so the sums
// run in key-tile order whatever the schedule. Tiles wait only on lower-numbered tiles, which
// launch earlier (blockIdx.x is the fastest launch dimension): no deadlock.
template <int BlockM, int BlockN, class MaskT>
__device__ __forceinline__ int dq_turn(const MaskT& mask, int key_tile, int m_block) {
    return key_tile - mask.first_key(m_block * BlockM) / BlockN;
}

// A backward block's place in the grid: its key tile, KV head, the query heads of its share
// of the group, and the (head, query block) iterations it runs.
template <class Variant, int BlockM, int BlockN>
struct KeyBlock {
    typename Variant::MaskType mask;
    int key_tile;  // n
    int key0;      // its first key
    int kv_bh;     // batch * kv_heads + KV head
    int bh0;       // batch * heads + the first query head it visits
    QueryBlocks queries;
    int count;  // iterations: (group / splits) heads x the visiting query blocks

    __device__ __forceinline__ KeyBlock(int seq_len, int kv_len, int group, int window_left,
                                        int window_right)
        : mask(seq_len, kv_len, window_left, window_right) {
        key_tile = blockIdx.x;
        key0 = key_tile * BlockN;
        kv_bh = blockIdx.z;
        const int heads_per_block = group / static_cast<int>(gridDim.y);
        bh0 = kv_bh * group + static_cast<int>(blockIdx.y) * heads_per_block;
        queries = visiting_query_blocks<BlockM, BlockN>(mask, seq_len, key0);
        count = heads_per_block * (queries.end - queries.begin);
    }
    // Iteration it: the query head (bh) and the query block (m). A head's blocks are visited
    // last first: under a causal mask every key tile's range ends at the last block, so the
    // tiles visit block m at the same iteration and the deterministic mode's key-tile order
    // costs each step a short chain of turns; first to last, key tile n would reach the last
    // block n * BlockN / BlockM iterations after tile 0 and wait that long at its first turn.
    __device__ __forceinline__ int bh_of(int it) const {
        return bh0 + it / (queries.end - queries.begin);
    }
    __device__ __forceinline__ int m_block_of(int it) const {
        return queries.end - 1 - it % (queries.end - queries.begin);
    }
};

// ---------------------------------------------------------------- P^T and dS^T

// The elementwise step of every backward family, on the transposed (key-major) products of
// one warp's 16 keys against QChunks n8 chunks of queries, in the m16n8 accumulator layout
// that mma.sync and wgmma share (keys as rows): S^T (raw q.k) becomes P^T = exp2(logit2 -
// lse2) (0 where masked) and dP^T becomes dS^T = P^T (dP^T - D), times the softcap's
// derivative. Element i of chunk c is key key_base + lane / 4 + 8 (i / 2), query query_base +
// 8 c + 2 (lane % 4) + i % 2; s_lse and s_delta hold the queries' lse_log2 and D from
// query_base on (padded rows: +inf and 0, so their P is 0). `partial`: some pair of the tile
// may be hidden (Mask::partial), so each element is tested.

// One element's probability; `derivative` gets d logit / d (x * scale) (1 without a softcap).
template <class Variant>
__device__ __forceinline__ float transposed_probability(
    float x, const typename Variant::ScoreModType& score_mod,
    const typename Variant::MaskType& mask, bool partial, int key, int query, float lse2,
    float scale_log2, float& derivative) {
    derivative = 1.f;
    const float logit2 = Variant::ScoreModType::kActive
                             ? score_mod.logit(x, query, key, 0, derivative)
                             : x * scale_log2;
    const float p = fast_exp2(logit2 - lse2);
    return partial && !mask.visible(query, key) ? 0.f : p;
}

// Both at once: st becomes P^T, dpt becomes dS^T.
template <class Variant, int QChunks>
__device__ __forceinline__ void transposed_gradients(
    float* st, float* dpt, const typename Variant::ScoreModType& score_mod,
    const typename Variant::MaskType& mask, bool partial, int key_base, int query_base,
    const float* s_lse, const float* s_delta, float scale_log2, int lane) {
#pragma unroll
    for (int c = 0; c < QChunks; ++c) {
        const int local = 8 * c + fragment_column(lane);
        const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + local);
        const float2 d = *reinterpret_cast<const float2*>(s_delta + local);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float derivative;
            const float p = transposed_probability<Variant>(
                st[4 * c + i], score_mod, mask, partial, key_base + fragment_row(lane, i / 2),
                query_base + local + i % 2, i % 2 ? lse2.y : lse2.x, scale_log2, derivative);
            float ds = p * (dpt[4 * c + i] - (i % 2 ? d.y : d.x));
            if (Variant::kSoftcap) ds *= derivative;
            st[4 * c + i] = p;
            dpt[4 * c + i] = ds;
        }
    }
}

// In two passes, so a product of P^T can start before dS^T exists. The first: P^T packed into
// the 16-bit A fragments of the QChunks / 2 k16 steps (p_frag: chunks 2 j and 2 j + 1), and st
// left holding P^T times the softcap's derivative (what dS^T multiplies) ...
template <class Variant, int QChunks>
__device__ __forceinline__ void transposed_probabilities(
    float* st, uint32_t (*p_frag)[4], const typename Variant::ScoreModType& score_mod,
    const typename Variant::MaskType& mask, bool partial, int key_base, int query_base,
    const float* s_lse, float scale_log2, int lane) {
#pragma unroll
    for (int j = 0; j < QChunks / 2; ++j) {
        float derivative[8];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = 2 * j + h;
            const int local = 8 * c + fragment_column(lane);
            const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + local);
#pragma unroll
            for (int i = 0; i < 4; ++i)
                st[4 * c + i] = transposed_probability<Variant>(
                    st[4 * c + i], score_mod, mask, partial, key_base + fragment_row(lane, i / 2),
                    query_base + local + i % 2, i % 2 ? lse2.y : lse2.x, scale_log2,
                    derivative[4 * h + i]);
        }
        pack_a_fragment<typename Variant::Elem>(st + 8 * j, p_frag[j]);
        if (Variant::kSoftcap)
#pragma unroll
            for (int i = 0; i < 8; ++i) st[8 * j + i] *= derivative[i];
    }
}

// ... the second: dS^T = st (dP^T - D) in place of dP^T.
template <int QChunks>
__device__ __forceinline__ void transposed_score_gradients(const float* st, float* dpt,
                                                           const float* s_delta, int lane) {
#pragma unroll
    for (int c = 0; c < QChunks; ++c) {
        const float2 d = *reinterpret_cast<const float2*>(s_delta + 8 * c + fragment_column(lane));
#pragma unroll
        for (int i = 0; i < 4; ++i) dpt[4 * c + i] = st[4 * c + i] * (dpt[4 * c + i] - (i % 2 ? d.y : d.x));
    }
}

// ---------------------------------------------------------------- preprocess

// One warp per padded row: D = rowsum(dO * O) in fp32, LSE to the log2 domain, the row's dQ
// accumulator zeroed, its block's counter zeroed (counters: null outside the deterministic
// mode). 128-thread blocks.
constexpr int kPreprocessThreads = 128;

template <typename Elem, int HeadDim, int BlockM, bool TiledAccumulator = false>
__device__ __forceinline__ void backward_preprocess(const Elem* __restrict__ out,
                                                    const Elem* __restrict__ dout,
                                                    const float* __restrict__ lse,
                                                    float* __restrict__ lse_log2,
                                                    float* __restrict__ delta,
                                                    float* __restrict__ dq_accum,
                                                    int* __restrict__ counters, int seq_len,
                                                    int batch_heads) {
    const int rows_padded = padded_rows<BlockM>(seq_len);
    const long long row = static_cast<long long>(blockIdx.x) * (kPreprocessThreads / 32) +
                          threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= static_cast<long long>(batch_heads) * rows_padded) return;  // the whole warp
    const int bh = static_cast<int>(row / rows_padded);
    const int r = static_cast<int>(row % rows_padded);
    if (TiledAccumulator && lane < HeadDim / 4) {
        // the tiled accumulator has a padded row's worth of elements for every padded row:
        // row `row`'s zeroes its elements [row * HeadDim, (row + 1) * HeadDim), padding too
        reinterpret_cast<float4*>(dq_accum + static_cast<size_t>(row) * HeadDim)[lane] =
            make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (r >= seq_len) {
        if (lane == 0) {
            delta[row] = 0.f;
            lse_log2[row] = INFINITY;  // P = 0 on padded rows
        }
        return;
    }
    const size_t offset = (static_cast<size_t>(bh) * seq_len + r) * HeadDim;
    float dot = 0.f;
    for (int c = lane; c < HeadDim / 8; c += 32) {
        const uint4 o = *reinterpret_cast<const uint4*>(out + offset + 8 * c);
        const uint4 d = *reinterpret_cast<const uint4*>(dout + offset + 8 * c);
        const uint32_t os[4] = {o.x, o.y, o.z, o.w};
        const uint32_t ds[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 a = unpack_pair<Elem>(os[j]);
            const float2 b = unpack_pair<Elem>(ds[j]);
            dot = fmaf(a.x, b.x, fmaf(a.y, b.y, dot));
        }
    }
#pragma unroll
    for (int width = 16; width >= 1; width /= 2) dot += __shfl_xor_sync(0xffffffff, dot, width);
    if (!TiledAccumulator) {
        float4* accumulator = reinterpret_cast<float4*>(dq_accum + offset);
        for (int c = lane; c < HeadDim / 4; c += 32)
            accumulator[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (lane == 0) {
        delta[row] = dot;
        lse_log2[row] = lse[static_cast<size_t>(bh) * seq_len + r] * kLog2e;  // +inf stays +inf
        if (counters != nullptr && r % BlockM == 0)
            counters[static_cast<size_t>(bh) * (rows_padded / BlockM) + r / BlockM] = 0;
    }
}

// ---------------------------------------------------------------- postprocesses

constexpr int kPostprocessThreads = 128;

// dQ = scale * the float32 accumulator, in the input dtype: a thread per 4 values.
template <typename Elem>
__device__ __forceinline__ void backward_dq(const float* __restrict__ dq_accum,
                                            Elem* __restrict__ dq, int quads, float scale) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= quads) return;
    const float4 a = reinterpret_cast<const float4*>(dq_accum)[i];
    store_quad<Elem>(dq + 4 * i, make_float4(a.x * scale, a.y * scale, a.z * scale, a.w * scale));
}

// The same from a tiled accumulator (wgmma_f16_bwd's): [batch * heads][query block][warpgroup]
// [warp][n8 chunk][lane][4] for query blocks of BlockM = 64 rows and warpgroups of HeadDim / 2
// columns, i.e. each warp's m16 fragments of its 16 rows in register order (registers 4 c ..
// 4 c + 3 of lane l: rows l / 4 and l / 4 + 8, columns 8 c + 2 (l % 4) + 0, 1), which is what a
// warp stages for one bulk reduction. A thread per 4 values (one lane's chunk); rows past
// seq_len (the last block's padding) are dropped.
template <typename Elem, int HeadDim, int BlockM>
__device__ __forceinline__ void backward_dq_tiled(const float* __restrict__ dq_accum,
                                                  Elem* __restrict__ dq, int seq_len,
                                                  int batch_heads, float scale) {
    constexpr int kColumns = HeadDim / 2;       // a warpgroup's share
    constexpr int kChunks = kColumns / 8;       // n8 chunks of a warp's rows
    constexpr int kWarpQuads = kChunks * 32;    // quads of a warp's 16 rows
    constexpr int kBlockQuads = 2 * 4 * kWarpQuads;  // two warpgroups of four warps
    static_assert(BlockM == 64, "query blocks of one warpgroup's 64 rows");
    const int blocks = (seq_len + BlockM - 1) / BlockM;
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= static_cast<long long>(batch_heads) * blocks * kBlockQuads) return;
    const long long tile = i / kBlockQuads;  // bh * blocks + m
    int q = static_cast<int>(i % kBlockQuads);
    const int wg = q / (4 * kWarpQuads);
    q %= 4 * kWarpQuads;
    const int warp = q / kWarpQuads;
    q %= kWarpQuads;
    const int chunk = q / 32, lane = q % 32;
    const int bh = static_cast<int>(tile / blocks), m = static_cast<int>(tile % blocks);
    const int row = m * BlockM + 16 * warp + lane / 4;
    const int column = wg * kColumns + 8 * chunk + 2 * (lane % 4);
    const float4 a = reinterpret_cast<const float4*>(dq_accum)[i];
    Elem* out = dq + (static_cast<size_t>(bh) * seq_len + row) * HeadDim + column;
    if (row < seq_len) store_pair<Elem>(out, a.x * scale, a.y * scale);
    if (row + 8 < seq_len) store_pair<Elem>(out + 8 * HeadDim, a.z * scale, a.w * scale);
}

// dK and dV of each KV head: the sum of its `splits` float32 partials (one per share of the
// group's query heads), in split order. partial: [2][batch * kv_heads][splits][kv_len][HeadDim]
// (dK's, then dV's); a thread per 4 values of each.
template <typename Elem, int HeadDim>
__device__ __forceinline__ void backward_dkv_sum(const float* __restrict__ partial,
                                                 Elem* __restrict__ dk, Elem* __restrict__ dv,
                                                 int kv_len, int splits, int batch_kv_heads) {
    const long long quads = static_cast<long long>(batch_kv_heads) * kv_len * (HeadDim / 4);
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= quads) return;
    const long long row = i / (HeadDim / 4);  // kv_bh * kv_len + key
    const int col = static_cast<int>(i % (HeadDim / 4)) * 4;
    const long long kv_bh = row / kv_len;
    const long long key = row % kv_len;
    const size_t half = static_cast<size_t>(batch_kv_heads) * splits * kv_len * HeadDim;
    float4 sum_k = make_float4(0.f, 0.f, 0.f, 0.f), sum_v = sum_k;
    for (int s = 0; s < splits; ++s) {
        const size_t at = ((static_cast<size_t>(kv_bh) * splits + s) * kv_len + key) * HeadDim + col;
        const float4 a = *reinterpret_cast<const float4*>(partial + at);
        const float4 b = *reinterpret_cast<const float4*>(partial + half + at);
        sum_k = make_float4(sum_k.x + a.x, sum_k.y + a.y, sum_k.z + a.z, sum_k.w + a.w);
        sum_v = make_float4(sum_v.x + b.x, sum_v.y + b.y, sum_v.z + b.z, sum_v.w + b.w);
    }
    store_quad<Elem>(dk + 4 * i, sum_k);
    store_quad<Elem>(dv + 4 * i, sum_v);
}

// The gradient of each head's sink logit: -sum over its rows (every batch) of
// exp(sink - LSE) * D, in a fixed order (one warp per head: lanes stride the rows, then a
// butterfly). kSinkThreads threads a block, a block per head.
constexpr int kSinkThreads = 32;

template <int BlockM>
__device__ __forceinline__ void backward_sink_gradient(const float* __restrict__ lse_log2,
                                                       const float* __restrict__ delta,
                                                       const float* __restrict__ sinks,
                                                       float* __restrict__ d_sinks, int seq_len,
                                                       int batch, int heads) {
    const int head = blockIdx.x;
    const int rows_padded = padded_rows<BlockM>(seq_len);
    const float sink2 = sinks[head] * kLog2e;
    float sum = 0.f;
    for (long long i = threadIdx.x; i < static_cast<long long>(batch) * rows_padded;
         i += kSinkThreads) {
        const size_t row = (static_cast<size_t>(i / rows_padded) * heads + head) * rows_padded +
                           i % rows_padded;
        sum += fast_exp2(sink2 - lse_log2[row]) * delta[row];  // padded rows: 0 * 0
    }
#pragma unroll
    for (int width = 16; width >= 1; width /= 2) sum += __shfl_xor_sync(0xffffffff, sum, width);
    if (threadIdx.x == 0) d_sinks[head] = -sum;
}

}  // namespace fa
