// The online softmax (FlashAttention-3's softmax.h), in fp32 on exp2, for rows of the m16n8
// accumulator layout: a thread holds two rows of each m16 tile (half 0: lane / 4, half 1:
// lane / 4 + 8), s[4 c + 2 half + j] for n8 chunk c, and the four lanes of a quad share a row.
//
// Per tile: the running max moves to the tile's, the scores become P = 2^(s * scale - max)
// in place, the running sum is rescaled and grows, and `correction` is the factor the output
// accumulators' rows must be scaled by before P V is added. At the end, `finish` completes
// each row's sum across its quad and `row_result` gives the normaliser and log2-sum-exp,
// with an attention sink (one logit per head that joins the denominator only) when asked.
#pragma once

#include <math.h>

#include "fa/ptx.cuh"

namespace fa {

// Rescale slack, log2 units (FlashAttention-4's conditional rescaling; a family's tunable,
// wgmma_f16's rescale_slack): the running max moves only when a tile's max passes it by more
// than the slack; P then stays below 2^slack (exact all the same: the sum and the output share
// the stale max, and 2^8 is far inside fp16's and bf16's range), the correction is exactly 1
// and the output's rescale can be skipped (rescale_rows_if_moved). 0: the max moves whenever
// a tile's is larger.
#ifndef FA_RESCALE_SLACK
#define FA_RESCALE_SLACK 0
#endif

struct SoftmaxRows {
    float max[2];  // running max, log2 domain (scaled); -inf until a row sees a key
    float sum[2];  // this thread's share of the running sum (the quad's after finish())

    __device__ __forceinline__ SoftmaxRows() {
        max[0] = max[1] = -INFINITY;
        sum[0] = sum[1] = 0.f;
    }

    // One tile of NChunks n8 chunks; `scale` multiplies scores into the log2 domain
    // (ScoreMod::softmax_scale: 1 when the scores are logits already).
    template <int NChunks>
    __device__ __forceinline__ void update(float* s, float scale, float (&correction)[2]) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int c = 0; c < NChunks; ++c)
                tile_max = fmaxf(tile_max, fmaxf(s[4 * c + 2 * half], s[4 * c + 2 * half + 1]));
            tile_max = quad_max(tile_max);
#if FA_RESCALE_SLACK > 0
            // (-inf + slack is -inf: a row's first visible key always moves it)
            const bool moved = tile_max * scale > max[half] + float(FA_RESCALE_SLACK);
            const float new_max = moved ? tile_max * scale : max[half];
#else
            const float new_max = fmaxf(max[half], tile_max * scale);
            const bool moved = true;
#endif
            // A row with no visible key yet keeps max -inf: subtract 0, not -inf.
            const float base = new_max == -INFINITY ? 0.f : new_max;
            correction[half] = moved ? fast_exp2(max[half] - base) : 1.f;
            max[half] = new_max;
            float tile_sum = 0.f;
#pragma unroll
            for (int c = 0; c < NChunks; ++c) {
                const float p0 = fast_exp2(s[4 * c + 2 * half] * scale - base);
                const float p1 = fast_exp2(s[4 * c + 2 * half + 1] * scale - base);
                s[4 * c + 2 * half] = p0;
                s[4 * c + 2 * half + 1] = p1;
                tile_sum += p0 + p1;
            }
            sum[half] = sum[half] * correction[half] + tile_sum;
        }
    }

    __device__ __forceinline__ void finish() {
        sum[0] = quad_sum(sum[0]);
        sum[1] = quad_sum(sum[1]);
    }
};

// Output rows in the same layout (DChunks n8 chunks) scaled by their row's correction.
template <int DChunks>
__device__ __forceinline__ void rescale_rows(float* o, const float (&correction)[2]) {
#pragma unroll
    for (int c = 0; c < DChunks; ++c) {
        o[4 * c + 0] *= correction[0];
        o[4 * c + 1] *= correction[0];
        o[4 * c + 2] *= correction[1];
        o[4 * c + 3] *= correction[1];
    }
}

// rescale_rows; with FA_RESCALE_SLACK, skipped by the whole warp when no row of it moved its
// max (a correction of exactly 1 everywhere: the slack makes that the common case).
template <int DChunks>
__device__ __forceinline__ void rescale_rows_if_moved(float* o, const float (&correction)[2]) {
    if (FA_RESCALE_SLACK == 0 ||
        __any_sync(0xffffffff, correction[0] != 1.f || correction[1] != 1.f))
        rescale_rows<DChunks>(o, correction);
}

// The online softmax of a warp's MTiles m16 tiles of scores (P replaces S) and the rescale
// of their output rows, tile by tile.
template <int MTiles, int NTiles, int DTiles>
__device__ __forceinline__ void update_tiles(SoftmaxRows (&softmax)[MTiles],
                                             float (&s)[MTiles][NTiles][4],
                                             float (&o)[MTiles][DTiles][4], float scale) {
#pragma unroll
    for (int mt = 0; mt < MTiles; ++mt) {
        float correction[2];
        softmax[mt].template update<NTiles>(&s[mt][0][0], scale, correction);
        rescale_rows<DTiles>(&o[mt][0][0], correction);
    }
}

// A finished row: output = accumulator * inv; lse2 its log2-sum-exp (-inf: no weight at all).
struct RowResult {
    float inv;
    float lse2;
};

// From a row's running max and (quad-complete) sum. `sink2`: the row's sink logit in the
// log2 domain, or -inf for none; it joins the denominator, not the output.
__device__ __forceinline__ RowResult row_result(float max, float sum, float sink2) {
    if (sink2 == -INFINITY) {
        return {sum > 0.f ? 1.f / sum : 0.f, sum > 0.f ? max + __log2f(sum) : -INFINITY};
    }
    const float top = fmaxf(max, sink2);
    const float factor = fast_exp2(max - top);  // 0 for a row that saw no key
    const float total = sum * factor + fast_exp2(sink2 - top);
    return {factor / total, top + __log2f(total)};
}

// A row's split partial: the output normalised by the split's own sum and the split's
// log2-sum-exp, which the merge weighs (sinks join there, once).
__device__ __forceinline__ RowResult partial_result(float max, float sum) {
    return row_result(max, sum, -INFINITY);
}

// The sink logit of a head in the log2 domain, or -inf where there are none.
__device__ __forceinline__ float sink_log2(const float* sinks, int head) {
    return sinks != nullptr ? sinks[head] * 1.4426950408889634f : -INFINITY;
}

// The natural-log log-sum-exp a caller (the backward pass) reads: +inf for a row with no
// weight, so that exp(s - lse) is 0 there (FlashAttention's convention).
__device__ __forceinline__ float lse_natural(float lse2) {
    return lse2 == -INFINITY ? INFINITY : lse2 * 0.6931471805599453f;
}

}  // namespace fa
