// FlashAttention-2 forward on tensor cores: bf16/fp16 in, fp32 accumulate,
// mma.sync.aligned.m16n8k16 (sm_80+, run here on sm_90).
//
// One block owns BLOCK_M query rows of one (batch, head); its WARPS warps own
// BLOCK_M / WARPS rows each (ROWS_PER_WARP = 16 or 32, i.e. M_TILES m16 tiles).
// K and V tiles of BLOCK_N keys stream through a STAGES-deep cp.async ring in
// shared memory; S = Q K^T and O += P V are warp-local mma.sync products, P
// never leaves registers (the S accumulator layout of m16n8 is the A-operand
// layout of the next m16n8k16 once packed to 16-bit pairs), and the online
// softmax runs in fp32 with the 1/sqrt(d) * log2(e) scale folded into exp2.
//
// Shared memory rows are HEAD_DIM + 8 elements long: the 16-byte pad puts the
// eight rows an ldmatrix phase reads in eight distinct 16-byte bank groups,
// for every HEAD_DIM that is a multiple of 16 (64, 96, 128, 256), which an
// XOR swizzle on 128-byte rows cannot do for HEAD_DIM = 96.
//
// Layout contract with tuner/planner/families/mma_f16.py:
//   dynamic shared bytes = 2 * (HEAD_DIM + 8) * (BLOCK_M + 2 * STAGES * BLOCK_N)
//   grid, splits, GQA head map, causal block order and the keys a block visits: the
//   split-KV contract of include/fa/split_kv.cuh (window variants skip whole tiles).
//   q, out: [batch * heads][seq_len][HEAD_DIM]; k, v: [batch * kv_heads][kv_len][HEAD_DIM].
//   Each block loads its own KV head's tiles: the query heads of a group share K and V
//   through L2 only (their blocks run close together in launch order).
// Masks (causal bottom-right, sliding window), score modifications (softcap, ALiBi) and
// sinks are the shared device layer's (include/fa/variant.cuh gives the arguments).
// With one split the kernel writes the normalised output in the input dtype;
// with several it writes float32 partial outputs (normalised per split) and
// their log2-sum-exp, which mma_f16_split_merge combines.

#include "fa/forward.cuh"
#include "fa/variant_switches.cuh"

// Defaults: the planner's default plan (tuner/planner/families/mma_f16.py).
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_M
#define BLOCK_M 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 64
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef Q_IN_REGISTERS
#define Q_IN_REGISTERS 0
#endif
#ifndef S_GROUPS
#define S_GROUPS 1
#endif
#ifndef IS_FP16
#define IS_FP16 0
#endif

#define THREADS (WARPS * 32)
#define ROWS_PER_WARP (BLOCK_M / WARPS)
#define M_TILES (ROWS_PER_WARP / 16)
#define N_TILES (BLOCK_N / 8)     // n8 tiles of S per m tile
#define D_TILES (HEAD_DIM / 8)    // n8 tiles of O per m tile
#define D_STEPS (HEAD_DIM / 16)   // k16 steps of Q K^T
#define N_STEPS (BLOCK_N / 16)    // k16 steps of P V
#define ROW_STRIDE (HEAD_DIM + 8) // elements per shared-memory row
#define CHUNKS_PER_ROW (HEAD_DIM / 8)
#define MT_PER_GROUP (M_TILES / S_GROUPS)

static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");
static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16");
static_assert(BLOCK_M % (16 * WARPS) == 0, "each warp owns whole m16 tiles");
static_assert(M_TILES >= 1 && M_TILES <= 2, "16 or 32 rows per warp");
static_assert(S_GROUPS >= 1 && M_TILES % S_GROUPS == 0, "S groups split the m tiles evenly");

struct Traits : fa::SwitchedVariant {
    using Elem = fa::HalfType<IS_FP16>::type;
    using Ring = fa::KVRing<Elem, HEAD_DIM, ROW_STRIDE, THREADS, BLOCK_N, STAGES>;
    using QCopy = fa::TileCopy<Elem, HEAD_DIM, ROW_STRIDE, THREADS>;
};
typedef Traits::Elem elem_t;

