// FlashDecoding on tensor cores: a few query rows against a long KV cache, bf16/fp16 in,
// fp32 accumulate, mma.sync.aligned.m16n8k16 (sm_80+, run here on sm_90).
//
// Decode is a stream over K and V: every key is read once and used by a handful of
// query rows. So one block owns one KV head (of one batch) and one split of the key
// range, and packs the query rows of every query head sharing that KV head into the
// rows of its m16 tiles: with 32 query heads on 8 KV heads and one query row, the
// four heads of a group fill 4 of 16 rows (packed row p = g * seq_len + r for head g
// of the group and query row r; these rows are contiguous in q and out). K and V are
// read from DRAM once per (KV head, split, row block) whatever the group size.
//
// K and V tiles of BLOCK_N keys stream through a STAGES-deep cp.async ring; each of
// the WARPS warps takes BLOCK_N / WARPS keys of a tile and keeps its own online
// softmax state (running max, sum, fp32 accumulators of its ROWS rows). At the end
// the warps' states are merged through shared memory (aliasing the ring), and the
// block writes the normalised output (one split) or a float32 partial output with
// its log2-sum-exp (several), which decode_f16_split_merge combines exactly as
// mma_f16_split_merge does.
//
// Layout contract with tuner/planner/families/decode_f16.py:
//   q, out: [batch * heads][seq_len][HEAD_DIM]; k, v: [batch * kv_heads][kv_len][HEAD_DIM]
//   grid = (ceil(group * seq_len / ROWS), splits, batch * kv_heads), block = 32 * WARPS
//   dynamic shared bytes = 2 * (HEAD_DIM + 8) * ROWS
//                        + max(2 * (HEAD_DIM + 8) * 2 * STAGES * BLOCK_N,
//                              4 * WARPS * ROWS * (HEAD_DIM + 4))
//   keys_per_split is a multiple of BLOCK_N; split s covers keys
//   [s * keys_per_split, min(kv_len, (s + 1) * keys_per_split)).
//   partials: row ((bh * splits + s) * seq_len + r) for query head bh, split s, row r.
// Masks (causal bottom-right per query row, sliding window), score modifications (softcap,
// ALiBi per packed row's head) and sinks are the shared device layer's (include/fa/); the
// split-KV contract (include/fa/split_kv.cuh) places the splits, with row rows 0..seq_len-1
// of every packed head: a window's splits cover only the keys it leaves.

#include "fa/forward.cuh"
#include "fa/warp_merge.cuh"
#include "fa/warp_mma.cuh"
#include "fa/variant_switches.cuh"

// Defaults: the planner's default plan (tuner/planner/families/decode_f16.py).
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 64
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef M_TILES
#define M_TILES 1
#endif
#ifndef IS_FP16
#define IS_FP16 0
#endif

#define THREADS (WARPS * 32)
#define ROWS (16 * M_TILES)                // packed query rows of a block
#define KEYS_PER_WARP (BLOCK_N / WARPS)    // keys of a tile each warp scores
#define N_TILES (KEYS_PER_WARP / 8)        // n8 tiles of S per m tile
#define N_STEPS (KEYS_PER_WARP / 16)       // k16 steps of P V
#define D_TILES (HEAD_DIM / 8)             // n8 tiles of O per m tile
#define D_STEPS (HEAD_DIM / 16)            // k16 steps of Q K^T
#define ROW_STRIDE (HEAD_DIM + 8)          // elements per shared-memory row
#define MERGE_STRIDE (HEAD_DIM + 4)        // floats per row of the warps' merge scratch

static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");
static_assert(KEYS_PER_WARP % 16 == 0 && KEYS_PER_WARP >= 16, "each warp scores whole k16 steps");
static_assert(M_TILES >= 1 && M_TILES <= 2, "16 or 32 packed rows");

struct Traits : fa::SwitchedVariant {
    using Elem = fa::HalfType<IS_FP16>::type;
    using Ring = fa::KVRing<Elem, HEAD_DIM, ROW_STRIDE, THREADS, BLOCK_N, STAGES>;
    using QCopy = fa::TileCopy<Elem, HEAD_DIM, ROW_STRIDE, THREADS>;
};
typedef Traits::Elem elem_t;

// ---------------------------------------------------------------- attention

