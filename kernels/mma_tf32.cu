// FlashAttention-2 forward on tensor cores for float32 inputs: TF32 mma.sync
// (m16n8k8, fp32 accumulate, sm_80+, run here on sm_90), one pass or three.
//
// PASSES = 3 is the "3xTF32" split (CUTLASS's OpMultiplyAddFastF32, what
// torch's float32 "efficient" SDPA runs): every operand x becomes
// hi = rna_tf32(x) and lo = rna_tf32(x - hi), and each product accumulates
// lo*hi + hi*lo first, then hi*hi (the small terms first, so they are not lost
// against the large one); lo*lo is below float32's rounding and is dropped.
// The error is float32-class (about 22 significand bits per operand).
// PASSES = 1 is one TF32 product hi*hi (10-bit significands): faster, and
// about 2^-11 relative error per operand.
//
// One block owns BLOCK_M query rows of one (batch, head); its WARPS warps own
// 16 or 32 rows each (M_TILES m16 tiles). K and V tiles of BLOCK_N keys stream
// through a STAGES-deep cp.async ring in shared memory; the online softmax
// runs in fp32 on exp2 with the 1/sqrt(d) * log2(e) scale folded in.
//
// Fragments (PTX ISA, mma.m16n8k8 .tf32; g = lane / 4, t = lane % 4):
//   A (16x8, row): a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)
//   B (8x8, col):  b0 (k=t, n=g), b1 (k=t+4, n=g)
//   C (16x8):      c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)
// ldmatrix (b16, 8x8) hands lane l the 4 bytes at row l/4, bytes 4*(l%4): for
// 32-bit data that is element (g, t) of an 8-row x 4-float block, so Q (row
// major) and K (key major, i.e. B column major) load with plain ldmatrix.x4.
// P = exp(S) sits in C layout (keys 2t, 2t+1) where the A operand wants keys
// t, t+4. The key index is summed over, so the kernel permutes keys instead of
// shuffling: A = (c0, c2, c1, c3) means "A column t is key 2t, column t+4 is
// key 2t+1", and V's B fragment takes the same keys: b0 = V[2t][g],
// b1 = V[2t+1][g], read by scalar loads (ldmatrix.trans is 16-bit only).
//
// Shared memory rows are HEAD_DIM + 4 floats: for HEAD_DIM a multiple of 8 the
// eight rows an ldmatrix phase reads start in eight distinct 16-byte bank
// groups, and the scalar V loads (rows 2t, columns g) hit 32 distinct banks.
//
// Layout contract with tuner/planner/families/mma_tf32.py:
//   dynamic shared bytes = 4 * (HEAD_DIM + 4) * (BLOCK_M + 2 * STAGES * BLOCK_N)
//   grid = (ceil(seq_len / BLOCK_M), splits, batch * heads), block = 32 * WARPS
//   keys_per_split is a multiple of BLOCK_N; split s covers keys
//   [s * keys_per_split, min(kv_len, (s + 1) * keys_per_split)).
//   q, out: [batch * heads][seq_len][HEAD_DIM]; k, v: [batch * kv_heads][kv_len][HEAD_DIM];
//   query head bh reads KV head bh / group (group = heads / kv_heads), sharing K/V
//   with the other heads of its group through L2 only.
// Masks (causal bottom-right, sliding window), score modifications (softcap, ALiBi),
// sinks, the split-KV contract and the split merge are the shared device layer's
// (include/fa/), with the heaviest causal row blocks scheduled first.
// With one split the kernel writes the normalised float32 output; with several
// it writes float32 partial outputs (normalised per split) and their
// log2-sum-exp, which mma_tf32_split_merge combines.

#include "fa/forward.cuh"
#include "fa/variant_switches.cuh"

// Defaults: the planner's default plan (tuner/planner/families/mma_tf32.py).
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_M
#define BLOCK_M 64
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
#ifndef PASSES
#define PASSES 3
#endif

#define THREADS (WARPS * 32)
#define ROWS_PER_WARP (BLOCK_M / WARPS)
#define M_TILES (ROWS_PER_WARP / 16)
#define N_TILES (BLOCK_N / 8)     // n8 tiles of S per m tile (= k8 steps of P V)
#define D_TILES (HEAD_DIM / 8)    // n8 tiles of O per m tile (= k8 steps of Q K^T)
#define ROW_STRIDE (HEAD_DIM + 4) // floats per shared-memory row

static_assert(HEAD_DIM % 8 == 0, "HEAD_DIM must be a multiple of 8");
static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16");
static_assert(BLOCK_M % (16 * WARPS) == 0, "each warp owns whole m16 tiles");
static_assert(M_TILES >= 1 && M_TILES <= 2, "16 or 32 rows per warp");
static_assert(PASSES == 1 || PASSES == 3, "one TF32 pass or the 3xTF32 split");

