// FlashAttention-2 style tiled attention, float32, with split-KV.
//
// Compile-time constants (from tuner.planner.tunable.KernelPlan.compile_defines):
//   HEAD_DIM        columns of q, k, v (multiple of 4)
//   TILE_SIZE       key rows per shared-memory tile
//   ROWS_PER_BLOCK  query rows a block owns
//   THREADS         threads per block
//   THREADS_PER_ROW lanes sharing a query row (power of two <= 32)
//   CAUSAL          1: key j attends query i only when j <= i + kv_len - seq_len
//                   (bottom-right aligned, as FlashAttention with a KV cache)
//
// Layout: q, out are contiguous [batch*heads][seq_len][HEAD_DIM], k, v
// [batch*kv_heads][kv_len][HEAD_DIM]; query head h reads KV head h / kv_group.
// Grid: (ceil(seq_len / ROWS_PER_BLOCK), sequence_splits, batch*heads): the split-KV
// contract of include/fa/split_kv.cuh, the causal mask of include/fa/mask.cuh. The
// variant arguments (include/fa/variant.cuh) are taken and, but for `lse`, unused: the
// planner refuses windows, softcaps, ALiBi and sinks for this SIMT family.
// With one split the kernel writes normalised rows to `out` (and each row's natural-log
// log-sum-exp to `lse` when given); with more, each split writes its accumulator
// normalised by its own sum and its log2-sum-exp, and `split_merge` (the shared merge)
// combines them. Scores live in the log2 domain: q
// is pre-multiplied by log2(e)/sqrt(HEAD_DIM), so exp2f is the only
// transcendental in the hot loop.
//
// Shared memory (dynamic, bytes = tuner.planner.tunable.tiled_shared_bytes):
//   q_s [ROWS_PER_BLOCK][HEAD_DIM + 4]   k_s, v_s [TILE_SIZE][HEAD_DIM + 4]
//   p_s [ROWS_PER_BLOCK][TILE_SIZE + 4]
// The 4-float row padding puts consecutive rows' 16-byte loads in different
// bank groups, so the strided rows of the score loop are conflict-free.

#include "fa/mask.cuh"
#include "fa/softmax.cuh"
#include "fa/split_kv.cuh"
#include "fa/split_merge.cuh"

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif

#define ROW_GROUPS (THREADS / THREADS_PER_ROW)
#define ROWS_PER_THREAD (ROWS_PER_BLOCK / ROW_GROUPS)
#define KEYS_PER_LANE (TILE_SIZE / THREADS_PER_ROW)
#define VECS_PER_LANE (HEAD_DIM / (4 * THREADS_PER_ROW))
#define ROW_STRIDE (HEAD_DIM + 4)
#define P_STRIDE (TILE_SIZE + 4)
#define VECS_PER_ROW (HEAD_DIM / 4)

static_assert(HEAD_DIM % 4 == 0, "HEAD_DIM must be a multiple of 4");
static_assert(THREADS % THREADS_PER_ROW == 0, "THREADS_PER_ROW must divide THREADS");
static_assert(THREADS_PER_ROW <= 32 && (THREADS_PER_ROW & (THREADS_PER_ROW - 1)) == 0,
              "THREADS_PER_ROW must be a power of two within a warp");
static_assert(ROWS_PER_BLOCK % ROW_GROUPS == 0, "row groups must divide ROWS_PER_BLOCK");
static_assert(TILE_SIZE % THREADS_PER_ROW == 0, "THREADS_PER_ROW must divide TILE_SIZE");
static_assert(HEAD_DIM % (4 * THREADS_PER_ROW) == 0, "each lane owns whole float4 columns");
static_assert(TILE_SIZE % 4 == 0, "TILE_SIZE must be a multiple of 4");

__device__ __forceinline__ float row_group_max(float value) {
#pragma unroll
    for (int offset = THREADS_PER_ROW / 2; offset > 0; offset /= 2)
        value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    return value;
}

