// Serving attention on a work list: ragged queries against a paged (or ragged) KV cache,
// bf16/fp16 in, fp32 accumulate, mma.sync.aligned.m16n8k16 (sm_80+, run here on sm_90).
//
// One kernel for decode (1-16 query rows a request), speculative verification, chunked
// prefill and varlen prefill: the host work planner (tuner/planner/work_list.py) cuts the
// batch into work items, each (request, KV head, a block of BLOCK_ROWS packed query rows, a
// key range), and deals them to a fixed grid of persistent CTAs. A request's packed rows
// are its tokens times the query heads of one KV-head group, token-major (packed row p is
// token p / group of query head kv_head * group + p % group): decode_f16's GQA packing, and
// a tile of K/V serves every head of the group. K and V rows are gathered through the page
// table (fa::GatherKVRing: any page size, the table read a tile ahead) or from a ragged
// tensor, into a STAGES-deep cp.async ring.
//
// Warps: ROW_WARPS x KEY_WARPS. A warp owns ROWS_PER_WARP (16 M_TILES) packed rows and a
// KEYS_PER_WARP slice of every key tile, with its own online softmax; the KEY_WARPS warps
// of a row group merge in shared memory at the end (decode: one row group, the warps split
// the keys; prefill: one key warp, the warps split the rows). An item of one split writes
// the normalised output; an item of a split request writes float32 partial rows (normalised
// by its own sum) and their log2-sum-exp, which serving_f16_split_merge merges from the
// work list's merge entries (fa::merge_work_list).
//
// Layout contract with tuner/planner/families/serving_f16.py and tuner/planner/work_list.py:
//   q, out: [total_q, heads, HEAD_DIM]; paged k, v: [num_pages, page_size, kv_heads, HEAD_DIM]
//   with `pages` the page lists (request b's at pages + kv_offset); ragged k, v: [total_kv,
//   kv_heads, HEAD_DIM], request b's keys from row kv_offset; lse: [total_q, heads].
//   work: the int32 buffer of WorkLayout: requests (q_start, q_len, kv_len, kv_offset) at
//   requests_offset, items (request, kv_head, row0, key_begin | key_end, partial_row0, tiles, -)
//   at items_offset, CTA c's items [ctas[c], ctas[c + 1]) at ctas_offset, merge entries
//   (token, splits, first partial row, stride) at merges_offset, their count in work[1].
//   grid = (ctas), block = 32 * WARPS, dynamic shared bytes = serving_f16_shared_bytes.
//   partial row of (split s, token r, head h) of a split request: partial_row0 + r * heads + h.
// Masks (causal bottom-right per request, sliding window), softcap, ALiBi and sinks are the
// shared device layer's (include/fa/), each request with its own q_len and kv_len.

#include "fa/forward.cuh"
#include "fa/warp_merge.cuh"
#include "fa/warp_mma.cuh"
#include "fa/variant_switches.cuh"

// Defaults: the planner's default plan (tuner/planner/families/serving_f16.py).
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 64
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef ROW_WARPS
#define ROW_WARPS 1
#endif
#ifndef M_TILES
#define M_TILES 1
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef PAGED
#define PAGED 1
#endif
#ifndef CTAS_PER_SM
#define CTAS_PER_SM 2
#endif
#ifndef IS_FP16
#define IS_FP16 0
#endif

#define THREADS (WARPS * 32)
#define KEY_WARPS (WARPS / ROW_WARPS)
#define ROWS_PER_WARP (16 * M_TILES)
#define BLOCK_ROWS (ROW_WARPS * ROWS_PER_WARP)  // packed rows of a work item
#define KEYS_PER_WARP (BLOCK_N / KEY_WARPS)     // keys of a tile each warp scores
#define N_TILES (KEYS_PER_WARP / 8)             // n8 tiles of S per m tile
#define N_STEPS (KEYS_PER_WARP / 16)            // k16 steps of P V
#define D_TILES (HEAD_DIM / 8)                  // n8 tiles of O per m tile
#define D_STEPS (HEAD_DIM / 16)                 // k16 steps of Q K^T
#define ROW_STRIDE (HEAD_DIM + 8)               // elements per shared-memory row
#define MERGE_STRIDE (HEAD_DIM + 4)             // floats per row of the warps' merge scratch