struct Traits : fa::SwitchedVariant {
    // float32 problems: the softcap's tanh in float32, not the SFU's 11 bits
    using ScoreModType = fa::ScoreMod<kSoftcap, kAlibi, true>;
    using Ring = fa::KVRing<float, HEAD_DIM, ROW_STRIDE, THREADS, BLOCK_N, STAGES>;
    using QCopy = fa::TileCopy<float, HEAD_DIM, ROW_STRIDE, THREADS>;
};

// ---------------------------------------------------------------- the TF32 split

// Round to TF32 (10 explicit significand bits), to nearest with ties away from
// zero: add half a TF32 ulp to the bit pattern, then clear the 13 low bits.
// This is cvt.rna.tf32.f32 without its inf/NaN guards, which cost ptxas four
// instructions a value (CUTLASS's round_half_ulp_truncate does the same); a
// finite input that rounds past the largest float becomes inf, as it should.
__device__ __forceinline__ uint32_t to_tf32(uint32_t bits) {
    return (bits + 0x1000u) & 0xffffe000u;
}

// One operand register as (hi, lo) TF32 parts; with one pass only hi exists.
struct Split {
    uint32_t hi;
#if PASSES == 3
    uint32_t lo;
#endif
};

__device__ __forceinline__ Split split(uint32_t bits) {
    Split s;
    s.hi = to_tf32(bits);
#if PASSES == 3
    // x - hi is exact in float32 (Sterbenz); its own rounding keeps 11 more bits.
    s.lo = to_tf32(__float_as_uint(__uint_as_float(bits) - __uint_as_float(s.hi)));
#endif
    return s;
}

// D += A B with A, B split: lo*hi + hi*lo, then hi*hi (or hi*hi alone).
__device__ __forceinline__ void mma_split(float* d, const Split* a, Split b0, Split b1) {
#if PASSES == 3
    fa::mma_1688_tf32(d, a[0].lo, a[1].lo, a[2].lo, a[3].lo, b0.hi, b1.hi);
    fa::mma_1688_tf32(d, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.lo, b1.lo);
#endif
    fa::mma_1688_tf32(d, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.hi, b1.hi);
}

// The small products alone (lo*hi + hi*lo) and the large one alone, for
// accumulators kept apart (see S = Q K^T).
__device__ __forceinline__ void mma_small(float* d, const Split* a, Split b0, Split b1) {
#if PASSES == 3
    fa::mma_1688_tf32(d, a[0].lo, a[1].lo, a[2].lo, a[3].lo, b0.hi, b1.hi);
    fa::mma_1688_tf32(d, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.lo, b1.lo);
#endif
}
__device__ __forceinline__ void mma_big(float* d, const Split* a, Split b0, Split b1) {
    fa::mma_1688_tf32(d, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.hi, b1.hi);
}

// ---------------------------------------------------------------- attention

