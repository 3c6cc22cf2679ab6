// A plain, correct attention kernel with the tiled family's entry points and
// arguments, and the faults the GPU fault tests plant in it.
//
// tests/fault_backend.py compiles one of the small .cu files of this folder in
// place of kernels/tiled.cu for chosen plan keys; each defines at most one
// FAULT_* macro and includes this file. The plan's own constants (HEAD_DIM,
// ROWS_PER_BLOCK, THREADS, CAUSAL, ...) and launch (grid, block, shared bytes,
// arguments) are used unchanged, so the broken candidate is launched exactly
// as the real one would be. Only plans with one sequence split are broken this
// way (split_merge is never launched for them).
//
// One thread per query row, online softmax in the log2 domain as the real
// kernels: without a FAULT_* macro it passes the parity check (the control).
//
// The parameter list must be kernels/tiled.cu's, type for type: the backend
// packs the real kernel's arguments, and a kernel declaring fewer parameters
// than the bytes it is handed is refused at launch with "too many resources
// requested for launch" (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: too many
// arguments), whatever the fault. tests/test_reliability_faults.py compares
// the two signatures.

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif

extern "C" __global__ void __launch_bounds__(THREADS)
tiled_attention(const float* __restrict__ q, const float* __restrict__ k,
                const float* __restrict__ v, float* __restrict__ out,
                float* __restrict__ partial_o, float* __restrict__ partial_ml,
                int seq_len, int kv_len, int kv_group, int keys_per_split, float scale_log2,
                int heads, int window_left, int window_right, float softcap,
                const float* __restrict__ alibi_slopes, const float* __restrict__ sinks,
                float* __restrict__ lse) {
    // Each row's accumulator lives in the plan's dynamic shared memory, which
    // holds at least the real kernel's q tile of ROWS_PER_BLOCK x (HEAD_DIM + 4) floats.
    extern __shared__ float acc_s[];
#ifdef FAULT_HANG
    // Never returns: a volatile flag nobody sets (the compiler cannot drop the
    // loop); the sleep keeps the spinning cheap until the process is killed.
    volatile int* released = reinterpret_cast<volatile int*>(acc_s);
    if (threadIdx.x == 0) *released = 0;
    __syncthreads();
    while (!*released) __nanosleep(1000);
#endif
#ifdef FAULT_WRONG_SCALE
    // The classic bug: the softmax scale's 1/sqrt(HEAD_DIM) forgotten.
    scale_log2 = 1.4426950408889634f;
#endif
    const size_t head = (size_t)blockIdx.z * seq_len * HEAD_DIM;
    // Query head z reads KV head z / kv_group; causal masking is bottom-right aligned.
    const size_t kv_head = (size_t)(blockIdx.z / kv_group) * kv_len * HEAD_DIM;
    for (int i = threadIdx.x; i < ROWS_PER_BLOCK; i += THREADS) {
        const int row = blockIdx.x * ROWS_PER_BLOCK + i;
        if (row >= seq_len) break;
        const float* q_row = q + head + (size_t)row * HEAD_DIM;
        float* acc = acc_s + (size_t)i * (HEAD_DIM + 4);
        for (int d = 0; d < HEAD_DIM; ++d) acc[d] = 0.f;
        float row_max = -INFINITY;
        float row_sum = 0.f;
        const int key_end = CAUSAL ? min(kv_len, row + 1 + kv_len - seq_len) : kv_len;
        for (int key = 0; key < key_end; ++key) {
            const float* k_row = k + kv_head + (size_t)key * HEAD_DIM;
            const float* v_row = v + kv_head + (size_t)key * HEAD_DIM;
            float score = 0.f;
#pragma unroll 4
            for (int d = 0; d < HEAD_DIM; ++d) score = fmaf(q_row[d], k_row[d], score);
            score *= scale_log2;
            const float new_max = fmaxf(row_max, score);
            const float correction = exp2f(row_max - new_max);
            const float p = exp2f(score - new_max);
            row_sum = row_sum * correction + p;
            row_max = new_max;
#pragma unroll 4
            for (int d = 0; d < HEAD_DIM; ++d) acc[d] = fmaf(acc[d], correction, p * v_row[d]);
        }
        float* dst = out + head + (size_t)row * HEAD_DIM;
        for (int d = 0; d < HEAD_DIM; ++d) dst[d] = acc[d] / row_sum;
#ifdef FAULT_NAN
        // One element of the first head's middle row; every other element is right.
        if (blockIdx.z == 0 && row == seq_len / 2) dst[0] = __int_as_float(0x7fffffff);
#endif
    }
#ifdef FAULT_ILLEGAL_ADDRESS
    // An index computed wrong by 2**32 rows' worth: a store terabytes past `out`.
    if (blockIdx.x == 0 && threadIdx.x == 0) out[(size_t)seq_len << 32] = 1.f;
#endif
}

// The merge of split partials: never launched for a one-split plan; present
// because the backend loads every entry function of the family.
extern "C" __global__ void __launch_bounds__(128)
split_merge(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
            float* __restrict__ out, int seq_len, int splits, int total_rows, int heads,
            const float* __restrict__ sinks, float* __restrict__ lse) {}