static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");
static_assert(WARPS % ROW_WARPS == 0, "the warps form ROW_WARPS x KEY_WARPS");
static_assert(KEYS_PER_WARP % 16 == 0 && KEYS_PER_WARP >= 16, "each warp scores whole k16 steps");
static_assert(M_TILES >= 1 && M_TILES <= 2, "16 or 32 rows a warp");

struct Traits : fa::SwitchedVariant {
    using Elem = fa::HalfType<IS_FP16>::type;
#if PAGED
    using Keys = fa::PagedKeys;
#else
    using Keys = fa::RaggedKeys;
#endif
    using Ring = fa::GatherKVRing<Elem, HEAD_DIM, ROW_STRIDE, THREADS, BLOCK_N, STAGES, Keys>;
    using Copy = fa::TileCopy<Elem, HEAD_DIM, ROW_STRIDE, THREADS>;
};
typedef Traits::Elem elem_t;

// Shared memory: Q's packed rows | the K/V ring, which the warps' merge scratch reuses after
// the key loop | the ring's row slots (paged).
constexpr int kQBytes = BLOCK_ROWS * ROW_STRIDE * 2;
constexpr int kRingBytes = Traits::Ring::kElems * 2;
constexpr int kMergeBytes = WARPS * ROWS_PER_WARP * MERGE_STRIDE * 4;
constexpr int kLoopBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;

// Packed row p of an item (row0 + p of its request) -> its row of q.
struct QueryRows {
    const elem_t* q;
    size_t q_start;
    int heads, head0, group, row0;
    __device__ __forceinline__ const elem_t* operator()(int p) const {
        const int packed = row0 + p;
        return q + ((q_start + packed / group) * heads + head0 + packed % group) * HEAD_DIM;
    }
};

// ---------------------------------------------------------------- one work item

