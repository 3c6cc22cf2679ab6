// The split-KV contract every tiled family keeps (and the planner's families mirror in
// tuner/planner/key_span.py): which block computes what, and which keys it visits.
//
//   grid = (row blocks, splits, heads): blockIdx.x a block of BLOCK_M query rows, blockIdx.y
//   a split of the key range, blockIdx.z a (batch, head) (a (batch, KV head) for decode);
//   query head bh reads KV head bh / group (grouped-query attention);
//   split s covers keys [base + s * keys_per_split, base + (s + 1) * keys_per_split), base the
//   first key the mask lets any row see (0 without a window); keys_per_split is a multiple
//   of the key tile, so a split's tiles never cross into the next split;
//   a block visits the tiles of its split that its rows can see: from the tile holding its
//   first row's first visible key to its last row's last one.
#pragma once

#include "fa/score_mod.cuh"

namespace fa {

struct BlockCoordinates {
    int m_block;  // row block
    int bh;       // batch * heads + head (or batch * kv_heads + kv head)
};

// Work item `linear` of row_blocks x bh_count (row blocks fastest). Under causal masking the
// row blocks near the end of the sequence carry the most keys: HEAVIEST_FIRST hands them out
// first, across every (batch, head), so the last wave holds the light blocks.
template <bool HeaviestFirst>
__device__ __forceinline__ BlockCoordinates work_coordinates(int linear, int row_blocks,
                                                             int bh_count) {
    if (HeaviestFirst) return {row_blocks - 1 - linear / bh_count, linear % bh_count};
    return {linear % row_blocks, linear / row_blocks};
}

// A block's own work item: its place in launch order (blockIdx.x varies fastest).
template <bool HeaviestFirst>
__device__ __forceinline__ BlockCoordinates block_coordinates() {
    if (HeaviestFirst)
        return work_coordinates<true>(blockIdx.z * gridDim.x + blockIdx.x, gridDim.x, gridDim.z);
    return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.z)};
}

// Tile t of a block covers keys [begin + t * BlockN, begin + (t + 1) * BlockN) clipped at
// `end`; count tiles in all.
struct KeyTiles {
    int begin;
    int end;
    int count;
};

// The tiles of a key range [range_begin, range_end) (a split, or a work item's keys) that rows
// [row_first, row_last] see: tile-aligned from range_begin, ending at the last visible key.
template <int BlockN, class MaskT>
__device__ __forceinline__ KeyTiles key_tiles_in(const MaskT& mask, int range_begin,
                                                 int range_end, int row_first, int row_last) {
    const int end = min(min(mask.kv_len, range_end), mask.end_key(row_last));
    int begin = range_begin;
    const int first = mask.first_key(row_first);
    if (first > begin) begin += (first - begin) / BlockN * BlockN;  // whole tiles skipped
    const int count = end > begin ? (end - begin + BlockN - 1) / BlockN : 0;
    return {begin, end, count};
}

template <int BlockN, class MaskT>
__device__ __forceinline__ KeyTiles key_tiles(const MaskT& mask, int split, int keys_per_split,
                                              int row_first, int row_last) {
    const int split_begin = mask.split_base() + split * keys_per_split;
    return key_tiles_in<BlockN>(mask, split_begin, split_begin + keys_per_split, row_first,
                                row_last);
}

// A prefill block's place in the contract: its (batch, head) and KV head, its rows, its split
// and the key tiles it visits, and the score modification of its head. Variant: the family's
// traits (fa::Variant), whose mask and score modification it uses.
template <class Variant, int BlockM, int BlockN>
struct RowBlock {
    typename Variant::MaskType mask;
    int bh;      // batch * heads + head
    int kv_bh;   // batch * kv_heads + the KV head it reads (bh / group)
    int row0;    // first query row
    int split;   // this block's split of the key range, of `splits`
    int splits;
    KeyTiles tiles;

    // This block's own: its launch coordinates (grid = (row blocks, splits, heads)).
    __device__ __forceinline__ RowBlock(int seq_len, int kv_len, int group, int keys_per_split,
                                        int window_left, int window_right)
        : RowBlock(block_coordinates<Variant::kCausal>(), blockIdx.y, gridDim.y, seq_len,
                   kv_len, group, keys_per_split, window_left, window_right) {}

    // A given one (a persistent block's work item).
    __device__ __forceinline__ RowBlock(BlockCoordinates at, int split_, int splits_,
                                        int seq_len, int kv_len, int group, int keys_per_split,
                                        int window_left, int window_right)
        : mask(seq_len, kv_len, window_left, window_right) {
        bh = at.bh;
        kv_bh = at.bh / group;
        row0 = at.m_block * BlockM;
        split = split_;
        splits = splits_;
        tiles = key_tiles<BlockN>(mask, split, keys_per_split, row0, row0 + BlockM - 1);
    }

    // The score modification of this block's head (heads: query heads a batch holds).
    __device__ __forceinline__ typename Variant::ScoreModType score_mod(
        float scale_log2, float softcap, int seq_len, int kv_len, const float* alibi_slopes,
        int heads) const {
        typename Variant::ScoreModType mod(scale_log2, softcap, seq_len, kv_len);
        mod.set_heads(alibi_slopes, bh % heads, bh % heads);
        return mod;
    }
};

}  // namespace fa
