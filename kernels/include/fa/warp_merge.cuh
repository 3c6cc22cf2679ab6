// Warps that scored different key slices of the same rows merge their online-softmax states
// through shared memory (FlashDecoding's in-block reduction): each warp stages its rows'
// unnormalised outputs, running max and sum (stage_rows), then every row is combined across
// the warps four output columns at a time (merge_row), weighting each warp by
// 2^(its max - the rows' max). What the caller does with the merged row (normalise, add a
// sink, write a split partial) is softmax.cuh's row_result / partial_result.
//
// Staged layout: row r of warp w at scratch + (w * rows_per_warp_slot + r) * Stride floats:
// HeadDim accumulators, then the max, then the sum (Stride >= HeadDim + 2).
#pragma once

#include <math.h>

#include "fa/fragment.cuh"
#include "fa/ptx.cuh"
#include "fa/softmax.cuh"

namespace fa {

// This warp's MTiles m16 tiles of rows, from `rows` (its first staged row) on.
template <int MTiles, int DTiles, int HeadDim, int Stride>
__device__ __forceinline__ void stage_rows(float* rows, SoftmaxRows (&softmax)[MTiles],
                                           const float (&o)[MTiles][DTiles][4], int lane) {
#pragma unroll
    for (int mt = 0; mt < MTiles; ++mt) {
        softmax[mt].finish();
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float* row = rows + (mt * 16 + fragment_row(lane, half)) * Stride;
            store_fragment_row<DTiles>(row, &o[mt][0][0], half, 1.f, lane);
            if (lane % 4 == 0) {
                row[HeadDim] = softmax[mt].max[half];
                row[HeadDim + 1] = softmax[mt].sum[half];
            }
        }
    }
}

struct MergedRow {
    float4 acc;   // sum over warps of weight * O (unnormalised), 4 columns
    float top;    // the rows' max over the warps (log2 domain)
    float total;  // sum over warps of weight * sum
    __device__ __forceinline__ float4 scaled(float inv) const {
        return make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    }
};

// Columns [col, col + 4) of staged row r over Warps warps whose slots are slot_rows apart.
template <int Warps, int HeadDim, int Stride>
__device__ __forceinline__ MergedRow merge_row(const float* scratch, int slot_rows, int r,
                                               int col) {
    MergedRow merged{make_float4(0.f, 0.f, 0.f, 0.f), -INFINITY, 0.f};
#pragma unroll
    for (int w = 0; w < Warps; ++w)
        merged.top = fmaxf(merged.top, scratch[(w * slot_rows + r) * Stride + HeadDim]);
    const float base = merged.top == -INFINITY ? 0.f : merged.top;
#pragma unroll
    for (int w = 0; w < Warps; ++w) {
        const float* row = scratch + (w * slot_rows + r) * Stride;
        const float weight = fast_exp2(row[HeadDim] - base);
        const float4 o = *reinterpret_cast<const float4*>(row + col);
        merged.acc.x += weight * o.x;
        merged.acc.y += weight * o.y;
        merged.acc.z += weight * o.z;
        merged.acc.w += weight * o.w;
        merged.total += weight * row[HeadDim + 1];
    }
    return merged;
}

}  // namespace fa
