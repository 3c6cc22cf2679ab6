// FlashAttention forward on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a):
// bf16/fp16 in, fp32 accumulate, in the structure of FlashAttention-3.
//
// UNVERIFIED ON A GPU: compiled and read in SASS only (bench/results/
// wgmma_groundwork_2026-12-03/README.md); bench/wgmma_probe.py is its first test.
//
// One block = 1 producer warpgroup + CONSUMERS consumer warpgroups (128 threads each).
// Consumer c owns the 64 query rows row0 + 64c .. row0 + 64c + 63 (BLOCK_M = 64 * CONSUMERS)
// and keeps them in registers as fp32 accumulators; one thread of the producer issues
// every load with the tensor memory accelerator (cp.async.bulk.tensor.3d), the other 127
// idle. K and V tiles of BLOCK_N keys stream through a STAGES-deep ring in shared memory:
//   k_full[s], v_full[s]: the producer's arrive.expect_tx; the TMA completes the bytes;
//   kv_empty[s]: one arrive per consumer warp (4 * CONSUMERS) once its P V product has read
//   the slot; the producer waits on it before refilling the slot.
// setmaxnreg moves registers from the producer (24 a thread) to the consumers.
//
// Per tile, per consumer warpgroup:
//   S = Q K^T: HEAD_DIM / 16 wgmma m64n{BLOCK_N}k16, A = Q and B = K from shared memory
//   (both K-major: head_dim contiguous);
//   online softmax on the S accumulators in registers (exp2 with scale_log2 folded in);
//   P packed to 16-bit pairs in registers: the accumulator layout of a warp's 16 rows
//   is the register-A fragment layout of the next wgmma (as with mma.sync m16n8k16);
//   O += P V: BLOCK_N / 16 wgmma m64n{HEAD_DIM}k16, A = P from registers, B = V from shared
//   memory, MN-major (head_dim contiguous), i.e. imm-trans-b = 1.
// OVERLAP = 0 waits for each GEMM before the softmax that reads it; OVERLAP = 1 is
// FlashAttention-3's intra-warpgroup overlap (the softmax of S(t) runs while P V(t-1) is
// in the tensor cores; see the consumer loop). No ping-pong named barriers between the two
// consumers yet; with CONSUMERS = 2 the warp schedulers interleave one group's softmax
// with the other's wgmma on their own.
//
// Shared memory: every tile of R rows x HEAD_DIM is stored as HEAD_DIM / 64 column
// chunks of R rows x 128 bytes (64 elements), each chunk in the 128-byte swizzle
// (16-byte unit u of row r stored at unit u ^ (r % 8)), which is what the TMA writes
// with CU_TENSOR_MAP_SWIZZLE_128B and a box of {64, R, 1}, and what a wgmma
// descriptor with swizzle mode 1 reads. Chunks start 1024-byte aligned (the swizzle
// repeats every 8 rows x 128 bytes), so the descriptors' base offset is 0.
//   K-major operand (Q, K), k16 step j: start = tile + (j / 4) * R * 128 + (j % 4) * 32,
//     LBO unused by swizzled K-major layouts (1), SBO = 1024 (next 8 rows).
//   MN-major operand (V), k16 step j (keys 16j..16j+15): start = tile + j * 16 * 128,
//     LBO = R * 128 (next 64 head_dim columns: the next chunk), SBO = 1024 (next 8 keys).
//
// Entry contract: mma_f16_attention's (q, k, v, out, partial_o, partial_lse, seq_len,
// kv_len, group, keys_per_split, scale_log2; the same grid meaning and split outputs,
// GQA kv head = bh / group, bottom-right causal), preceded by three tensor maps built on
// the host with cuTensorMapEncodeTiled (bench/wgmma_probe.py):
//   q_map: bf16/fp16, dims {HEAD_DIM, seq_len, batch * heads}, strides {HEAD_DIM * 2,
//          seq_len * HEAD_DIM * 2} bytes, box {64, 64, 1}, SWIZZLE_128B, OOB fill zeros;
//   k_map, v_map: dims {HEAD_DIM, kv_len, batch * kv_heads}, box {64, BLOCK_N, 1}, same.
// Rows past seq_len / kv_len of a head come in as zeros (the third dimension keeps a
// tile from reading the next head); keys past kv_len are masked to -inf besides.
//   dynamic shared bytes = SMEM_BYTES below (1024 of slack for aligning the base)
//   registers: __launch_bounds__(THREADS, BLOCKS_PER_SM) caps them at entry (what lets
//   setmaxnreg act); the producer drops to PRODUCER_REGISTERS, consumers rise to
//   CONSUMER_REGISTERS, within 64K / BLOCKS_PER_SM for the block.
//   grid = (ceil(seq_len / BLOCK_M), splits, batch * heads), block = 128 * (CONSUMERS + 1)

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 128
#endif
#ifndef CONSUMERS
#define CONSUMERS 2
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif
#ifndef IS_FP16
#define IS_FP16 0
#endif
#ifndef BLOCKS_PER_SM
#define BLOCKS_PER_SM 1  // 2: two blocks share an SM (CONSUMERS = 1 with a small ring)
#endif
#ifndef OVERLAP
#define OVERLAP 0  // 1: FA3's intra-warpgroup overlap of softmax(t) with P V(t-1)
#endif
#ifndef DEBUG_S
#define DEBUG_S 0  // 1: also write tile 0's raw S = Q K^T (fp32) to partial_o (diagnosis)
#endif
#ifndef PRODUCER_REGISTERS
#define PRODUCER_REGISTERS 24
#endif
#ifndef CONSUMER_REGISTERS
#define CONSUMER_REGISTERS 240
#endif