extern "C" __global__ void __launch_bounds__(THREADS, 1)
mma_tf32_attention(const float* __restrict__ q, const float* __restrict__ k,
                   const float* __restrict__ v, float* __restrict__ out,
                   float* __restrict__ partial_o, float* __restrict__ partial_lse, int seq_len,
                   int kv_len, int group, int keys_per_split, float scale_log2, int heads,
                   int window_left, int window_right, float softcap,
                   const float* __restrict__ alibi_slopes, const float* __restrict__ sinks,
                   float* __restrict__ lse) {
    extern __shared__ __align__(128) unsigned char shared_raw[];
    float* s_q = reinterpret_cast<float*>(shared_raw);
    const Traits::Ring ring{s_q + BLOCK_M * ROW_STRIDE};  // STAGES x (K tile, V tile)

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const fa::RowBlock<Traits, BLOCK_M, BLOCK_N> block(seq_len, kv_len, group, keys_per_split,
                                                      window_left, window_right);
    const int bh = block.bh, row0 = block.row0, splits = block.splits;
    const Traits::MaskType& mask = block.mask;
    const fa::KeyTiles& tiles = block.tiles;
    const Traits::ScoreModType score_mod =
        block.score_mod(scale_log2, softcap, seq_len, kv_len, alibi_slopes, heads);

    const float* q_bh = q + (size_t)bh * seq_len * HEAD_DIM;
    const float* k_bh = k + (size_t)block.kv_bh * kv_len * HEAD_DIM;
    const float* v_bh = v + (size_t)block.kv_bh * kv_len * HEAD_DIM;

    Traits::QCopy::load<BLOCK_M, true>(s_q, q_bh + (size_t)row0 * HEAD_DIM, seq_len - row0, tid);
    fa::cp_async_commit();
    ring.prefetch(tiles.count, k_bh, v_bh, tiles.begin, kv_len, tid);

    // ldmatrix row addresses: lanes 8i..8i+7 address matrix i.
    const int a_row = (lane % 8) + ((lane / 8) % 2) * 8;  // Q: a0 a1 a2 a3
    const int a_col = (lane / 16) * 4;
    const int b_row = (lane % 8) + (lane / 16) * 8;       // K: (b0 b1) of two n8 tiles
    const int b_col = ((lane / 8) % 2) * 4;

    fa::cp_async_wait<STAGES - 1>();
    __syncthreads();
    const float* s_q_warp = s_q + warp * ROWS_PER_WARP * ROW_STRIDE;

    float o_acc[M_TILES][D_TILES][4];
    fa::fill_zero<M_TILES * D_TILES * 4>(&o_acc[0][0][0]);
    fa::SoftmaxRows softmax[M_TILES];
    const int warp_row0 = row0 + warp * ROWS_PER_WARP;
    const int warp_row_last = warp_row0 + ROWS_PER_WARP - 1;

    for (int tile = 0; tile < tiles.count; ++tile) {
        ring.advance(tile, tiles.count, k_bh, v_bh, tiles.begin, kv_len, tid);
        const float* s_k = ring.key_tile(tile % STAGES);
        const float* s_v = ring.value_tile(tile % STAGES);
        const int key0 = tiles.begin + tile * BLOCK_N;

        if (mask.skipped(key0, BLOCK_N, warp_row0, warp_row_last)) continue;

        // ---- S = Q K^T, k8 steps over the head dimension. The tensor cores add
        // into an fp32 accumulator by truncation (not round to nearest), so every
        // mma on a large accumulator loses up to an ulp of it, always toward zero.
        // With three passes the small products go to an accumulator of their own
        // (2^-11 of S's size: its truncation is negligible) and only the hi*hi
        // products touch S's: a third of the truncations on the large value.
        float s_acc[M_TILES][N_TILES][4];
#if PASSES == 3
        float s_small[M_TILES][N_TILES][4];
#endif
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    s_acc[mt][nt][i] = 0.f;
#if PASSES == 3
                    s_small[mt][nt][i] = 0.f;
#endif
                }
#pragma unroll
        for (int ds = 0; ds < D_TILES; ++ds) {
            Split a[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                uint32_t r[4];
                fa::ldmatrix_x4(r[0], r[1], r[2], r[3],
                                fa::smem_addr(s_q_warp + (mt * 16 + a_row) * ROW_STRIDE + ds * 8 +
                                              a_col));
#pragma unroll
                for (int i = 0; i < 4; ++i) a[mt][i] = split(r[i]);
            }
#pragma unroll
            for (int np = 0; np < N_TILES / 2; ++np) {
                uint32_t r[4];
                fa::ldmatrix_x4(r[0], r[1], r[2], r[3],
                                fa::smem_addr(s_k + (np * 16 + b_row) * ROW_STRIDE + ds * 8 +
                                              b_col));
                const Split b0 = split(r[0]), b1 = split(r[1]), b2 = split(r[2]),
                            b3 = split(r[3]);
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
#if PASSES == 3
                    mma_small(s_small[mt][2 * np], a[mt], b0, b1);
                    mma_small(s_small[mt][2 * np + 1], a[mt], b2, b3);
#endif
                    mma_big(s_acc[mt][2 * np], a[mt], b0, b1);
                    mma_big(s_acc[mt][2 * np + 1], a[mt], b2, b3);
                }
            }
        }
#if PASSES == 3
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) s_acc[mt][nt][i] += s_small[mt][nt][i];
#endif

        // ---- score modifications, then the mask (keys past kv_len, the causal
        // diagonal, the window), then the online softmax and O += P V, one m16 tile
        // at a time
        auto warp_rows = [&](int mt) -> fa::FragmentRows {
            return {warp_row0 + mt * 16 + fa::fragment_row(lane, 0),
                    warp_row0 + mt * 16 + fa::fragment_row(lane, 1)};
        };
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
            score_mod.apply<N_TILES>(&s_acc[mt][0][0], key0, warp_rows(mt), lane);
        if (mask.partial(key0, BLOCK_N, warp_row0, warp_row_last)) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                mask.apply<N_TILES>(&s_acc[mt][0][0], key0, warp_rows(mt), lane);
        }
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            float corrections[2];
            softmax[mt].update<N_TILES>(&s_acc[mt][0][0], score_mod.softmax_scale(), corrections);
            // A column t is key 2t, column t + 4 is key 2t + 1 (see the head comment).
            const float* v_rows = s_v + 2 * t * ROW_STRIDE + g;