extern "C" __global__ void __launch_bounds__(THREADS)
decode_f16_attention(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                     const elem_t* __restrict__ v, elem_t* __restrict__ out,
                     float* __restrict__ partial_o, float* __restrict__ partial_lse, int seq_len,
                     int kv_len, int group, int keys_per_split, float scale_log2, int heads,
                     int window_left, int window_right, float softcap,
                     const float* __restrict__ alibi_slopes, const float* __restrict__ sinks,
                     float* __restrict__ lse) {
    extern __shared__ __align__(128) unsigned char shared_raw[];
    elem_t* s_q = reinterpret_cast<elem_t*>(shared_raw);
    const Traits::Ring ring{s_q + ROWS * ROW_STRIDE};  // STAGES x (K tile, V tile)
    float* s_merge = reinterpret_cast<float*>(ring.base);  // after the loop: WARPS x ROWS rows

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int split = blockIdx.y;
    const int splits = gridDim.y;
    const int kv_head = blockIdx.z;            // batch * kv_heads + kv head
    const int packed_rows = group * seq_len;   // the group's query rows, contiguous in q
    const int row0 = blockIdx.x * ROWS;        // this block's first packed row

    const size_t q_row0 = (size_t)kv_head * packed_rows;  // first q row of the group
    const elem_t* k_h = k + (size_t)kv_head * kv_len * HEAD_DIM;
    const elem_t* v_h = v + (size_t)kv_head * kv_len * HEAD_DIM;

    // Every packed head's rows are query rows 0..seq_len-1.
    const Traits::MaskType mask(seq_len, kv_len, window_left, window_right);
    const fa::KeyTiles tiles = fa::key_tiles<BLOCK_N>(mask, split, keys_per_split, 0, seq_len - 1);

    Traits::QCopy::load<ROWS, true>(s_q, q + (q_row0 + row0) * HEAD_DIM, packed_rows - row0, tid);
    fa::cp_async_commit();
    ring.prefetch(tiles.count, k_h, v_h, tiles.begin, tiles.end, tid);

    // The query row (within its head) and the query head of each row this lane holds.
    fa::FragmentRows query_row[M_TILES];
    Traits::ScoreModType score_mod[M_TILES] = {
#if M_TILES == 2
        Traits::ScoreModType(scale_log2, softcap, seq_len, kv_len),
#endif
        Traits::ScoreModType(scale_log2, softcap, seq_len, kv_len)};
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        int head[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int packed = row0 + mt * 16 + fa::fragment_row(lane, half);
            query_row[mt].row[half] = packed % seq_len;
            head[half] = (kv_head * group + packed / seq_len) % heads;
        }
        score_mod[mt].set_heads(alibi_slopes, head[0], head[1]);
    }

    float o_acc[M_TILES][D_TILES][4];
    fa::fill_zero<M_TILES * D_TILES * 4>(&o_acc[0][0][0]);
    fa::SoftmaxRows softmax[M_TILES];

    for (int t = 0; t < tiles.count; ++t) {
        ring.advance(t, tiles.count, k_h, v_h, tiles.begin, tiles.end, tid);
        const int key0 = tiles.begin + t * BLOCK_N + warp * KEYS_PER_WARP;
        if (key0 >= tiles.end) continue;  // this warp's slice lies past the split
        if (mask.skipped(key0, KEYS_PER_WARP, 0, seq_len - 1)) continue;
        const elem_t* s_k = ring.key_tile(t % STAGES) + warp * KEYS_PER_WARP * ROW_STRIDE;
        const elem_t* s_v = ring.value_tile(t % STAGES) + warp * KEYS_PER_WARP * ROW_STRIDE;

        // ---- S = Q K^T over the warp's slice (Q's fragments re-read from shared
        // memory: registers go to the accumulators; decode is bound by DRAM anyway)
        float s_acc[M_TILES][N_TILES][4];
        fa::warp_qk<elem_t, M_TILES, N_TILES, HEAD_DIM, ROW_STRIDE>(s_acc, s_q, s_k, lane);

        // ---- score modifications, mask, online softmax (fp32, log2 domain)
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
            score_mod[mt].apply<N_TILES>(&s_acc[mt][0][0], key0, query_row[mt], lane);
        if (mask.partial(key0, KEYS_PER_WARP, 0, seq_len - 1)) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                mask.apply<N_TILES>(&s_acc[mt][0][0], key0, query_row[mt], lane);
        }
        fa::update_tiles(softmax, s_acc, o_acc, score_mod[0].softmax_scale());
        // ---- O += P V, P in registers
        fa::warp_pv<elem_t, M_TILES, N_TILES, D_TILES, ROW_STRIDE>(o_acc, s_acc, s_v, lane);
    }
    fa::cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring: it becomes the merge scratch

    // ---- each warp's state to shared memory: unnormalised O, its row max and row sum
    float* mine = s_merge + warp * ROWS * MERGE_STRIDE;
    fa::stage_rows<M_TILES, D_TILES, HEAD_DIM, MERGE_STRIDE>(mine, softmax, o_acc, lane);
    __syncthreads();

    // ---- merge the warps: 4 output elements a thread
    constexpr int VECS_PER_ROW = HEAD_DIM / 4;
    for (int vec = tid; vec < ROWS * VECS_PER_ROW; vec += THREADS) {
        const int r = vec / VECS_PER_ROW;
        const int col = (vec % VECS_PER_ROW) * 4;
        const int packed = row0 + r;
        if (packed >= packed_rows) break;  // rows only grow with vec
        const fa::MergedRow merged =
            fa::merge_row<WARPS, HEAD_DIM, MERGE_STRIDE>(s_merge, ROWS, r, col);
        // query head kv_head * group + packed / seq_len, row packed % seq_len
        const size_t head = (size_t)kv_head * group + packed / seq_len;
        if (splits == 1) {
            const fa::RowResult result = fa::row_result(
                merged.top, merged.total, Traits::sink(sinks, (int)(head % heads)));
            fa::store_quad<elem_t>(out + (q_row0 + packed) * HEAD_DIM + col,
                                   merged.scaled(result.inv));
            if (lse != nullptr && col == 0)
                lse[q_row0 + packed] = fa::lse_natural(result.lse2);
        } else {
            const fa::RowResult result = fa::partial_result(merged.top, merged.total);
            const size_t part_row = (head * splits + split) * seq_len + packed % seq_len;
            *reinterpret_cast<float4*>(partial_o + part_row * HEAD_DIM + col) =
                merged.scaled(result.inv);
            if (col == 0) partial_lse[part_row] = result.lse2;
        }
    }
}

// ---------------------------------------------------------------- split merge

extern "C" __global__ void __launch_bounds__(fa::kMergeThreads)
decode_f16_split_merge(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
                       elem_t* __restrict__ out, int seq_len, int splits, int total_rows, int heads,
                       const float* __restrict__ sinks, float* __restrict__ lse) {
    fa::merge_splits<elem_t, HEAD_DIM>(partial_o, partial_lse, out, seq_len, splits, total_rows,
                                       heads, sinks, lse);
}