#define BLOCK_M (64 * CONSUMERS)
#define THREADS (128 * (CONSUMERS + 1))
#define CHUNKS (HEAD_DIM / 64)                    // 64-column chunks of a tile row
#define Q_TILE_BYTES (64 * HEAD_DIM * 2)          // one consumer's Q
#define KV_TILE_BYTES (BLOCK_N * HEAD_DIM * 2)    // one K or one V tile
#define Q_OFFSET 0
#define K_OFFSET (CONSUMERS * Q_TILE_BYTES)
#define V_OFFSET (K_OFFSET + STAGES * KV_TILE_BYTES)
#define BARRIER_OFFSET (V_OFFSET + STAGES * KV_TILE_BYTES)
#define BARRIERS (1 + 3 * STAGES)                 // q_full, k_full[], v_full[], kv_empty[]
#define SMEM_BYTES (BARRIER_OFFSET + 8 * BARRIERS + 1024)
#define S_REGS (BLOCK_N / 2)                      // S accumulators a thread (m64nBLOCK_N f32)
#define O_REGS (HEAD_DIM / 2)                     // O accumulators a thread

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim 64 or 128 (whole 128-byte chunks)");
static_assert(BLOCK_N == 64 || BLOCK_N == 128, "key tile 64 or 128");
static_assert(CONSUMERS == 1 || CONSUMERS == 2, "one or two consumer warpgroups");
static_assert(STAGES >= 2 && STAGES <= 4, "a ring of 2 to 4 stages");
static_assert(SMEM_BYTES <= 232448, "227 KB of shared memory a block on sm_90");
static_assert(BLOCKS_PER_SM * SMEM_BYTES <= 233472, "228 KB of shared memory an SM");
static_assert(BLOCKS_PER_SM * (PRODUCER_REGISTERS + CONSUMER_REGISTERS * CONSUMERS) * 128 <= 65536,
              "the register file: 64K registers an SM, shared by its blocks");
