// The split merge every split-KV family launches (FlashAttention-3's combine kernel): the
// float32 partials of `splits` key ranges of each row, each normalised by its own sum, with
// their log2-sum-exps, combined as
//   out[row] = sum_s 2^(lse_s - M) o_s / (sum_s 2^(lse_s - M) + 2^(sink - M)),
//   M = max(max_s lse_s, sink),
// the sink (one logit per head, joining the denominator only) where there are sinks, and the
// row's natural-log LSE written where asked. A split that saw no key of the row has lse -inf
// and weighs nothing. One thread a float4 of output; 128-thread blocks.
//
//   partial rows (merge_splits): ((bh * splits + s) * seq_len + r), bh = batch * heads + head;
//   a work list's (merge_work_list): one entry per token, its splits' rows at a stride.
#pragma once

#include "fa/dtype.cuh"
#include "fa/ptx.cuh"
#include "fa/softmax.cuh"

namespace fa {

constexpr int kMergeThreads = 128;

// One float4 (columns col .. col + 3) of one output row from `splits` partial rows
// first_row + s * row_stride and the sink logit (log2 domain, -inf for none); the row's
// natural-log LSE into *lse_out (nullable) by the thread of column 0.
template <typename Out, int HeadDim>
__device__ __forceinline__ void merge_partial_rows(const float* __restrict__ partial_o,
                                                   const float* __restrict__ partial_lse,
                                                   size_t first_row, size_t row_stride,
                                                   int splits, float sink, int col,
                                                   Out* __restrict__ out_row,
                                                   float* __restrict__ lse_out) {
    float lse_max = sink;
    for (int s = 0; s < splits; ++s)
        lse_max = fmaxf(lse_max, partial_lse[first_row + (size_t)s * row_stride]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float weight_sum = 0.f;
    if (lse_max != -INFINITY) {
        for (int s = 0; s < splits; ++s) {
            const size_t r = first_row + (size_t)s * row_stride;
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
    store_quad<Out>(out_row + col, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
    if (lse_out != nullptr && col == 0)
        *lse_out = lse_natural(weight_sum > 0.f ? lse_max + __log2f(weight_sum) : -INFINITY);
}

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
    merge_partial_rows<Out, HeadDim>(partial_o, partial_lse, base, (size_t)seq_len, splits,
                                     sink_log2(sinks, bh % heads), col,
                                     out + (size_t)global_row * HeadDim,
                                     lse != nullptr ? lse + global_row : nullptr);
}

// The merge of a work list (tuner/planner/work_list.py, kernels/serving_f16.cu): entry m of
// `entries` (token, splits, first partial row, split stride) merges each of the token's
// `heads` output rows (out row token * heads + h, from partial rows first + h + s * stride).
// One thread a float4 of output, entries [0, entry_count) of a fixed grid.
template <typename Out, int HeadDim>
__device__ __forceinline__ void merge_work_list(const float* __restrict__ partial_o,
                                                const float* __restrict__ partial_lse,
                                                Out* __restrict__ out,
                                                const int4* __restrict__ entries,
                                                int entry_count, int heads,
                                                const float* __restrict__ sinks,
                                                float* __restrict__ lse) {
    constexpr int kVecsPerRow = HeadDim / 4;
    const long long vec = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long per_entry = (long long)heads * kVecsPerRow;
    const long long m = vec / per_entry;
    if (m >= entry_count) return;
    const int head = (int)(vec % per_entry / kVecsPerRow);
    const int col = (int)(vec % kVecsPerRow) * 4;
    const int4 entry = entries[m];
    const size_t out_row = (size_t)entry.x * heads + head;
    merge_partial_rows<Out, HeadDim>(partial_o, partial_lse, (size_t)entry.z + head,
                                     (size_t)entry.w, entry.y, sink_log2(sinks, head), col,
                                     out + out_row * HeadDim,
                                     lse != nullptr ? lse + out_row : nullptr);
}

}  // namespace fa
