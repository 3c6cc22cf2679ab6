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
// Causal masking is bottom-right aligned: query row r sees keys k <= r + kv_len - seq_len.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

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
#ifndef CAUSAL
#define CAUSAL 0
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
#define CHUNKS_PER_ROW (HEAD_DIM / 8)
#define MERGE_STRIDE (HEAD_DIM + 4)        // floats per row of the warps' merge scratch

static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM must be a multiple of 16");
static_assert(KEYS_PER_WARP % 16 == 0 && KEYS_PER_WARP >= 16, "each warp scores whole k16 steps");
static_assert(M_TILES >= 1 && M_TILES <= 2, "16 or 32 packed rows");
static_assert(STAGES >= 2, "the ring needs two stages");

#if IS_FP16
typedef __half elem_t;
#define MMA_TYPE "f16"
#else
typedef __nv_bfloat16 elem_t;
#define MMA_TYPE "bf16"
#endif

// ---------------------------------------------------------------- primitives

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; src_bytes = 0 zero-fills (rows past the end).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                            uint32_t& r3, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// D = A(16x16, row) * B(16x8, col) + D, fp32 accumulators.
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
#if IS_FP16
    __half2 h = __floats2half2_rn(lo, hi);
#else
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
#endif
    return *reinterpret_cast<uint32_t*>(&h);
}

// TILE_ROWS rows of HEAD_DIM global -> shared by cp.async, 16 bytes a thread per pass.
// Rows at or past valid_rows are zero-filled (CHECK_ROWS: only a range's last tile).
template <int TILE_ROWS, bool CHECK_ROWS>
__device__ __forceinline__ void load_rows_async(elem_t* smem, const elem_t* gmem,
                                                int valid_rows, int tid) {
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS_PER_ROW;
    if constexpr (ROWS_PER_PASS >= 1 && THREADS % CHUNKS_PER_ROW == 0) {
        const int row = tid / CHUNKS_PER_ROW;
        const int col = (tid % CHUNKS_PER_ROW) * 8;
        const uint32_t dst = smem_addr(smem + row * ROW_STRIDE + col);
        const elem_t* src = gmem + row * HEAD_DIM + col;
#pragma unroll
        for (int pass = 0; pass < (TILE_ROWS + ROWS_PER_PASS - 1) / ROWS_PER_PASS; ++pass) {
            const int r = row + pass * ROWS_PER_PASS;
            if (TILE_ROWS % ROWS_PER_PASS != 0 && r >= TILE_ROWS) break;
            const bool valid = !CHECK_ROWS || r < valid_rows;
            cp_async_16(dst + pass * ROWS_PER_PASS * ROW_STRIDE * (int)sizeof(elem_t),
                        valid ? src : gmem, valid ? 16 : 0);
            src += ROWS_PER_PASS * HEAD_DIM;
            asm volatile("" : "+l"(src));  // keep one pointer, not one per pass
        }
    } else {
        for (int c = tid; c < TILE_ROWS * CHUNKS_PER_ROW; c += THREADS) {
            const int r = c / CHUNKS_PER_ROW;
            const int col = (c % CHUNKS_PER_ROW) * 8;
            const bool valid = !CHECK_ROWS || r < valid_rows;
            cp_async_16(smem_addr(smem + r * ROW_STRIDE + col),
                        valid ? gmem + r * HEAD_DIM + col : gmem, valid ? 16 : 0);
        }
    }
}

// The K and V tiles starting at key0 into ring slot `slot` (the commit is the caller's).
__device__ __forceinline__ void load_kv_async(elem_t* s_kv, const elem_t* k_h, const elem_t* v_h,
                                              int key0, int key_end, int slot, int tid) {
    elem_t* s_k = s_kv + (2 * slot) * BLOCK_N * ROW_STRIDE;
    const size_t offset = (size_t)key0 * HEAD_DIM;
    if (key0 + BLOCK_N <= key_end) {
        load_rows_async<BLOCK_N, false>(s_k, k_h + offset, BLOCK_N, tid);
        load_rows_async<BLOCK_N, false>(s_k + BLOCK_N * ROW_STRIDE, v_h + offset, BLOCK_N, tid);
    } else {
        load_rows_async<BLOCK_N, true>(s_k, k_h + offset, key_end - key0, tid);
        load_rows_async<BLOCK_N, true>(s_k + BLOCK_N * ROW_STRIDE, v_h + offset, key_end - key0,
                                       tid);
    }
}