// ---------------------------------------------------------------- attention

extern "C" __global__ void __launch_bounds__(THREADS, 1)
mma_f16_attention(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                  const elem_t* __restrict__ v, elem_t* __restrict__ out,
                  float* __restrict__ partial_o, float* __restrict__ partial_lse, int seq_len,
                  int kv_len, int group, int keys_per_split, float scale_log2, int heads,
                  int window_left, int window_right, float softcap,
                  const float* __restrict__ alibi_slopes, const float* __restrict__ sinks,
                  float* __restrict__ lse) {
    extern __shared__ __align__(128) unsigned char shared_raw[];
    elem_t* s_q = reinterpret_cast<elem_t*>(shared_raw);
    const Traits::Ring ring{s_q + BLOCK_M * ROW_STRIDE};

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const fa::RowBlock<Traits, BLOCK_M, BLOCK_N> block(seq_len, kv_len, group, keys_per_split,
                                                      window_left, window_right);
    const int bh = block.bh, row0 = block.row0, split = block.split, splits = block.splits;
    const Traits::MaskType& mask = block.mask;
    const fa::KeyTiles& tiles = block.tiles;
    const Traits::ScoreModType score_mod =
        block.score_mod(scale_log2, softcap, seq_len, kv_len, alibi_slopes, heads);

    const elem_t* q_bh = q + (size_t)bh * seq_len * HEAD_DIM;
    const elem_t* k_bh = k + (size_t)block.kv_bh * kv_len * HEAD_DIM;
    const elem_t* v_bh = v + (size_t)block.kv_bh * kv_len * HEAD_DIM;

    Traits::QCopy::load<BLOCK_M, true>(s_q, q_bh + (size_t)row0 * HEAD_DIM, seq_len - row0, tid);
    fa::cp_async_commit();
    ring.prefetch(tiles.count, k_bh, v_bh, tiles.begin, kv_len, tid);

    // Per-lane ldmatrix row/column offsets (see the PTX ISA's fragment layouts).
    const int a_row = lane % 16;          // A (Q): 16 rows, two k8 halves
    const int a_col = (lane / 16) * 8;
    const int b_row = (lane / 16) * 8 + (lane % 8);  // B (K): two n8 tiles, two k8 halves
    const int b_col = ((lane / 8) % 2) * 8;
    const int v_row = ((lane / 8) % 2) * 8 + (lane % 8);  // B (V, transposed): two k8, two n8
    const int v_col = (lane / 16) * 8;

    // Wait for Q (the oldest group) and bring the warp's rows to registers.
    fa::cp_async_wait<STAGES - 1>();
    __syncthreads();
    const elem_t* s_q_warp = s_q + warp * ROWS_PER_WARP * ROW_STRIDE;
#if Q_IN_REGISTERS
    uint32_t q_frag[M_TILES][D_STEPS][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int ds = 0; ds < D_STEPS; ++ds)
            fa::ldmatrix_x4(q_frag[mt][ds][0], q_frag[mt][ds][1], q_frag[mt][ds][2],
                            q_frag[mt][ds][3],
                            fa::smem_addr(s_q_warp + (mt * 16 + a_row) * ROW_STRIDE + ds * 16 + a_col));
#endif

    float o_acc[M_TILES][D_TILES][4];
    fa::fill_zero<M_TILES * D_TILES * 4>(&o_acc[0][0][0]);
    fa::SoftmaxRows softmax[M_TILES];
    const int warp_row0 = row0 + warp * ROWS_PER_WARP;
    const int warp_row_last = warp_row0 + ROWS_PER_WARP - 1;
    // The two rows of m tile mt this lane holds.
    auto warp_rows = [&](int mt) -> fa::FragmentRows {
        return {warp_row0 + mt * 16 + fa::fragment_row(lane, 0),
                warp_row0 + mt * 16 + fa::fragment_row(lane, 1)};
    };

    for (int t = 0; t < tiles.count; ++t) {
        ring.advance(t, tiles.count, k_bh, v_bh, tiles.begin, kv_len, tid);
        const elem_t* s_k = ring.key_tile(t % STAGES);
        const elem_t* s_v = ring.value_tile(t % STAGES);
        const int key0 = tiles.begin + t * BLOCK_N;

        // A warp none of whose rows sees a key of this tile skips it.
        if (mask.skipped(key0, BLOCK_N, warp_row0, warp_row_last)) continue;

        // With S_GROUPS = M_TILES, each m16 tile runs S, softmax and P.V on its own:
        // K fragments are read once per m tile instead of once a warp, but only
        // one m tile's scores are live at a time (the register file is what
        // limits 32-row warps at head_dim 128).
#pragma unroll
        for (int group = 0; group < S_GROUPS; ++group) {
            // ---- S = Q K^T
            float s_acc[M_TILES][N_TILES][4];
#pragma unroll
            for (int mt = group * MT_PER_GROUP; mt < (group + 1) * MT_PER_GROUP; ++mt)
                fa::fill_zero<N_TILES * 4>(&s_acc[mt][0][0]);
#pragma unroll
            for (int ds = 0; ds < D_STEPS; ++ds) {
#if !Q_IN_REGISTERS
                uint32_t q_frag_ds[M_TILES][4];
#pragma unroll
                for (int mt = group * MT_PER_GROUP; mt < (group + 1) * MT_PER_GROUP; ++mt)
                    fa::ldmatrix_x4(q_frag_ds[mt][0], q_frag_ds[mt][1], q_frag_ds[mt][2],
                                    q_frag_ds[mt][3],
                                    fa::smem_addr(s_q_warp + (mt * 16 + a_row) * ROW_STRIDE +
                                                  ds * 16 + a_col));
#endif
#pragma unroll
                for (int np = 0; np < N_TILES / 2; ++np) {
                    uint32_t b0, b1, b2, b3;
                    fa::ldmatrix_x4(b0, b1, b2, b3,
                                    fa::smem_addr(s_k + (np * 16 + b_row) * ROW_STRIDE + ds * 16 +
                                                  b_col));
#pragma unroll
                    for (int mt = group * MT_PER_GROUP; mt < (group + 1) * MT_PER_GROUP; ++mt) {
#if Q_IN_REGISTERS
                        const uint32_t* a = q_frag[mt][ds];
#else
                        const uint32_t* a = q_frag_ds[mt];
#endif
                        fa::mma_16816<elem_t>(s_acc[mt][2 * np], a, b0, b1);
                        fa::mma_16816<elem_t>(s_acc[mt][2 * np + 1], a, b2, b3);
                    }
                }
            }

            // ---- score modifications, then the mask (keys past kv_len, the causal
            // diagonal, the window), then the online softmax (fp32, log2 domain) and
            // O += P V, one m16 tile at a time: P stays in registers as the A fragments
            // of the next mma, and the softmax of tile mt + 1 has no dependence on the
            // P V products of tile mt, so the scheduler interleaves that ALU work with
            // those tensor-core ops. V fragments are re-read per m tile (shared memory
            // has the headroom; registers do not).
            const bool partial = mask.partial(key0, BLOCK_N, warp_row0, warp_row_last);
#pragma unroll
            for (int mt = group * MT_PER_GROUP; mt < (group + 1) * MT_PER_GROUP; ++mt)
                score_mod.apply<N_TILES>(&s_acc[mt][0][0], key0, warp_rows(mt), lane);
            if (partial) {
#pragma unroll
                for (int mt = group * MT_PER_GROUP; mt < (group + 1) * MT_PER_GROUP; ++mt)
                    mask.apply<N_TILES>(&s_acc[mt][0][0], key0, warp_rows(mt), lane);
            }
#pragma unroll
            for (int mt = group * MT_PER_GROUP; mt < (group + 1) * MT_PER_GROUP; ++mt) {
                float correction[2];
                softmax[mt].update<N_TILES>(&s_acc[mt][0][0], score_mod.softmax_scale(),
                                            correction);
                fa::rescale_rows<D_TILES>(&o_acc[mt][0][0], correction);
#pragma unroll
                for (int ks = 0; ks < N_STEPS; ++ks) {
                    uint32_t p_frag[4];
                    fa::pack_a_fragment<elem_t>(&s_acc[mt][2 * ks][0], p_frag);
#pragma unroll
                    for (int dp = 0; dp < D_TILES / 2; ++dp) {
                        uint32_t b0, b1, b2, b3;
                        fa::ldmatrix_x4_trans(
                            b0, b1, b2, b3,
                            fa::smem_addr(s_v + (ks * 16 + v_row) * ROW_STRIDE + dp * 16 + v_col));
                        fa::mma_16816<elem_t>(o_acc[mt][2 * dp], p_frag, b0, b1);
                        fa::mma_16816<elem_t>(o_acc[mt][2 * dp + 1], p_frag, b2, b3);
                    }
                }
            }
        }
    }
    fa::cp_async_wait<0>();

    // ---- epilogue
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) softmax[mt].finish();
    const float sink = Traits::sink(sinks, bh % heads);

    if (splits == 1) {
        // Stage the warp's rows in its own slice of s_q (Q is no longer read),
        // then write 16-byte chunks per lane.
#if !Q_IN_REGISTERS
        __syncwarp();
#endif
        elem_t* stage = const_cast<elem_t*>(s_q_warp);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const fa::RowResult result =
                    fa::row_result(softmax[mt].max[half], softmax[mt].sum[half], sink);
                const int r = mt * 16 + fa::fragment_row(lane, half);
                fa::store_fragment_row<D_TILES>(stage + r * ROW_STRIDE, &o_acc[mt][0][0], half,
                                                result.inv, lane);
                const int row = warp_row0 + r;
                if (lse != nullptr && lane % 4 == 0 && row < seq_len)
                    lse[(size_t)bh * seq_len + row] = fa::lse_natural(result.lse2);
            }
        __syncwarp();
        elem_t* out_bh = out + (size_t)bh * seq_len * HEAD_DIM;