static_assert(PRODUCER_REGISTERS % 8 == 0 && CONSUMER_REGISTERS % 8 == 0 &&
              PRODUCER_REGISTERS >= 24 && CONSUMER_REGISTERS <= 256, "setmaxnreg: 24..256, by 8");

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

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Returns once the phase of parity `parity` has completed (for a fresh barrier, parity 1
// counts as the completed phase before the first: the producer's first pass over the ring).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// A {64, rows, 1} box of the tensor map at (column, row, head) into shared memory,
// completing its bytes on `bar`.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int column,
                                            int row, int head, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(row), "r"(head), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Ties accumulator registers to this point of the program: the compiler may not move
// their reads above a wgmma_wait or their writes below a wgmma issue (CUTLASS's
// warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void fence_registers(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address,
// leading and stride byte offsets, all >> 4 in 14 bits; bits 62-63 the swizzle mode
// (1 = 128-byte).
__device__ __forceinline__ uint64_t make_descriptor(uint32_t addr, uint32_t leading_bytes,
                                                    uint32_t stride_bytes) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((leading_bytes & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)((stride_bytes & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
// K-major tile of `rows` rows (Q: 64, K: BLOCK_N), k16 step j of HEAD_DIM / 16.
__device__ __forceinline__ uint64_t k_major_descriptor(uint32_t tile, int rows, int j) {
    return make_descriptor(tile + (j / 4) * rows * 128 + (j % 4) * 32, 16, 1024);
}
// MN-major V tile (BLOCK_N keys x HEAD_DIM), k16 step j of BLOCK_N / 16: LBO = the next 64
// head_dim columns (the next chunk), SBO = the next 8 keys, as CUTLASS's and ThunderKittens'
// MN-major 128-byte-swizzle descriptors have it. Confirmed on the H200 (2026-12-03): the
// other reading (the PTX ISA's one-line LBO/SBO definitions taken literally) faulted with an
// illegal address; this one passed parity everywhere (bench/results/wgmma_first_run_2026-12-03).
__device__ __forceinline__ uint64_t mn_major_descriptor(uint32_t tile, int j) {
    return make_descriptor(tile + j * 16 * 128, BLOCK_N * 128, 1024);
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

// ---------------------------------------------------------------- wgmma wrappers
// (operand lists written out by a generator: one "+f" per accumulator register)

template <int N> __device__ __forceinline__ void wgmma_ss(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d);
template <int N> __device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t desc_b, int scale_d);

// D[64 x 64] (+)= A[64 x 16] (shared, K-major) * B[16 x 64] (shared, K-major)
template <>
__device__ __forceinline__ void wgmma_ss<64>(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_TYPE "." MMA_TYPE " "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x 128] (+)= A[64 x 16] (shared, K-major) * B[16 x 128] (shared, K-major)
template <>
__device__ __forceinline__ void wgmma_ss<128>(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_TYPE "." MMA_TYPE " "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x 64] += A[64 x 16] (registers) * B[16 x 64] (shared, MN-major: imm-trans-b = 1)
template <>
__device__ __forceinline__ void wgmma_rs<64>(float* d, const uint32_t* a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_TYPE "." MMA_TYPE " "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// D[64 x 128] += A[64 x 16] (registers) * B[16 x 128] (shared, MN-major: imm-trans-b = 1)
template <>
__device__ __forceinline__ void wgmma_rs<128>(float* d, const uint32_t* a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_TYPE "." MMA_TYPE " "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "{%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// ---------------------------------------------------------------- consumer steps
// (a consumer thread's accumulator layout, m64nNk16: register i of n8 chunk i / 4 is
// column 8 (i / 4) + 2 (lane % 4) + i % 2 of row my_row + 8 ((i / 2) % 2))

// S = Q K^T for one tile: HEAD_DIM / 16 wgmmas, both operands K-major in shared memory.
__device__ __forceinline__ void issue_s(float* s_acc, uint32_t q_tile, uint32_t k_tile) {
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 16; ++j)
        wgmma_ss<BLOCK_N>(s_acc, k_major_descriptor(q_tile, 64, j),
                          k_major_descriptor(k_tile, BLOCK_N, j), j > 0);
}

// O += P V for one tile: BLOCK_N / 16 wgmmas, P from registers, V MN-major in shared memory.
__device__ __forceinline__ void issue_pv(float* o_acc, const uint32_t (*p_frag)[4],
                                         uint32_t v_tile) {
#pragma unroll
    for (int j = 0; j < BLOCK_N / 16; ++j)
        wgmma_rs<HEAD_DIM>(o_acc, p_frag[j], mn_major_descriptor(v_tile, j), 1);
}

// Keys past kv_len (last tile) and, under causal masking, past the diagonal -> -inf.
__device__ __forceinline__ void mask_scores(float* s_acc, int key0, int kv_len, int my_row,
                                            int wg_row0, int causal_offset, int lane) {
    const bool tail = key0 + BLOCK_N > kv_len;
    const bool diagonal = CAUSAL && (key0 + BLOCK_N - 1 > wg_row0 + causal_offset);
    if (tail || diagonal) {
#pragma unroll
        for (int i = 0; i < S_REGS; ++i) {
            const int key = key0 + 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
            const int row = my_row + 8 * ((i / 2) % 2);
            bool masked = key >= kv_len;
            if (CAUSAL) masked = masked || key > row + causal_offset;
            if (masked) s_acc[i] = -INFINITY;
        }
    }
}

// Online softmax of one tile (fp32, log2 domain; the four lanes of a quad share a row):
// P replaces S in place, the running max and this thread's share of the sum are updated,
// and correction[half] is the factor O's rows must be scaled by before P V is added.
__device__ __forceinline__ void softmax_tile(float* s_acc, float* row_max, float* row_sum,
                                             float* correction, float scale_log2) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int c = 0; c < BLOCK_N / 8; ++c)
            tile_max = fmaxf(tile_max, fmaxf(s_acc[4 * c + 2 * half], s_acc[4 * c + 2 * half + 1]));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 2));
        const float new_max = fmaxf(row_max[half], tile_max * scale_log2);
        // A row with no visible key yet keeps max -inf: subtract 0, not -inf.
        const float shift = new_max == -INFINITY ? 0.f : new_max;
        correction[half] = fast_exp2(row_max[half] - shift);
        row_max[half] = new_max;
        float sum = 0.f;
#pragma unroll
        for (int c = 0; c < BLOCK_N / 8; ++c) {
            const float p0 = fast_exp2(s_acc[4 * c + 2 * half] * scale_log2 - shift);
            const float p1 = fast_exp2(s_acc[4 * c + 2 * half + 1] * scale_log2 - shift);
            s_acc[4 * c + 2 * half] = p0;
            s_acc[4 * c + 2 * half + 1] = p1;
            sum += p0 + p1;
        }
        row_sum[half] = row_sum[half] * correction[half] + sum;
    }
}