// ---------------------------------------------------------------- attention

extern "C" __global__ void __launch_bounds__(THREADS)
decode_f16_attention(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                     const elem_t* __restrict__ v, elem_t* __restrict__ out,
                     float* __restrict__ partial_o, float* __restrict__ partial_lse, int seq_len,
                     int kv_len, int group, int keys_per_split, float scale_log2) {
    extern __shared__ __align__(128) unsigned char shared_raw[];
    elem_t* s_q = reinterpret_cast<elem_t*>(shared_raw);
    elem_t* s_kv = s_q + ROWS * ROW_STRIDE;  // STAGES x (K tile, V tile)
    float* s_merge = reinterpret_cast<float*>(s_kv);  // after the loop: WARPS x ROWS rows

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

    const int causal_offset = kv_len - seq_len;
    const int key_begin = split * keys_per_split;
    const int key_end = min(kv_len, key_begin + keys_per_split);
    const int n_tiles = key_end > key_begin ? (key_end - key_begin + BLOCK_N - 1) / BLOCK_N : 0;

    load_rows_async<ROWS, true>(s_q, q + (q_row0 + row0) * HEAD_DIM, packed_rows - row0, tid);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_tiles) load_kv_async(s_kv, k_h, v_h, key_begin + s * BLOCK_N, key_end, s, tid);
        cp_async_commit();
    }

    // Per-lane ldmatrix row/column offsets (the PTX ISA's fragment layouts).
    const int a_row = lane % 16;
    const int a_col = (lane / 16) * 8;
    const int b_row = (lane / 16) * 8 + (lane % 8);
    const int b_col = ((lane / 8) % 2) * 8;
    const int v_row = ((lane / 8) % 2) * 8 + (lane % 8);
    const int v_col = (lane / 16) * 8;

    // The query row (within the head) of each accumulator row this lane holds.
    int query_row[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            query_row[mt][half] = (row0 + mt * 16 + lane / 4 + half * 8) % seq_len;

    float o_acc[M_TILES][D_TILES][4];
    float row_max[M_TILES][2];  // scaled (log2 domain) running max of rows lane/4, lane/4 + 8
    float row_sum[M_TILES][2];  // this lane's share of the running sum
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
            for (int i = 0; i < 4; ++i) o_acc[mt][dt][i] = 0.f;
        row_max[mt][0] = row_max[mt][1] = -INFINITY;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }

    for (int t = 0; t < n_tiles; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            const int next = t + STAGES - 1;
            if (next < n_tiles)
                load_kv_async(s_kv, k_h, v_h, key_begin + next * BLOCK_N, key_end, next % STAGES,
                              tid);
            cp_async_commit();
        }
        const int key0 = key_begin + t * BLOCK_N + warp * KEYS_PER_WARP;
        if (key0 >= key_end) continue;  // this warp's slice lies past the split
        const elem_t* s_k = s_kv + (2 * (t % STAGES)) * BLOCK_N * ROW_STRIDE +
                            warp * KEYS_PER_WARP * ROW_STRIDE;
        const elem_t* s_v = s_k + BLOCK_N * ROW_STRIDE;

        // ---- S = Q K^T over the warp's slice (Q's fragments re-read from shared
        // memory: registers go to the accumulators; decode is bound by DRAM anyway)
        float s_acc[M_TILES][N_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) s_acc[mt][nt][i] = 0.f;
#pragma unroll
        for (int ds = 0; ds < D_STEPS; ++ds) {
            uint32_t a[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                ldmatrix_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3],
                            smem_addr(s_q + (mt * 16 + a_row) * ROW_STRIDE + ds * 16 + a_col));