#pragma unroll
        for (int c = lane; c < ROWS_PER_WARP * CHUNKS_PER_ROW; c += 32) {
            const int r = c / CHUNKS_PER_ROW;
            const int col = (c % CHUNKS_PER_ROW) * 8;
            const int row = warp_row0 + r;
            if (row < seq_len)
                *reinterpret_cast<uint4*>(out_bh + (size_t)row * HEAD_DIM + col) =
                    *reinterpret_cast<const uint4*>(stage + r * ROW_STRIDE + col);
        }
        return;
    }

    // Several splits: float32 partial output (normalised by this split's sum)
    // and the split's log2-sum-exp (-inf where the split saw no key of the row).
    const size_t part_row0 = ((size_t)bh * splits + split) * seq_len;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp_row0 + mt * 16 + fa::fragment_row(lane, half);
            if (row >= seq_len) continue;
            const fa::RowResult result =
                fa::partial_result(softmax[mt].max[half], softmax[mt].sum[half]);
            fa::store_fragment_row<D_TILES>(partial_o + (part_row0 + row) * HEAD_DIM,
                                            &o_acc[mt][0][0], half, result.inv, lane);
            if (lane % 4 == 0) partial_lse[part_row0 + row] = result.lse2;
        }
}

// ---------------------------------------------------------------- split merge

extern "C" __global__ void __launch_bounds__(fa::kMergeThreads)
mma_f16_split_merge(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
                    elem_t* __restrict__ out, int seq_len, int splits, int total_rows, int heads,
                    const float* __restrict__ sinks, float* __restrict__ lse) {
    fa::merge_splits<elem_t, HEAD_DIM>(partial_o, partial_lse, out, seq_len, splits, total_rows,
                                       heads, sinks, lse);
}