__device__ __forceinline__ void attend_item(
    const int4 item_head, const int4 item_tail, const int4 request, elem_t* s_q, elem_t* s_ring,
    int* s_rows, const elem_t* __restrict__ q, const elem_t* __restrict__ k_cache,
    const elem_t* __restrict__ v_cache, elem_t* __restrict__ out, float* __restrict__ partial_o,
    float* __restrict__ partial_lse, const int* __restrict__ pages, int kv_heads, int page_size,
    float scale_log2, int heads, int window_left, int window_right, float softcap,
    const float* __restrict__ alibi_slopes, const float* __restrict__ sinks,
    float* __restrict__ lse) {
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int row_warp = warp / KEY_WARPS;
    const int key_warp = warp % KEY_WARPS;
    const int group = heads / kv_heads;

    const int kv_head = item_head.y, row0 = item_head.z;
    const int partial_row0 = item_tail.y;
    const int q_start = request.x, q_len = request.y, kv_len = request.z;
    const int packed_rows = q_len * group;
    const int valid_rows = min(BLOCK_ROWS, packed_rows - row0);

    const Traits::MaskType mask(q_len, kv_len, window_left, window_right);
    const fa::KeyTiles tiles = fa::key_tiles_in<BLOCK_N>(mask, item_head.w, item_tail.x,
                                                         row0 / group,
                                                         (row0 + valid_rows - 1) / group);
    // Keys of the last tile past the item's range (the next split's, or past kv_len) arrive
    // as zeros; this hides them whatever the mask leaves.
    const fa::Mask<false, false> range_end(0, tiles.end, -1, -1);

    const QueryRows q_rows{q, (size_t)q_start, heads, kv_head * group, group, row0};
    Traits::Copy::gather<BLOCK_ROWS, true>(s_q, q_rows, q, valid_rows, tid);
    fa::cp_async_commit();

#if PAGED
    const Traits::Keys keys{pages + request.w, page_size};
#else
    const Traits::Keys keys{request.w};
#endif
    Traits::Ring ring{s_ring,
                      s_rows,
                      k_cache + (size_t)kv_head * HEAD_DIM,
                      v_cache + (size_t)kv_head * HEAD_DIM,
                      (long long)kv_heads * HEAD_DIM,
                      keys,
                      tiles.begin,
                      tiles.end,
                      tiles.count,
                      {}};
    ring.start(tid);

    // This warp's rows: their tokens (the masks' query rows) and query heads.
    const int warp_row = row_warp * ROWS_PER_WARP;  // first packed row of the warp, in the item
    const bool warp_active = warp_row < valid_rows;
    const int warp_token_first = (row0 + warp_row) / group;
    const int warp_token_last = (row0 + min(warp_row + ROWS_PER_WARP, valid_rows) - 1) / group;
    fa::FragmentRows query_row[M_TILES];
    Traits::ScoreModType score_mod[M_TILES] = {
#if M_TILES == 2
        Traits::ScoreModType(scale_log2, softcap, q_len, kv_len),
#endif
        Traits::ScoreModType(scale_log2, softcap, q_len, kv_len)};
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        int head[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int packed = row0 + warp_row + mt * 16 + fa::fragment_row(lane, half);
            query_row[mt].row[half] = packed / group;
            head[half] = kv_head * group + packed % group;
        }
        score_mod[mt].set_heads(alibi_slopes, head[0] % heads, head[1] % heads);
    }

    float o_acc[M_TILES][D_TILES][4];
    fa::fill_zero<M_TILES * D_TILES * 4>(&o_acc[0][0][0]);
    fa::SoftmaxRows softmax[M_TILES];
    const elem_t* s_q_warp = s_q + warp_row * ROW_STRIDE;

    for (int t = 0; t < tiles.count; ++t) {
        ring.advance(t, tid);
        const int key0 = tiles.begin + t * BLOCK_N + key_warp * KEYS_PER_WARP;
        if (!warp_active || key0 >= tiles.end) continue;
        if (mask.skipped(key0, KEYS_PER_WARP, warp_token_first, warp_token_last)) continue;
        const elem_t* s_k = ring.key_tile(t % STAGES) + key_warp * KEYS_PER_WARP * ROW_STRIDE;
        const elem_t* s_v = ring.value_tile(t % STAGES) + key_warp * KEYS_PER_WARP * ROW_STRIDE;

        // ---- S = Q K^T over the warp's slice (Q's fragments re-read from shared memory)
        float s_acc[M_TILES][N_TILES][4];
        fa::warp_qk<elem_t, M_TILES, N_TILES, HEAD_DIM, ROW_STRIDE>(s_acc, s_q_warp, s_k, lane);

        // ---- score modifications, masks, online softmax (fp32, log2 domain)
        const bool partial = mask.partial(key0, KEYS_PER_WARP, warp_token_first, warp_token_last);
        const bool past_end = key0 + KEYS_PER_WARP > tiles.end;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
            score_mod[mt].apply<N_TILES>(&s_acc[mt][0][0], key0, query_row[mt], lane);
        if (partial) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                mask.apply<N_TILES>(&s_acc[mt][0][0], key0, query_row[mt], lane);
        }
        if (past_end) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                range_end.apply<N_TILES>(&s_acc[mt][0][0], key0, query_row[mt], lane);
        }
        fa::update_tiles(softmax, s_acc, o_acc, score_mod[0].softmax_scale());
        // ---- O += P V, P in registers
        fa::warp_pv<elem_t, M_TILES, N_TILES, D_TILES, ROW_STRIDE>(o_acc, s_acc, s_v, lane);
    }
    fa::cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring: it becomes the merge scratch

    // ---- each warp's state to shared memory: unnormalised O, its row max and row sum, as
    // row (key_warp * BLOCK_ROWS + packed row of the item)
    float* s_merge = reinterpret_cast<float*>(s_ring);
    float* mine = s_merge + (key_warp * BLOCK_ROWS + warp_row) * MERGE_STRIDE;
    fa::stage_rows<M_TILES, D_TILES, HEAD_DIM, MERGE_STRIDE>(mine, softmax, o_acc, lane);
    __syncthreads();

    // ---- merge the key warps of each row: 4 output elements a thread
    constexpr int VECS_PER_ROW = HEAD_DIM / 4;
    for (int vec = tid; vec < BLOCK_ROWS * VECS_PER_ROW; vec += THREADS) {
        const int r = vec / VECS_PER_ROW;
        const int col = (vec % VECS_PER_ROW) * 4;
        if (r >= valid_rows) break;  // rows only grow with vec
        const fa::MergedRow merged =
            fa::merge_row<KEY_WARPS, HEAD_DIM, MERGE_STRIDE>(s_merge, BLOCK_ROWS, r, col);
        const int packed = row0 + r;
        const int token = packed / group;
        const int head = kv_head * group + packed % group;
        if (partial_row0 < 0) {
            const size_t out_row = (size_t)(q_start + token) * heads + head;
            const fa::RowResult result =
                fa::row_result(merged.top, merged.total, Traits::sink(sinks, head));
            fa::store_quad<elem_t>(out + out_row * HEAD_DIM + col, merged.scaled(result.inv));
            if (lse != nullptr && col == 0) lse[out_row] = fa::lse_natural(result.lse2);
        } else {
            const fa::RowResult result = fa::partial_result(merged.top, merged.total);
            const size_t part_row = (size_t)partial_row0 + (size_t)token * heads + head;
            *reinterpret_cast<float4*>(partial_o + part_row * HEAD_DIM + col) =
                merged.scaled(result.inv);
            if (col == 0) partial_lse[part_row] = result.lse2;
        }
    }
}

