// Tiles global -> shared memory by cp.async, and the rings of K/V tiles the cp.async families
// stream keys through: contiguous keys (KVRing), or keys gathered row by row from a paged or
// ragged cache (GatherKVRing: any page size, the page table read one tile ahead).
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

    // Rows gathered from anywhere: `rows(r)` is row r's first element in global memory (asked
    // only for r < valid_rows; rows past it arrive as zeros, read from `any`, a valid address).
    template <int Rows, bool CheckRows, class RowPointer>
    static __device__ __forceinline__ void gather(T* smem, const RowPointer& rows, const T* any,
                                                  int valid_rows, int tid) {
        for (int c = tid; c < Rows * kChunksPerRow; c += Threads) {
            const int r = c / kChunksPerRow;
            const int col = (c % kChunksPerRow) * kChunkElems;
            const bool valid = !CheckRows || r < valid_rows;
            cp_async_16(smem_addr(smem + r * RowStride + col), valid ? rows(r) + col : any,
                        valid ? 16 : 0);
        }
    }

    // The same rows of two tensors of one layout (K and V): `offset(r)` is row r's element
    // offset from k and from v, computed once for both.
    template <int Rows, bool CheckRows, class RowOffset>
    static __device__ __forceinline__ void gather_pair(T* smem_k, T* smem_v, const T* k,
                                                       const T* v, const RowOffset& offset,
                                                       int valid_rows, int tid) {
        if constexpr (kRegular) {
            constexpr int kPasses = (Rows + kRowsPerPass - 1) / kRowsPerPass;
            const int row = tid / kChunksPerRow;
            const int col = (tid % kChunksPerRow) * kChunkElems;
            const uint32_t dst_k = smem_addr(smem_k + row * RowStride + col);
            const uint32_t dst_v = smem_addr(smem_v + row * RowStride + col);
            // Every row's offset first, then the copies: the offsets' loads (a page table's
            // row slots in shared memory) overlap instead of each waiting before its copy.
            size_t at[kPasses];
            bool valid[kPasses];
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) {
                const int r = row + pass * kRowsPerPass;
                valid[pass] = (Rows % kRowsPerPass == 0 || r < Rows) && (!CheckRows || r < valid_rows);
                at[pass] = valid[pass] ? offset(r) + col : 0;
            }
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) {
                const int r = row + pass * kRowsPerPass;
                if (Rows % kRowsPerPass != 0 && r >= Rows) break;
                const uint32_t step = pass * kRowsPerPass * RowStride * static_cast<int>(sizeof(T));
                cp_async_16(dst_k + step, k + at[pass], valid[pass] ? 16 : 0);
                cp_async_16(dst_v + step, v + at[pass], valid[pass] ? 16 : 0);
            }
        } else {
            for (int c = tid; c < Rows * kChunksPerRow; c += Threads) {
                const int r = c / kChunksPerRow;
                const int col = (c % kChunksPerRow) * kChunkElems;
                const bool valid = !CheckRows || r < valid_rows;
                const size_t at = valid ? offset(r) + col : 0;
                cp_async_16(smem_addr(smem_k + r * RowStride + col), k + at, valid ? 16 : 0);
                cp_async_16(smem_addr(smem_v + r * RowStride + col), v + at, valid ? 16 : 0);
            }
        }
    }

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

// ---------------------------------------------------------------- gathered keys

// Where key j of one request lives in a cache of rows (row `row` of KV head h at
// cache + (row * kv_heads + h) * HeadDim, the layout [rows, kv_heads, head_dim]):
//
// RaggedKeys: contiguous, keys [first, first + kv_len) of a packed [total_kv, ...] tensor
// (varlen self-attention).
struct RaggedKeys {
    static constexpr bool kIndexed = false;
    int first;
    __device__ __forceinline__ int row(int key) const { return first + key; }
};
// PagedKeys: key j in page pages[j / page_size], slot j % page_size, of a cache
// [num_pages, page_size, kv_heads, head_dim] (vLLM's block table row, or FlashInfer's CSR
// slice kv_indices[kv_indptr[b]:]). Any page size; rows number below 2^31.
struct PagedKeys {
    static constexpr bool kIndexed = true;
    const int* pages;
    int page_size;
    __device__ __forceinline__ int row(int key) const {
        const unsigned k = static_cast<unsigned>(key), size = static_cast<unsigned>(page_size);
        return __ldg(pages + k / size) * page_size + static_cast<int>(k % size);
    }
};

