// The split merge every split-KV family launches (FlashAttention-3's combine kernel): the
// float32 partials of `splits` key ranges of each row, each normalised by its own sum, with
// their log2-sum-exps, combined as
//   out[row] = sum_s 2^(lse_s - M) o_s / (sum_s 2^(lse_s - M) + 2^(sink - M)),
//   M = max(max_s lse_s, sink),
// the sink (one logit per head, joining the denominator only) where there are sinks, and the
// row's natural-log LSE written where asked. A split that saw no key of the row has lse -inf
// and weighs nothing. One thread a float4 of output; 128-thread blocks.
//
//   partial rows: ((bh * splits + s) * seq_len + r), bh = batch * heads + head.
#pragma once

#include "fa/dtype.cuh"
#include "fa/ptx.cuh"
#include "fa/softmax.cuh"

namespace fa {

constexpr int kMergeThreads = 128;

template <typename Out, int HeadDim>
__device__ __forceinline__ void merge_splits(const float* __restrict__ partial_o,
                                             const float* __restrict__ partial_lse,
                                             Out* __restrict__ out, int seq_len, int splits,
                                             int total_rows, int heads,
                                             const float* __restrict__ sinks,
                                             float* __restrict__ lse) {
    constexpr int kVecsPerRow = HeadDim / 4;
    const long long vec = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec >= (long long)total_rows * kVecsPerRow) return;
    const int global_row = (int)(vec / kVecsPerRow);
    const int col = (int)(vec % kVecsPerRow) * 4;
    const int bh = global_row / seq_len;
    const int row = global_row % seq_len;
    const size_t base = (size_t)bh * splits * seq_len + row;
    const float sink = sink_log2(sinks, bh % heads);

    float lse_max = sink;
    for (int s = 0; s < splits; ++s)
        lse_max = fmaxf(lse_max, partial_lse[base + (size_t)s * seq_len]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float weight_sum = 0.f;
    if (lse_max != -INFINITY) {
        for (int s = 0; s < splits; ++s) {
            const size_t r = base + (size_t)s * seq_len;
            const float w = fast_exp2(partial_lse[r] - lse_max);
            const float4 o = *reinterpret_cast<const float4*>(partial_o + r * HeadDim + col);
            acc.x += w * o.x;
            acc.y += w * o.y;
            acc.z += w * o.z;
            acc.w += w * o.w;
            weight_sum += w;
        }
    }
    if (sink != -INFINITY) weight_sum += fast_exp2(sink - lse_max);
    const float inv = weight_sum > 0.f ? 1.f / weight_sum : 0.f;
    store_quad<Out>(out + (size_t)global_row * HeadDim + col,
                    make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
    if (lse != nullptr && col == 0)
        lse[global_row] = lse_natural(weight_sum > 0.f ? lse_max + __log2f(weight_sum) : -INFINITY);
}

}  // namespace fa