__device__ __forceinline__ void rescale_o(float* o_acc, const float* correction) {
#pragma unroll
    for (int c = 0; c < HEAD_DIM / 8; ++c) {
        o_acc[4 * c + 0] *= correction[0];
        o_acc[4 * c + 1] *= correction[0];
        o_acc[4 * c + 2] *= correction[1];
        o_acc[4 * c + 3] *= correction[1];
    }
}

// P to 16-bit A fragments: k16 step j covers n8 chunks 2j and 2j + 1 (the register-A layout
// of m64nNk16 for a warp's 16 rows is mma.sync m16n8k16's A fragment).
__device__ __forceinline__ void pack_p(const float* s_acc, uint32_t (*p_frag)[4]) {
#pragma unroll
    for (int j = 0; j < BLOCK_N / 16; ++j) {
        p_frag[j][0] = pack_pair(s_acc[8 * j + 0], s_acc[8 * j + 1]);  // row g, k 0-7
        p_frag[j][1] = pack_pair(s_acc[8 * j + 2], s_acc[8 * j + 3]);  // row g+8, k 0-7
        p_frag[j][2] = pack_pair(s_acc[8 * j + 4], s_acc[8 * j + 5]);  // row g, k 8-15
        p_frag[j][3] = pack_pair(s_acc[8 * j + 6], s_acc[8 * j + 7]);  // row g+8, k 8-15
    }
}

#if DEBUG_S
// Diagnosis of the K-major descriptors alone: partial_o[bh][row][0, BLOCK_N) = the first
// tile's unscaled, unmasked scores (bench/wgmma_probe.py run --diagnose).
__device__ __forceinline__ void debug_store_s(const float* s_acc, float* partial_o, int bh,
                                              int seq_len, int my_row, int lane) {
#pragma unroll
    for (int i = 0; i < S_REGS; ++i) {
        const int row = my_row + 8 * ((i / 2) % 2);
        const int col = 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
        if (row < seq_len) partial_o[((size_t)bh * seq_len + row) * BLOCK_N + col] = s_acc[i];
    }
}
#endif

// ---------------------------------------------------------------- attention

extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM)
wgmma_f16_attention(const __grid_constant__ CUtensorMap q_map,
                    const __grid_constant__ CUtensorMap k_map,
                    const __grid_constant__ CUtensorMap v_map, const elem_t* __restrict__ q,
                    const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                    elem_t* __restrict__ out, float* __restrict__ partial_o,
                    float* __restrict__ partial_lse, int seq_len, int kv_len, int group,
                    int keys_per_split, float scale_log2) {
    extern __shared__ __align__(1024) unsigned char shared_raw[];
    // The swizzle is a function of address bits 4-9: tiles must start 1024-byte aligned.
    const uint32_t base = (smem_addr(shared_raw) + 1023) & ~1023u;
    const uint32_t s_q = base + Q_OFFSET;
    const uint32_t s_k = base + K_OFFSET;
    const uint32_t s_v = base + V_OFFSET;
    const uint32_t q_full = base + BARRIER_OFFSET;
    const uint32_t k_full = q_full + 8;                // + 8 * stage
    const uint32_t v_full = k_full + 8 * STAGES;
    const uint32_t kv_empty = v_full + 8 * STAGES;

    const int tid = threadIdx.x;
    const int warpgroup = tid / 128;  // 0: producer, 1..CONSUMERS: consumers
    const int warp = (tid % 128) / 32;
    const int lane = tid % 32;

    // Under causal masking the row blocks near the end carry the most keys: hand them
    // out first (as mma_f16 does).
    int m_block = blockIdx.x;
    int bh = blockIdx.z;
    if (CAUSAL) {
        const int linear = blockIdx.z * gridDim.x + blockIdx.x;
        m_block = gridDim.x - 1 - linear / gridDim.z;
        bh = linear % gridDim.z;
    }
    const int split = blockIdx.y;
    const int splits = gridDim.y;
    const int row0 = m_block * BLOCK_M;
    const int kv_head = bh / group;
    const int causal_offset = kv_len - seq_len;
    const int key_begin = split * keys_per_split;
    int key_end = min(kv_len, key_begin + keys_per_split);
    if (CAUSAL) key_end = min(key_end, row0 + BLOCK_M + causal_offset);
    // Producer and consumers agree on this count: every tile loaded is consumed and released.
    const int n_tiles = key_end > key_begin ? (key_end - key_begin + BLOCK_N - 1) / BLOCK_N : 0;

    if (tid == 0) {
        mbar_init(q_full, 1);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(k_full + 8 * s, 1);
            mbar_init(v_full + 8 * s, 1);
            mbar_init(kv_empty + 8 * s, 4 * CONSUMERS);
        }
        // Make the initialised barriers visible to the TMA (the async proxy).
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {
        // ---------------------------------------------------------------- producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGISTERS));
        if (warp == 0 && lane == 0) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&q_map))
                         : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&k_map))
                         : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&v_map))
                         : "memory");
            mbar_arrive_expect_tx(q_full, CONSUMERS * Q_TILE_BYTES);
#pragma unroll
            for (int c = 0; c < CONSUMERS; ++c)
#pragma unroll
                for (int chunk = 0; chunk < CHUNKS; ++chunk)
                    tma_load_3d(s_q + c * Q_TILE_BYTES + chunk * 64 * 128, &q_map, chunk * 64,
                                row0 + 64 * c, bh, q_full);
            for (int t = 0; t < n_tiles; ++t) {
                const int stage = t % STAGES;
                const uint32_t parity = (t / STAGES) & 1;
                mbar_wait(kv_empty + 8 * stage, parity ^ 1);
                const int key0 = key_begin + t * BLOCK_N;
                mbar_arrive_expect_tx(k_full + 8 * stage, KV_TILE_BYTES);
#pragma unroll
                for (int chunk = 0; chunk < CHUNKS; ++chunk)
                    tma_load_3d(s_k + stage * KV_TILE_BYTES + chunk * BLOCK_N * 128, &k_map,
                                chunk * 64, key0, kv_head, k_full + 8 * stage);
                mbar_arrive_expect_tx(v_full + 8 * stage, KV_TILE_BYTES);
#pragma unroll
                for (int chunk = 0; chunk < CHUNKS; ++chunk)
                    tma_load_3d(s_v + stage * KV_TILE_BYTES + chunk * BLOCK_N * 128, &v_map,
                                chunk * 64, key0, kv_head, v_full + 8 * stage);
            }
        }
    } else {
        // ---------------------------------------------------------------- consumers
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGISTERS));
        const int consumer = warpgroup - 1;
        const uint32_t q_tile = s_q + consumer * Q_TILE_BYTES;
        // This thread's rows (accumulator layout of m64nNk16: warp w owns rows 16w..16w+15,
        // a lane rows lane/4 and lane/4 + 8; register i of n8 chunk i/4 is column
        // 8 (i/4) + 2 (lane%4) + i%2 of row lane/4 + 8 ((i/2)%2)).
        const int wg_row0 = row0 + 64 * consumer;
        const int my_row = wg_row0 + 16 * warp + lane / 4;  // and my_row + 8

        float o_acc[O_REGS];