__device__ __forceinline__ float row_group_sum(float value) {
#pragma unroll
    for (int offset = THREADS_PER_ROW / 2; offset > 0; offset /= 2)
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

// Cooperative, coalesced 16-byte copy of `rows` rows starting at global row
// `first` into a padded shared tile, scaled; rows past seq_len become zeros.
__device__ __forceinline__ void load_rows(float* tile, const float* __restrict__ src,
                                          int first, int rows, int seq_len, float scale) {
    for (int i = threadIdx.x; i < rows * VECS_PER_ROW; i += THREADS) {
        const int r = i / VECS_PER_ROW;
        const int c = i - r * VECS_PER_ROW;
        float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
        if (first + r < seq_len) {
            value = __ldg(reinterpret_cast<const float4*>(src + (size_t)(first + r) * HEAD_DIM) + c);
            value.x *= scale; value.y *= scale; value.z *= scale; value.w *= scale;
        }
        *reinterpret_cast<float4*>(tile + r * ROW_STRIDE + 4 * c) = value;
    }
}

// Asynchronous 16-byte global->shared copies (cp.async, sm_80+): the copy
// engine fills a tile while the block computes on another, so K and V loads
// hide behind the score and P.V loops without a second shared buffer. Rows
// past seq_len are zero-filled (source size 0).
__device__ __forceinline__ void load_rows_async(float* tile, const float* __restrict__ src,
                                                int first, int rows, int seq_len) {
    for (int i = threadIdx.x; i < rows * VECS_PER_ROW; i += THREADS) {
        const int r = i / VECS_PER_ROW;
        const int c = i - r * VECS_PER_ROW;
        const bool inside = first + r < seq_len;
        const float* from = src + (size_t)(inside ? first + r : 0) * HEAD_DIM + 4 * c;
        const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(tile + r * ROW_STRIDE + 4 * c));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                     :: "r"(to), "l"(from), "r"(inside ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int PENDING>
__device__ __forceinline__ void wait_async_copies() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING));
}