#pragma unroll
            for (int np = 0; np < N_TILES / 2; ++np) {
                uint32_t b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3,
                            smem_addr(s_k + (np * 16 + b_row) * ROW_STRIDE + ds * 16 + b_col));
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    mma_16816(s_acc[mt][2 * np], a[mt], b0, b1);
                    mma_16816(s_acc[mt][2 * np + 1], a[mt], b2, b3);
                }
            }
        }

        // ---- mask: keys past the split's end and, under causal, past each row's diagonal
        const bool tail = key0 + KEYS_PER_WARP > key_end;
        const bool diagonal = CAUSAL && key0 + KEYS_PER_WARP - 1 > causal_offset;
        if (tail || diagonal) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int key = key0 + nt * 8 + (lane % 4) * 2 + (i % 2);
                        bool masked = key >= key_end;
                        if (CAUSAL) masked = masked || key > query_row[mt][i / 2] + causal_offset;
                        if (masked) s_acc[mt][nt][i] = -INFINITY;
                    }
        }

        // ---- online softmax (fp32, log2 domain) and O += P V, P in registers
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float tile_max = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
                    tile_max = fmaxf(tile_max,
                                     fmaxf(s_acc[mt][nt][2 * half], s_acc[mt][nt][2 * half + 1]));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 2));
                const float new_max = fmaxf(row_max[mt][half], tile_max * scale_log2);
                const float base = new_max == -INFINITY ? 0.f : new_max;
                const float correction = fast_exp2(row_max[mt][half] - base);
                row_max[mt][half] = new_max;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt) {
                    const float p0 = fast_exp2(s_acc[mt][nt][2 * half] * scale_log2 - base);
                    const float p1 = fast_exp2(s_acc[mt][nt][2 * half + 1] * scale_log2 - base);
                    s_acc[mt][nt][2 * half] = p0;
                    s_acc[mt][nt][2 * half + 1] = p1;
                    sum += p0 + p1;
                }
                row_sum[mt][half] = row_sum[mt][half] * correction + sum;
#pragma unroll
                for (int dt = 0; dt < D_TILES; ++dt) {
                    o_acc[mt][dt][2 * half] *= correction;
                    o_acc[mt][dt][2 * half + 1] *= correction;
                }
            }
        }