#pragma unroll
        for (int i = 0; i < O_REGS; ++i) o_acc[i] = 0.f;
        float row_max[2] = {-INFINITY, -INFINITY};  // scaled (log2 domain) running max
        float row_sum[2] = {0.f, 0.f};              // this thread's share of the running sum

        mbar_wait(q_full, 0);
#if !OVERLAP
        uint32_t p_frag[BLOCK_N / 16][4];
        for (int t = 0; t < n_tiles; ++t) {
            const int stage = t % STAGES;
            const uint32_t parity = (t / STAGES) & 1;
            const int key0 = key_begin + t * BLOCK_N;

            // ---- S = Q K^T
            float s_acc[S_REGS];
            mbar_wait(k_full + 8 * stage, parity);
            wgmma_fence();
            issue_s(s_acc, q_tile, s_k + stage * KV_TILE_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers<S_REGS>(s_acc);
#if DEBUG_S
            if (t == 0) debug_store_s(s_acc, partial_o, bh, seq_len, my_row, lane);
#endif
            mask_scores(s_acc, key0, kv_len, my_row, wg_row0, causal_offset, lane);
            float correction[2];
            softmax_tile(s_acc, row_max, row_sum, correction, scale_log2);
            rescale_o(o_acc, correction);
            pack_p(s_acc, p_frag);

            // ---- O += P V
            mbar_wait(v_full + 8 * stage, parity);
            fence_registers<O_REGS>(o_acc);
            wgmma_fence();
            issue_pv(o_acc, p_frag, s_v + stage * KV_TILE_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers<O_REGS>(o_acc);
            // This warp has read the slot (K by the S product, V by this one).
            __syncwarp();
            if (lane == 0) mbar_arrive(kv_empty + 8 * stage);
        }
#else
        // FlashAttention-3's intra-warpgroup overlap: S(t) is issued, then P(t-1) V(t-1);
        // the softmax of S(t) runs while P V(t-1) is still in the tensor cores, and O is
        // rescaled only after that product has landed. Groups complete in commit order, so
        // wait_group 1 after the two commits means S(t) is done, P V(t-1) maybe not.
        // P alternates between two register sets (the loop is unrolled by two): packing P(t)
        // into the registers P V(t-1) is still reading would make ptxas wait for that product
        // before the softmax (seen in SASS as wait_group 0 hoisted above the exp2s).
        uint32_t p_a[BLOCK_N / 16][4], p_b[BLOCK_N / 16][4];
        auto overlapped_tile = [&](int t, const uint32_t(*p_previous)[4], uint32_t(*p_next)[4]) {
            const int stage = t % STAGES;
            const uint32_t parity = (t / STAGES) & 1;
            const int previous = (t - 1) % STAGES;
            const uint32_t previous_parity = ((t - 1) / STAGES) & 1;
            float s_acc[S_REGS];
            mbar_wait(k_full + 8 * stage, parity);
            mbar_wait(v_full + 8 * previous, previous_parity);
            fence_registers<O_REGS>(o_acc);
            wgmma_fence();
            issue_s(s_acc, q_tile, s_k + stage * KV_TILE_BYTES);
            wgmma_commit();
            issue_pv(o_acc, p_previous, s_v + previous * KV_TILE_BYTES);
            wgmma_commit();
            wgmma_wait<1>();  // S(t) has landed
            fence_registers<S_REGS>(s_acc);
            mask_scores(s_acc, key_begin + t * BLOCK_N, kv_len, my_row, wg_row0, causal_offset,
                        lane);
            float correction[2];
            softmax_tile(s_acc, row_max, row_sum, correction, scale_log2);
            pack_p(s_acc, p_next);
            // P(t-1) V(t-1) has landed after this wait: its slot is free. ptxas schedules a
            // wait with no operands as early as its basic block allows, i.e. above the
            // softmax, which would undo the overlap (seen in SASS); behind a branch on the
            // row sums (which need every exp2 of the tile) it stays below the softmax. The
            // branch is always taken unless a sum is NaN, and then waits all the same.
            if (row_sum[0] + row_sum[1] >= 0.f) {
                wgmma_wait<0>();
            } else {
                wgmma_wait<0>();
                row_sum[0] = NAN;  // keeps the two branches distinct (not merged)
            }
            fence_registers<O_REGS>(o_acc);
            __syncwarp();
            if (lane == 0) mbar_arrive(kv_empty + 8 * previous);
            rescale_o(o_acc, correction);
        };
        auto last_product = [&](const uint32_t(*p_last)[4]) {
            const int last = (n_tiles - 1) % STAGES;
            mbar_wait(v_full + 8 * last, ((n_tiles - 1) / STAGES) & 1);
            fence_registers<O_REGS>(o_acc);
            wgmma_fence();
            issue_pv(o_acc, p_last, s_v + last * KV_TILE_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers<O_REGS>(o_acc);
            __syncwarp();
            if (lane == 0) mbar_arrive(kv_empty + 8 * last);
        };
        if (n_tiles > 0) {
            float s_acc[S_REGS];
            mbar_wait(k_full, 0);
            wgmma_fence();
            issue_s(s_acc, q_tile, s_k);
            wgmma_commit();
            wgmma_wait<0>();
            fence_registers<S_REGS>(s_acc);
#if DEBUG_S
            debug_store_s(s_acc, partial_o, bh, seq_len, my_row, lane);
#endif
            mask_scores(s_acc, key_begin, kv_len, my_row, wg_row0, causal_offset, lane);
            float correction[2];
            softmax_tile(s_acc, row_max, row_sum, correction, scale_log2);  // O is still 0
            pack_p(s_acc, p_a);
        }
        int t = 1;
        for (; t + 1 < n_tiles; t += 2) {
            overlapped_tile(t, p_a, p_b);
            overlapped_tile(t + 1, p_b, p_a);
        }
        if (t < n_tiles) {
            overlapped_tile(t, p_a, p_b);
            last_product(p_b);
        } else if (n_tiles > 0) {
            last_product(p_a);
        }
#endif

        // ---- epilogue: finish the row sums across the four lanes of a row
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float s = row_sum[half];
            s += __shfl_xor_sync(0xffffffff, s, 1);
            s += __shfl_xor_sync(0xffffffff, s, 2);
            row_sum[half] = s;
        }
        if (splits == 1) {
            elem_t* out_bh = out + (size_t)bh * seq_len * HEAD_DIM;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = my_row + 8 * half;
                if (row >= seq_len) continue;
                const float inv = row_sum[half] > 0.f ? 1.f / row_sum[half] : 0.f;
                elem_t* dst = out_bh + (size_t)row * HEAD_DIM + 2 * (lane % 4);
#pragma unroll
                for (int c = 0; c < HEAD_DIM / 8; ++c)
                    *reinterpret_cast<uint32_t*>(dst + 8 * c) =
                        pack_pair(o_acc[4 * c + 2 * half] * inv, o_acc[4 * c + 2 * half + 1] * inv);
            }
        } else {
            // float32 partial output (normalised by this split's sum) and the split's
            // log2-sum-exp (-inf where the split saw no key of the row).
            const size_t part_row0 = ((size_t)bh * splits + split) * seq_len;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = my_row + 8 * half;
                if (row >= seq_len) continue;
                const float l = row_sum[half];
                const float inv = l > 0.f ? 1.f / l : 0.f;
                float* dst = partial_o + (part_row0 + row) * HEAD_DIM + 2 * (lane % 4);
#pragma unroll
                for (int c = 0; c < HEAD_DIM / 8; ++c)
                    *reinterpret_cast<float2*>(dst + 8 * c) =
                        make_float2(o_acc[4 * c + 2 * half] * inv, o_acc[4 * c + 2 * half + 1] * inv);
                if (lane % 4 == 0)
                    partial_lse[part_row0 + row] = l > 0.f ? row_max[half] + __log2f(l) : -INFINITY;
            }
        }
    }
}

// ---------------------------------------------------------------- split merge

// mma_f16_split_merge's contract: out[row] = sum_s 2^(lse_s - lse) * partial_o[s][row],
// lse = log2 sum_s 2^lse_s; one thread per 4 output elements; 128 threads per block.
extern "C" __global__ void __launch_bounds__(128)
wgmma_f16_split_merge(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
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
