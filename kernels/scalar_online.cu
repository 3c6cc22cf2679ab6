// Scalar online-softmax attention, float32: one query row per thread.
//
// The seed's ScalarOnline family and the GPU parity baseline for large
// problems. Each thread keeps its scaled query row in registers and its output
// accumulator in shared memory laid out [HEAD_DIM][THREADS] (thread-minor, so
// a warp's accesses hit 32 different banks); every key row is read by the
// whole block at one warp-uniform address (a broadcast through L1).
//
// Compile-time constants: HEAD_DIM (any > 0), THREADS, CAUSAL.
// Grid: (ceil(seq_len / THREADS), 1, batch*heads); dynamic shared memory
// THREADS * HEAD_DIM * 4 bytes (tuner.planner.tunable.scalar_shared_bytes).
// q, out: [batch*heads][seq_len][HEAD_DIM]; k, v: [batch*kv_heads][kv_len][HEAD_DIM];
// query head bh reads KV head bh / group. Causal masking is bottom-right aligned:
// row r sees keys k <= r + kv_len - seq_len (include/fa/mask.cuh). No variants: the
// planner refuses them for this family.

#include "fa/mask.cuh"

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif

extern "C" __global__ void __launch_bounds__(THREADS)
scalar_online_attention(const float* __restrict__ q, const float* __restrict__ k,
                        const float* __restrict__ v, float* __restrict__ out,
                        int seq_len, int kv_len, int group, float scale_log2) {
    extern __shared__ float o_s[];
    const int tid = threadIdx.x;
    const int row = blockIdx.x * THREADS + tid;
    const size_t head_offset = (size_t)blockIdx.z * seq_len * HEAD_DIM;
    const size_t kv_offset = (size_t)(blockIdx.z / group) * kv_len * HEAD_DIM;
    const fa::Mask<CAUSAL, false> mask(seq_len, kv_len, -1, -1);
    q += head_offset;
    k += kv_offset;
    v += kv_offset;
    const bool active = row < seq_len;

    float q_row[HEAD_DIM];
#pragma unroll
    for (int d = 0; d < HEAD_DIM; ++d) {
        q_row[d] = active ? __ldg(q + (size_t)row * HEAD_DIM + d) * scale_log2 : 0.f;
        o_s[d * THREADS + tid] = 0.f;
    }

    const int key_end = mask.end_key((int)(blockIdx.x + 1) * THREADS - 1);  // block-uniform
    float row_max = -INFINITY;
    float row_sum = 0.f;
    for (int key = 0; key < key_end; ++key) {
        const float* k_row = k + (size_t)key * HEAD_DIM;
        const float* v_row = v + (size_t)key * HEAD_DIM;
        float score = 0.f;
#if HEAD_DIM % 4 == 0
#pragma unroll
        for (int d = 0; d < HEAD_DIM; d += 4) {
            const float4 kv = __ldg(reinterpret_cast<const float4*>(k_row + d));
            score = fmaf(q_row[d], kv.x, score);
            score = fmaf(q_row[d + 1], kv.y, score);
            score = fmaf(q_row[d + 2], kv.z, score);
            score = fmaf(q_row[d + 3], kv.w, score);
        }
#else
#pragma unroll
        for (int d = 0; d < HEAD_DIM; ++d) score = fmaf(q_row[d], __ldg(k_row + d), score);
#endif
        if (!active || !mask.in_band(row, key)) continue;  // keys stop at key_end <= kv_len
        const float new_max = fmaxf(row_max, score);
        const float correction = exp2f(row_max - new_max);
        const float p = exp2f(score - new_max);
        row_sum = row_sum * correction + p;
        row_max = new_max;
#pragma unroll 8
        for (int d = 0; d < HEAD_DIM; ++d)
            o_s[d * THREADS + tid] = fmaf(o_s[d * THREADS + tid], correction, p * __ldg(v_row + d));
    }
    if (!active) return;
    const float inv = 1.f / row_sum;
    float* dst = out + head_offset + (size_t)row * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; ++d) dst[d] = o_s[d * THREADS + tid] * inv;
}