extern "C" __global__ void __launch_bounds__(THREADS)
tiled_attention(const float* __restrict__ q, const float* __restrict__ k,
                const float* __restrict__ v, float* __restrict__ out,
                float* __restrict__ partial_o, float* __restrict__ partial_lse,
                int seq_len, int kv_len, int kv_group, int keys_per_split, float scale_log2,
                int heads, int window_left, int window_right, float softcap,
                const float* __restrict__ alibi_slopes, const float* __restrict__ sinks,
                float* __restrict__ lse) {
    extern __shared__ float4 shared_vec[];
    float* q_s = reinterpret_cast<float*>(shared_vec);
    float* k_s = q_s + ROWS_PER_BLOCK * ROW_STRIDE;
    float* v_s = k_s + TILE_SIZE * ROW_STRIDE;
    float* p_s = v_s + TILE_SIZE * ROW_STRIDE;

    const int lane = threadIdx.x % THREADS_PER_ROW;
    const int group = threadIdx.x / THREADS_PER_ROW;
    const int row0 = blockIdx.x * ROWS_PER_BLOCK;
    const int split = blockIdx.y;
    const size_t head = blockIdx.z;
    const size_t head_offset = head * (size_t)seq_len * HEAD_DIM;
    // Query head `head` reads KV head head / kv_group (grouped-query attention).
    const size_t kv_offset = (head / kv_group) * (size_t)kv_len * HEAD_DIM;
    const fa::Mask<CAUSAL, false> mask(seq_len, kv_len, window_left, window_right);
    q += head_offset;
    k += kv_offset;
    v += kv_offset;

    const fa::KeyTiles tiles =
        fa::key_tiles<TILE_SIZE>(mask, split, keys_per_split, row0, row0 + ROWS_PER_BLOCK - 1);
    const int key_begin = tiles.begin;
    const int key_end = tiles.end;

    load_rows(q_s, q, row0, ROWS_PER_BLOCK, seq_len, scale_log2);
    __syncthreads();  // q_s is read by every warp

    float row_max[ROWS_PER_THREAD];
    float row_sum[ROWS_PER_THREAD];
    float4 acc[ROWS_PER_THREAD][VECS_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROWS_PER_THREAD; ++i) {
        row_max[i] = -INFINITY;
        row_sum[i] = 0.f;
#pragma unroll
        for (int c = 0; c < VECS_PER_LANE; ++c) acc[i][c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

    // Pipeline per tile t: V(t) lands while S(t) is computed; K(t+1) lands
    // while the softmax and P.V of tile t run. Copy groups complete in order.
    if (key_begin < key_end) load_rows_async(k_s, k, key_begin, TILE_SIZE, kv_len);
    for (int tile_start = key_begin; tile_start < key_end; tile_start += TILE_SIZE) {
        load_rows_async(v_s, v, tile_start, TILE_SIZE, kv_len);  // v_s free: P.V(t-1) done
        wait_async_copies<1>();  // K(t) has landed (V(t) may still be in flight)
        __syncthreads();

        float score[ROWS_PER_THREAD][KEYS_PER_LANE];
#pragma unroll
        for (int i = 0; i < ROWS_PER_THREAD; ++i)
#pragma unroll
            for (int j = 0; j < KEYS_PER_LANE; ++j) score[i][j] = 0.f;

#pragma unroll 4
        for (int d = 0; d < HEAD_DIM; d += 4) {
            float4 qv[ROWS_PER_THREAD];
            float4 kv[KEYS_PER_LANE];
#pragma unroll
            for (int i = 0; i < ROWS_PER_THREAD; ++i)
                qv[i] = *reinterpret_cast<const float4*>(q_s + (group + i * ROW_GROUPS) * ROW_STRIDE + d);
#pragma unroll
            for (int j = 0; j < KEYS_PER_LANE; ++j)
                kv[j] = *reinterpret_cast<const float4*>(k_s + (lane + j * THREADS_PER_ROW) * ROW_STRIDE + d);
#pragma unroll
            for (int i = 0; i < ROWS_PER_THREAD; ++i)
#pragma unroll
                for (int j = 0; j < KEYS_PER_LANE; ++j) {
                    score[i][j] = fmaf(qv[i].x, kv[j].x, score[i][j]);
                    score[i][j] = fmaf(qv[i].y, kv[j].y, score[i][j]);
                    score[i][j] = fmaf(qv[i].z, kv[j].z, score[i][j]);
                    score[i][j] = fmaf(qv[i].w, kv[j].w, score[i][j]);
                }
        }

        __syncthreads();  // every warp is done reading k_s
        const bool has_next = tile_start + TILE_SIZE < key_end;
        if (has_next) load_rows_async(k_s, k, tile_start + TILE_SIZE, TILE_SIZE, kv_len);

#pragma unroll
        for (int i = 0; i < ROWS_PER_THREAD; ++i) {
            const int local_row = group + i * ROW_GROUPS;
            const int query = row0 + local_row;
            float tile_max = -INFINITY;
#pragma unroll
            for (int j = 0; j < KEYS_PER_LANE; ++j) {
                const int key = tile_start + lane + j * THREADS_PER_ROW;
                const bool valid = key < key_end && mask.in_band(query, key);
                score[i][j] = valid ? score[i][j] : -INFINITY;
                tile_max = fmaxf(tile_max, score[i][j]);
            }
            tile_max = row_group_max(tile_max);
            const float new_max = fmaxf(row_max[i], tile_max);
            // A row that has seen only masked keys keeps max -inf; subtracting
            // 0 instead keeps exp2f(-inf) = 0 and avoids inf - inf = NaN.
            const float shift = new_max == -INFINITY ? 0.f : new_max;
            const float correction = exp2f(row_max[i] - shift);
            float tile_sum = 0.f;
#pragma unroll
            for (int j = 0; j < KEYS_PER_LANE; ++j) {
                const float p = exp2f(score[i][j] - shift);
                tile_sum += p;
                p_s[local_row * P_STRIDE + lane + j * THREADS_PER_ROW] = p;
            }
            tile_sum = row_group_sum(tile_sum);
            row_sum[i] = row_sum[i] * correction + tile_sum;
            row_max[i] = new_max;
#pragma unroll
            for (int c = 0; c < VECS_PER_LANE; ++c) {
                acc[i][c].x *= correction; acc[i][c].y *= correction;
                acc[i][c].z *= correction; acc[i][c].w *= correction;
            }
            (void)query;
        }
        if (has_next) wait_async_copies<1>(); else wait_async_copies<0>();  // V(t) landed
        __syncthreads();

#pragma unroll 2
        for (int key = 0; key < TILE_SIZE; key += 4) {
            float4 pv[ROWS_PER_THREAD];
#pragma unroll
            for (int i = 0; i < ROWS_PER_THREAD; ++i)
                pv[i] = *reinterpret_cast<const float4*>(p_s + (group + i * ROW_GROUPS) * P_STRIDE + key);
#pragma unroll
            for (int t = 0; t < 4; ++t) {
#pragma unroll
                for (int c = 0; c < VECS_PER_LANE; ++c) {
                    const float4 vv = *reinterpret_cast<const float4*>(
                        v_s + (key + t) * ROW_STRIDE + 4 * (lane + c * THREADS_PER_ROW));
#pragma unroll
                    for (int i = 0; i < ROWS_PER_THREAD; ++i) {
                        const float p = t == 0 ? pv[i].x : t == 1 ? pv[i].y : t == 2 ? pv[i].z : pv[i].w;
                        acc[i][c].x = fmaf(p, vv.x, acc[i][c].x);
                        acc[i][c].y = fmaf(p, vv.y, acc[i][c].y);
                        acc[i][c].z = fmaf(p, vv.z, acc[i][c].z);
                        acc[i][c].w = fmaf(p, vv.w, acc[i][c].w);
                    }
                }
            }
        }
        __syncthreads();  // P.V done with v_s and p_s before V(t+1) and P(t+1) land
    }

    const bool single_split = gridDim.y == 1;
#pragma unroll
    for (int i = 0; i < ROWS_PER_THREAD; ++i) {
        const int query = row0 + group + i * ROW_GROUPS;
        if (query >= seq_len) continue;
        const fa::RowResult result = fa::partial_result(row_max[i], row_sum[i]);
        float* dst;
        if (single_split) {
            dst = out + head_offset + (size_t)query * HEAD_DIM;
            if (lse != nullptr && lane == 0)
                lse[head * seq_len + query] = fa::lse_natural(result.lse2);
        } else {
            const size_t partial_row = (head * gridDim.y + split) * (size_t)seq_len + query;
            dst = partial_o + partial_row * HEAD_DIM;
            if (lane == 0) partial_lse[partial_row] = result.lse2;
        }
#pragma unroll
        for (int c = 0; c < VECS_PER_LANE; ++c) {
            float4 value = acc[i][c];
            value.x *= result.inv; value.y *= result.inv;
            value.z *= result.inv; value.w *= result.inv;
            *reinterpret_cast<float4*>(dst + 4 * (lane + c * THREADS_PER_ROW)) = value;
        }
    }
}

// Merge the splits of every row (the shared merge of include/fa/split_merge.cuh).
extern "C" __global__ void __launch_bounds__(fa::kMergeThreads)
split_merge(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
            float* __restrict__ out, int seq_len, int splits, int total_rows, int heads,
            const float* __restrict__ sinks, float* __restrict__ lse) {
    fa::merge_splits<float, HEAD_DIM>(partial_o, partial_lse, out, seq_len, splits, total_rows,
                                      heads, sinks, lse);
}