// A ring of Stages (K tile, V tile) slots, as KVRing, whose rows are gathered through Keys.
// Paged keys are looked up a tile ahead: the cache rows of each tile sit in a ring of
// Stages row slots in shared memory (Stages x BlockN ints at `slots`), filled by the first
// BlockN threads from the page table. start() looks up tiles 0 .. Stages - 1 at once; then
// iteration t issues tile t + Stages - 1 from its slot, stores the rows of tile t + Stages
// (whose page-table loads were issued an iteration earlier, so their latency hid behind
// a tile's math) into the slot tile t's rows left, and issues the loads of tile
// t + Stages + 1. A slot is written after the barrier of the iteration that retires its
// previous tile's issue and read after the next barrier.
template <typename T, int HeadDim, int RowStride, int Threads, int BlockN, int Stages, class Keys>
struct GatherKVRing {
    static_assert(Stages >= 2, "the ring needs two stages");
    using Copy = TileCopy<T, HeadDim, RowStride, Threads>;
    static constexpr int kTileElems = BlockN * RowStride;
    static constexpr int kElems = 2 * Stages * kTileElems;
    static constexpr int kSlotInts = Keys::kIndexed ? Stages * BlockN : 0;
    static constexpr int kRowsPerThread = (BlockN + Threads - 1) / Threads;

    T* base;
    int* slots;
    const T* k;  // the KV head's element 0 of row 0: cache + kv_head * HeadDim
    const T* v;
    long long row_stride;  // elements from one cache row to the next: kv_heads * HeadDim
    Keys keys;
    int begin;  // the key range: tile t holds keys [begin + t * BlockN, ...), rows from `end`
    int end;    // on are zero-filled
    int count;  // tiles
    int pending[kRowsPerThread];

    __device__ __forceinline__ T* key_tile(int slot) const { return base + 2 * slot * kTileElems; }
    __device__ __forceinline__ T* value_tile(int slot) const { return key_tile(slot) + kTileElems; }

    // Before the loop: every thread's page-table loads of tiles 0 .. Stages - 1, one barrier,
    // then the first Stages - 1 tiles (after the caller's own commit groups, e.g. its Q tile).
    __device__ __forceinline__ void start(int tid) {
        if constexpr (Keys::kIndexed) {
            int rows[Stages][kRowsPerThread];
#pragma unroll
            for (int s = 0; s < Stages; ++s) fetch_rows(s, rows[s], tid);
#pragma unroll
            for (int s = 0; s < Stages; ++s) write_rows(s, rows[s], tid);
            __syncthreads();
        }
#pragma unroll
        for (int s = 0; s < Stages - 1; ++s) {
            if (s < count) load(s, tid);
            cp_async_commit();
        }
        if constexpr (Keys::kIndexed) fetch_rows(Stages, pending, tid);
    }

    // At the top of iteration t (KVRing::advance's contract): tile t has landed and is
    // everyone's, tile t + Stages - 1 starts arriving.
    __device__ __forceinline__ void advance(int t, int tid) {
        cp_async_wait<Stages - 2>();
        __syncthreads();
        const int next = t + Stages - 1;
        if (next < count) load(next, tid);
        cp_async_commit();
        if constexpr (Keys::kIndexed) {
            write_rows(t + Stages, pending, tid);
            fetch_rows(t + Stages + 1, pending, tid);
        }
    }

  private:
    // The cache rows of tile `tile`'s keys this thread looks up (0 past the range).
    __device__ __forceinline__ void fetch_rows(int tile, int (&rows)[kRowsPerThread], int tid) const {
#pragma unroll
        for (int j = 0; j < kRowsPerThread; ++j) {
            const int r = tid + j * Threads;
            const int key = begin + tile * BlockN + r;
            rows[j] = (tile < count && r < BlockN && key < end) ? keys.row(key) : 0;
        }
    }
    __device__ __forceinline__ void write_rows(int tile, const int (&rows)[kRowsPerThread],
                                               int tid) const {
        if (tile >= count) return;
#pragma unroll
        for (int j = 0; j < kRowsPerThread; ++j) {
            const int r = tid + j * Threads;
            if (r < BlockN) slots[(tile % Stages) * BlockN + r] = rows[j];
        }
    }

    // Tile `tile` into its slot; rows at or past `end` arrive as zeros. One commit group is
    // the caller's.
    __device__ __forceinline__ void load(int tile, int tid) const {
        const int slot = tile % Stages;
        const int key0 = begin + tile * BlockN;
        T* s_k = key_tile(slot);
        const int* tile_rows = slots + slot * BlockN;
        const Keys tile_keys = keys;
        const long long stride = row_stride;
        const auto offset = [&](int r) -> size_t {
            int row;
            if constexpr (Keys::kIndexed)
                row = tile_rows[r];
            else
                row = tile_keys.row(key0 + r);
            return static_cast<size_t>(row) * static_cast<size_t>(stride);
        };
        if (key0 + BlockN <= end)
            Copy::template gather_pair<BlockN, false>(s_k, s_k + kTileElems, k, v, offset, BlockN,
                                                     tid);
        else
            Copy::template gather_pair<BlockN, true>(s_k, s_k + kTileElems, k, v, offset,
                                                    end - key0, tid);
    }
};

}  // namespace fa