#pragma unroll
        for (int ks = 0; ks < N_STEPS; ++ks) {
            uint32_t p_frag[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                p_frag[mt][0] = pack_pair(s_acc[mt][2 * ks][0], s_acc[mt][2 * ks][1]);
                p_frag[mt][1] = pack_pair(s_acc[mt][2 * ks][2], s_acc[mt][2 * ks][3]);
                p_frag[mt][2] = pack_pair(s_acc[mt][2 * ks + 1][0], s_acc[mt][2 * ks + 1][1]);
                p_frag[mt][3] = pack_pair(s_acc[mt][2 * ks + 1][2], s_acc[mt][2 * ks + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < D_TILES / 2; ++dp) {
                uint32_t b0, b1, b2, b3;
                ldmatrix_x4_trans(b0, b1, b2, b3,
                                  smem_addr(s_v + (ks * 16 + v_row) * ROW_STRIDE + dp * 16 + v_col));
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    mma_16816(o_acc[mt][2 * dp], p_frag[mt], b0, b1);
                    mma_16816(o_acc[mt][2 * dp + 1], p_frag[mt], b2, b3);
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring: it becomes the merge scratch

    // ---- each warp's state to shared memory: unnormalised O, its row max and row sum
    float* mine = s_merge + warp * ROWS * MERGE_STRIDE;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float s = row_sum[mt][half];
            s += __shfl_xor_sync(0xffffffff, s, 1);
            s += __shfl_xor_sync(0xffffffff, s, 2);
            const int r = mt * 16 + lane / 4 + half * 8;
            float* row = mine + r * MERGE_STRIDE;
#pragma unroll
            for (int dt = 0; dt < D_TILES; ++dt)
                *reinterpret_cast<float2*>(row + dt * 8 + (lane % 4) * 2) =
                    make_float2(o_acc[mt][dt][2 * half], o_acc[mt][dt][2 * half + 1]);
            if (lane % 4 == 0) {
                row[HEAD_DIM] = row_max[mt][half];
                row[HEAD_DIM + 1] = s;
            }
        }
    __syncthreads();

    // ---- merge the warps: 4 output elements a thread
    constexpr int VECS_PER_ROW = HEAD_DIM / 4;
    for (int vec = tid; vec < ROWS * VECS_PER_ROW; vec += THREADS) {
        const int r = vec / VECS_PER_ROW;
        const int col = (vec % VECS_PER_ROW) * 4;
        const int packed = row0 + r;
        if (packed >= packed_rows) break;  // rows only grow with vec
        float top = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w)
            top = fmaxf(top, s_merge[(w * ROWS + r) * MERGE_STRIDE + HEAD_DIM]);
        const float base = top == -INFINITY ? 0.f : top;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float* row = s_merge + (w * ROWS + r) * MERGE_STRIDE;
            const float weight = fast_exp2(row[HEAD_DIM] - base);
            const float4 o = *reinterpret_cast<const float4*>(row + col);
            acc.x += weight * o.x;
            acc.y += weight * o.y;
            acc.z += weight * o.z;
            acc.w += weight * o.w;
            total += weight * row[HEAD_DIM + 1];
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        if (splits == 1) {
            uint2 packed_out;
            packed_out.x = pack_pair(acc.x * inv, acc.y * inv);
            packed_out.y = pack_pair(acc.z * inv, acc.w * inv);
            *reinterpret_cast<uint2*>(out + (q_row0 + packed) * HEAD_DIM + col) = packed_out;
        } else {
            // query head kv_head * group + packed / seq_len, row packed % seq_len
            const size_t head = (size_t)kv_head * group + packed / seq_len;
            const size_t part_row = (head * splits + split) * seq_len + packed % seq_len;
            *reinterpret_cast<float4*>(partial_o + part_row * HEAD_DIM + col) =
                make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
            if (col == 0) partial_lse[part_row] = total > 0.f ? top + __log2f(total) : -INFINITY;
        }
    }
}

// ---------------------------------------------------------------- split merge

// out[row] = sum_s 2^(lse_s - lse) * partial_o[s][row], lse = log2 sum_s 2^lse_s: the
// contract of mma_f16_split_merge. One thread per 4 output elements; 128 threads a block.
extern "C" __global__ void __launch_bounds__(128)
decode_f16_split_merge(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
                       elem_t* __restrict__ out, int seq_len, int splits, int total_rows) {
    constexpr int VECS_PER_ROW = HEAD_DIM / 4;
    const long long vec = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec >= (long long)total_rows * VECS_PER_ROW) return;
    const int global_row = (int)(vec / VECS_PER_ROW);
    const int col = (int)(vec % VECS_PER_ROW) * 4;
    const int bh = global_row / seq_len;
    const int row = global_row % seq_len;
    const size_t base = (size_t)bh * splits * seq_len + row;

    float lse_max = -INFINITY;
    for (int s = 0; s < splits; ++s) lse_max = fmaxf(lse_max, partial_lse[base + (size_t)s * seq_len]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float weight_sum = 0.f;
    if (lse_max != -INFINITY) {
        for (int s = 0; s < splits; ++s) {
            const size_t r = base + (size_t)s * seq_len;
            const float w = fast_exp2(partial_lse[r] - lse_max);
            const float4 o = *reinterpret_cast<const float4*>(partial_o + r * HEAD_DIM + col);
            acc.x += w * o.x;
            acc.y += w * o.y;
            acc.z += w * o.z;
            acc.w += w * o.w;
            weight_sum += w;
        }
    }
    const float inv = weight_sum > 0.f ? 1.f / weight_sum : 0.f;
    uint2 packed;
    packed.x = pack_pair(acc.x * inv, acc.y * inv);
    packed.y = pack_pair(acc.z * inv, acc.w * inv);
    *reinterpret_cast<uint2*>(out + (size_t)global_row * HEAD_DIM + col) = packed;
}
