// What each query row sees, written once for every family (FlashAttention-3's mask.h).
//
// Row r sees key k when k < kv_len and, with CAUSAL or WINDOW, when k lies in the band
// [r + low, r + high] around the bottom-right diagonal (off = kv_len - seq_len):
//   low  = off - window_left                          (WINDOW with window_left >= 0)
//   high = off (CAUSAL), else off + window_right      (WINDOW with window_right >= 0)
// An open side is kOpen away, so the band tests need no branch. Without CAUSAL and WINDOW
// every bound folds to a constant and only the kv_len test remains.
//
// Coordinates of a thread's scores follow the m16n8 accumulator layout that mma.sync
// (m16n8k16, m16n8k8) and wgmma (m64nN, a warp's 16 rows) share: s[4 c + 2 half + j] is
// row rows[half] (lane / 4 and lane / 4 + 8 of the tile) and key key0 + 8 c + 2 (lane % 4) + j.
#pragma once

#include <math.h>

#include "fa/fragment.cuh"

namespace fa {

template <bool Causal, bool Window>
struct Mask {
    static constexpr bool kBanded = Causal || Window;
    static constexpr int kOpen = 1 << 30;

    int kv_len;
    int low;   // row r sees keys >= r + low
    int high;  // and keys <= r + high

    __device__ __forceinline__ Mask(int seq_len, int kv_len_, int window_left, int window_right)
        : kv_len(kv_len_) {
        const int off = kv_len_ - seq_len;
        low = (Window && window_left >= 0) ? off - window_left : -kOpen;
        high = Causal ? off : ((Window && window_right >= 0) ? off + window_right : kOpen);
    }

    // The first key any row of the problem sees (row 0's): where split 0 starts, so splits
    // cover only the keys the window leaves.
    __device__ __forceinline__ int split_base() const { return Window ? max(0, low) : 0; }
    // The first key row `row` sees, and one past its last.
    __device__ __forceinline__ int first_key(int row) const {
        return Window ? max(0, row + low) : 0;
    }
    __device__ __forceinline__ int end_key(int row) const {
        return kBanded ? min(kv_len, row + high + 1) : kv_len;
    }

    // Whether the key lies in the row's band (the causal diagonal and the window; every key
    // without them), for callers that bound keys by kv_len themselves ...
    __device__ __forceinline__ bool in_band(int row, int key) const {
        bool seen = true;
        if (kBanded) seen = key <= row + high;
        if (Window) seen = seen && key >= row + low;
        return seen;
    }
    // ... and whether the row sees the key at all.
    __device__ __forceinline__ bool visible(int row, int key) const {
        return key < kv_len && in_band(row, key);
    }
    // Keys [key0, key0 + keys) against rows [row_first, row_last]: whether some pair is
    // hidden (the scores need per-element masking) ...
    __device__ __forceinline__ bool partial(int key0, int keys, int row_first, int row_last) const {
        bool hidden = key0 + keys > kv_len;
        if (kBanded) hidden = hidden || key0 + keys - 1 > row_first + high;
        if (Window) hidden = hidden || key0 < row_last + low;
        return hidden;
    }
    // ... and whether every pair is hidden (the rows skip the tile).
    __device__ __forceinline__ bool skipped(int key0, int keys, int row_first, int row_last) const {
        bool hidden = false;
        if (kBanded) hidden = key0 > row_last + high;
        if (Window) hidden = hidden || key0 + keys - 1 < row_first + low;
        return hidden;
    }

    // -inf for every hidden score of NChunks n8 chunks starting at key0.
    template <int NChunks>
    __device__ __forceinline__ void apply(float* s, int key0, const FragmentRows& rows,
                                          int lane) const {
#pragma unroll
        for (int c = 0; c < NChunks; ++c)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = key0 + 8 * c + 2 * (lane % 4) + (i % 2);
                if (!visible(rows[i / 2], key)) s[4 * c + i] = -INFINITY;
            }
    }
};

}  // namespace fa