#if PASSES == 3
            // P V of this tile into a fresh accumulator per n8 tile of O, folded into
            // O by an FFMA (round to nearest) with the rescale: the tensor cores'
            // truncating adds then see one tile's keys, never the whole key range
            // (over thousands of keys their bias toward zero grew past float32's
            // error: 8.6e-6 at 32768 keys against torch's 6.7e-8 on the H200).
            Split p[N_TILES][4];
#pragma unroll
            for (int ks = 0; ks < N_TILES; ++ks) {
                p[ks][0] = split(__float_as_uint(s_acc[mt][ks][0]));
                p[ks][1] = split(__float_as_uint(s_acc[mt][ks][2]));
                p[ks][2] = split(__float_as_uint(s_acc[mt][ks][1]));
                p[ks][3] = split(__float_as_uint(s_acc[mt][ks][3]));
            }
#pragma unroll
            for (int dt = 0; dt < D_TILES; ++dt) {
                float tile_o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int ks = 0; ks < N_TILES; ++ks) {
                    const Split b0 = split(__float_as_uint(v_rows[ks * 8 * ROW_STRIDE + dt * 8]));
                    const Split b1 =
                        split(__float_as_uint(v_rows[(ks * 8 + 1) * ROW_STRIDE + dt * 8]));
                    mma_split(tile_o, p[ks], b0, b1);
                }
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    o_acc[mt][dt][i] = fmaf(o_acc[mt][dt][i], corrections[i / 2], tile_o[i]);
            }
#else
            // One pass: TF32's own rounding (2^-11) dwarfs the truncation bias, so O
            // accumulates in place, every n8 tile of O an independent mma chain.
            fa::rescale_rows<D_TILES>(&o_acc[mt][0][0], corrections);
#pragma unroll
            for (int ks = 0; ks < N_TILES; ++ks) {
                Split p[4];
                p[0] = split(__float_as_uint(s_acc[mt][ks][0]));
                p[1] = split(__float_as_uint(s_acc[mt][ks][2]));
                p[2] = split(__float_as_uint(s_acc[mt][ks][1]));
                p[3] = split(__float_as_uint(s_acc[mt][ks][3]));
#pragma unroll
                for (int dt = 0; dt < D_TILES; ++dt) {
                    const Split b0 = split(__float_as_uint(v_rows[ks * 8 * ROW_STRIDE + dt * 8]));
                    const Split b1 =
                        split(__float_as_uint(v_rows[(ks * 8 + 1) * ROW_STRIDE + dt * 8]));
                    mma_split(o_acc[mt][dt], p, b0, b1);
                }
            }
#endif
        }
    }
    fa::cp_async_wait<0>();

    // One split: the normalised output. Several: float32 partial outputs
    // (normalised by this split's sum) and the split's log2-sum-exp (-inf where
    // the split saw no key of the row). A quad writes 32 contiguous bytes a row.
    const bool partial = splits > 1;
    const size_t part_row0 = ((size_t)bh * splits + block.split) * seq_len;
    const float sink = Traits::sink(sinks, bh % heads);
    float* out_bh = out + (size_t)bh * seq_len * HEAD_DIM;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        softmax[mt].finish();
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp_row0 + mt * 16 + fa::fragment_row(lane, half);
            if (row >= seq_len) continue;
            const fa::RowResult result =
                partial ? fa::partial_result(softmax[mt].max[half], softmax[mt].sum[half])
                        : fa::row_result(softmax[mt].max[half], softmax[mt].sum[half], sink);
            float* dst = partial ? partial_o + (part_row0 + row) * HEAD_DIM
                                 : out_bh + (size_t)row * HEAD_DIM;
            fa::store_fragment_row<D_TILES>(dst, &o_acc[mt][0][0], half, result.inv, lane);
            if (t == 0) {
                if (partial)
                    partial_lse[part_row0 + row] = result.lse2;
                else if (lse != nullptr)
                    lse[(size_t)bh * seq_len + row] = fa::lse_natural(result.lse2);
            }
        }
    }
}

// ---------------------------------------------------------------- split merge

extern "C" __global__ void __launch_bounds__(fa::kMergeThreads)
mma_tf32_split_merge(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
                     float* __restrict__ out, int seq_len, int splits, int total_rows, int heads,
                     const float* __restrict__ sinks, float* __restrict__ lse) {
    fa::merge_splits<float, HEAD_DIM>(partial_o, partial_lse, out, seq_len, splits, total_rows,
                                      heads, sinks, lse);
}