// ---------------------------------------------------------------- attention

extern "C" __global__ void __launch_bounds__(THREADS, CTAS_PER_SM)
serving_f16_attention(const elem_t* __restrict__ q, const elem_t* __restrict__ k_cache,
                      const elem_t* __restrict__ v_cache, elem_t* __restrict__ out,
                      float* __restrict__ partial_o, float* __restrict__ partial_lse,
                      const int* __restrict__ work, const int* __restrict__ pages,
                      int requests_offset, int items_offset, int ctas_offset, int kv_heads,
                      int page_size, float scale_log2, int heads, int window_left,
                      int window_right, float softcap, const float* __restrict__ alibi_slopes,
                      const float* __restrict__ sinks, float* __restrict__ lse) {
    extern __shared__ __align__(128) unsigned char shared_raw[];
    elem_t* s_q = reinterpret_cast<elem_t*>(shared_raw);
    elem_t* s_ring = reinterpret_cast<elem_t*>(shared_raw + kQBytes);
    int* s_rows = reinterpret_cast<int*>(shared_raw + kQBytes + kLoopBytes);

    const int4* requests = reinterpret_cast<const int4*>(work + requests_offset);
    const int4* items = reinterpret_cast<const int4*>(work + items_offset);
    const int first = work[ctas_offset + blockIdx.x];
    const int last = work[ctas_offset + blockIdx.x + 1];
    for (int i = first; i < last; ++i) {
        const int4 item_head = items[2 * i];      // request, kv_head, row0, key_begin
        const int4 item_tail = items[2 * i + 1];  // key_end, partial_row0, tiles, -
        attend_item(item_head, item_tail, requests[item_head.x], s_q, s_ring, s_rows, q, k_cache,
                    v_cache, out, partial_o, partial_lse, pages, kv_heads, page_size, scale_log2,
                    heads, window_left, window_right, softcap, alibi_slopes, sinks, lse);
        __syncthreads();  // the next item's loads overwrite Q, the ring and its row slots
    }
}

// ---------------------------------------------------------------- split merge

extern "C" __global__ void __launch_bounds__(fa::kMergeThreads)
serving_f16_split_merge(const float* __restrict__ partial_o,
                        const float* __restrict__ partial_lse, elem_t* __restrict__ out,
                        const int* __restrict__ work, int merges_offset, int heads,
                        const float* __restrict__ sinks, float* __restrict__ lse) {
    fa::merge_work_list<elem_t, HEAD_DIM>(partial_o, partial_lse, out,
                                          reinterpret_cast<const int4*>(work + merges_offset),
                                          work[1], heads, sinks, lse);
}
