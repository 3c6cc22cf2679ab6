// Tiles global -> shared memory by cp.async, and the ring of K/V tiles the cp.async families
// stream keys through.
//
// A tile is Rows rows of HeadDim elements stored with RowStride elements a row (the
// families pad rows by 16 bytes so the eight rows one ldmatrix phase reads start in eight
// distinct bank groups). Every thread copies 16-byte chunks; rows at or past `valid_rows`
// are zero-filled (CheckRows: only a range's last tile needs the check).
#pragma once

#include "fa/ptx.cuh"

namespace fa {

template <typename T, int HeadDim, int RowStride, int Threads>
struct TileCopy {
    static constexpr int kChunkElems = 16 / static_cast<int>(sizeof(T));
    static constexpr int kChunksPerRow = HeadDim / kChunkElems;
    static constexpr int kRowsPerPass = Threads / kChunksPerRow;
    // Every thread keeps one column chunk and steps down the rows: one base address plus
    // compile-time offsets. Otherwise (e.g. head_dim 96 over 128 threads) a strided loop.
    static constexpr bool kRegular = kRowsPerPass >= 1 && Threads % kChunksPerRow == 0;
    static_assert(HeadDim % kChunkElems == 0, "rows are whole 16-byte chunks");

    template <int Rows, bool CheckRows>
    static __device__ __forceinline__ void load(T* smem, const T* gmem, int valid_rows, int tid) {
        if constexpr (kRegular) {
            const int row = tid / kChunksPerRow;
            const int col = (tid % kChunksPerRow) * kChunkElems;
            const uint32_t dst = smem_addr(smem + row * RowStride + col);
            const T* src = gmem + row * HeadDim + col;
#pragma unroll
            for (int pass = 0; pass < (Rows + kRowsPerPass - 1) / kRowsPerPass; ++pass) {
                const int r = row + pass * kRowsPerPass;
                if (Rows % kRowsPerPass != 0 && r >= Rows) break;
                const bool valid = !CheckRows || r < valid_rows;
                cp_async_16(dst + pass * kRowsPerPass * RowStride * static_cast<int>(sizeof(T)),
                            valid ? src : gmem, valid ? 16 : 0);
                // Step the pointer through an opaque register: otherwise the compiler
                // hoists one 64-bit address per pass out of the key loop and spills them.
                src += kRowsPerPass * HeadDim;
                opaque(src);
            }
        } else {
            for (int c = tid; c < Rows * kChunksPerRow; c += Threads) {
                const int r = c / kChunksPerRow;
                const int col = (c % kChunksPerRow) * kChunkElems;
                const bool valid = !CheckRows || r < valid_rows;
                cp_async_16(smem_addr(smem + r * RowStride + col),
                            valid ? gmem + r * HeadDim + col : gmem, valid ? 16 : 0);
            }
        }
    }
};

// Stages slots of a (K tile, V tile) pair of BlockN keys each, laid out K0 V0 K1 V1 ...
template <typename T, int HeadDim, int RowStride, int Threads, int BlockN, int Stages>
struct KVRing {
    static_assert(Stages >= 2, "the ring needs two stages");
    using Copy = TileCopy<T, HeadDim, RowStride, Threads>;
    static constexpr int kTileElems = BlockN * RowStride;
    static constexpr int kElems = 2 * Stages * kTileElems;

    T* base;

    __device__ __forceinline__ T* key_tile(int slot) const { return base + 2 * slot * kTileElems; }
    __device__ __forceinline__ T* value_tile(int slot) const { return key_tile(slot) + kTileElems; }

    // The pipeline. Tile t of a block's key range [begin, ...) lives in slot t % Stages;
    // each tile is one commit group. Before the loop: the first Stages - 1 tiles (after
    // whatever group the caller committed first, e.g. its Q tile).
    __device__ __forceinline__ void prefetch(int count, const T* k, const T* v, int begin,
                                             int valid_end, int tid) const {
#pragma unroll
        for (int s = 0; s < Stages - 1; ++s) {
            if (s < count) load(s, k, v, begin + s * BlockN, valid_end, tid);
            cp_async_commit();
        }
    }
    // At the top of iteration t: tile t has landed for this thread, the barrier makes it
    // everyone's and frees the slot of tile t - 1, which starts receiving tile
    // t + Stages - 1. (An empty commit group keeps the wait counts uniform.)
    __device__ __forceinline__ void advance(int t, int count, const T* k, const T* v, int begin,
                                            int valid_end, int tid) const {
        cp_async_wait<Stages - 2>();
        __syncthreads();
        const int next = t + Stages - 1;
        if (next < count) load(next % Stages, k, v, begin + next * BlockN, valid_end, tid);
        cp_async_commit();
    }

    // Keys [key0, key0 + BlockN) of one KV head (k, v: its first row) into `slot`; rows at
    // or past valid_end arrive as zeros. One commit group is the caller's.
    __device__ __forceinline__ void load(int slot, const T* k, const T* v, int key0,
                                         int valid_end, int tid) const {
        T* s_k = key_tile(slot);
        const size_t offset = static_cast<size_t>(key0) * HeadDim;
        if (key0 + BlockN <= valid_end) {
            Copy::template load<BlockN, false>(s_k, k + offset, BlockN, tid);
            Copy::template load<BlockN, false>(s_k + kTileElems, v + offset, BlockN, tid);
        } else {
            Copy::template load<BlockN, true>(s_k, k + offset, valid_end - key0, tid);
            Copy::template load<BlockN, true>(s_k + kTileElems, v + offset, valid_end - key0, tid);
        }
    }
};

}  // namespace fa
