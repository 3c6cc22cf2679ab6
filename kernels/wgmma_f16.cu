// FlashAttention forward on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a):
// bf16/fp16 in, fp32 accumulate, in the structure of FlashAttention-3.
//
// One block = 1 producer warpgroup + CONSUMERS (1 to 3) consumer warpgroups (128 threads each;
// three are FlashAttention-3's 192-row blocks of head_dim 64, at 160 registers a consumer).
// Consumer c owns the 64 query rows row0 + 64c .. row0 + 64c + 63 (BLOCK_M = 64 * CONSUMERS)
// and keeps them in registers as fp32 accumulators; one thread of the producer issues
// every load with the tensor memory accelerator (cp.async.bulk.tensor.3d), the other 127
// idle. K and V tiles of BLOCK_N keys stream through a STAGES-deep ring in shared memory:
//   k_full[s], v_full[s]: the producer's arrive.expect_tx; the TMA completes the bytes;
//   k_empty[s], v_empty[s]: one arrive per consumer warp (4 * CONSUMERS) once its S product
//   has read the K tile, and once its P V product has read the V tile; the producer waits on
//   each before refilling that half of the slot. K is released as soon as S lands (as in
//   FlashAttention-3's separate K and V pipelines): with OVERLAP, P V(t) runs a tile later
//   than S(t), and one release for both would hold K(t)'s slot a whole tile longer, which
//   starves a 2-stage ring (head_dim 192/256, where only 2 stages fit).
// setmaxnreg moves registers from the producer (24 a thread) to the consumers.
// PERSISTENT = 1: a grid of one block per SM slot, each walking a static queue of row blocks
// (WorkQueue below); the ring and its barriers' phases run on across work items, and
// q_empty (one arrive per consumer warp once it is done with its Q tile) lets the producer
// load the next item's Q; its first K tile goes into the ring before that, while the
// consumers still finish the last item.
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
// in the tensor cores; see the consumer loop). PINGPONG = 1 (with OVERLAP and two or three
// consumers) is FlashAttention-3's inter-warpgroup ping-pong: the consumers take turns issuing
// their GEMMs (named barriers 1 .. CONSUMERS, round robin), so one group's softmax runs under
// the others' GEMMs;
// without it the warp schedulers interleave the two groups on their own.
//
// Shared memory: every tile of R rows x HEAD_DIM is stored as HEAD_DIM / C column chunks
// of R rows x 2C bytes (C = CHUNK_COLS: 64 columns in the 128-byte swizzle where head_dim is
// a multiple of 64, else 32 columns in the 64-byte swizzle, head_dim 96), the 16-byte units
// of each row permuted by the swizzle (128 bytes: unit u of row r at u ^ (r % 8)); that is
// what the TMA writes with CU_TENSOR_MAP_SWIZZLE_{128,64}B and a box of {C, R, 1}, and what
// a wgmma descriptor of swizzle mode 1 (128) or 2 (64) reads. Chunks start 1024-byte
// aligned (the swizzle repeats every 8 rows x 2C bytes), so the descriptors' base offset is
// 0 (include/fa/hopper.cuh, swizzled_k_major and swizzled_mn_major):
//   K-major operand (Q, K), k16 step j: start = tile + (j / (2C / 32)) * R * 2C
//     + (j % (2C / 32)) * 32, LBO unused by swizzled K-major layouts, SBO = 8 rows;
//   MN-major operand (V), k16 step j (keys 16j..16j+15): start = tile + j * 16 * 2C,
//     LBO = R * 2C (the next chunk of head_dim columns), SBO = 8 keys.
//
// Entry contract: mma_f16_attention's (q, k, v, out, partial_o, partial_lse, seq_len,
// kv_len, group, keys_per_split, scale_log2 and the variant arguments of
// include/fa/variant.cuh; the split-KV contract of include/fa/split_kv.cuh, its masks and
// score modifications) and batch_heads (batch * heads: the persistent queue's length is
// row blocks x batch_heads), preceded by three tensor maps (four with STAGED_STORE = 2) built
// on the host with cuTensorMapEncodeTiled (tuner/planner/families/wgmma_f16.py,
// kernels/tensor_maps.py):
//   q_map: bf16/fp16, dims {HEAD_DIM, seq_len, batch * heads}, strides {HEAD_DIM * 2,
//          seq_len * HEAD_DIM * 2} bytes, box {C, 64, 1}, SWIZZLE_128B (C = 64) or
//          SWIZZLE_64B (C = 32), OOB fill zeros;
//   k_map, v_map: dims {HEAD_DIM, kv_len, batch * kv_heads}, box {C, BLOCK_N, 1}, same;
//   o_map (STAGED_STORE = 2 only, after v_map): the q_map's twin over `out`.
// Rows past seq_len / kv_len of a head come in as zeros (the third dimension keeps a
// tile from reading the next head); keys past kv_len are masked to -inf besides.
//   dynamic shared bytes = SMEM_BYTES below (1024 of slack for aligning the base)
//   registers: __launch_bounds__(THREADS, BLOCKS_PER_SM) caps them at entry (what lets
//   setmaxnreg act); the producer drops to PRODUCER_REGISTERS, consumers rise to
//   CONSUMER_REGISTERS, within 64K / BLOCKS_PER_SM for the block.
//   grid = (ceil(seq_len / BLOCK_M), splits, batch * heads), or PERSISTENT (one split only)
//   (SMs x BLOCKS_PER_SM, 1, 1), at most one block per work item; block = 128 * (CONSUMERS + 1)

#include "fa/forward.cuh"
#include "fa/variant_switches.cuh"
#include "fa/hopper.cuh"
#include "fa/wgmma_ops.cuh"

// Defaults: the planner's default plan (tuner/planner/families/wgmma_f16.py).
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
#ifndef IS_FP16
#define IS_FP16 0
#endif
#ifndef BLOCKS_PER_SM
#define BLOCKS_PER_SM 1  // 2: two blocks share an SM (CONSUMERS = 1 with a small ring)
#endif
#ifndef OVERLAP
#define OVERLAP 0  // 1: FA3's intra-warpgroup overlap of softmax(t) with P V(t-1)
#endif
#ifndef PINGPONG
#define PINGPONG 0  // 1: FA3's inter-warpgroup ping-pong (two consumers, with OVERLAP)
#endif
#ifndef STAGED_STORE
#define STAGED_STORE 0  // O through shared memory: 1 in whole 16-byte rows, 2 by TMA stores
#endif
#ifndef PERSISTENT
#define PERSISTENT 0  // 1: a block per SM slot walks a queue of row blocks (see WorkQueue)
#endif
#ifndef LATE_PACK
#define LATE_PACK 0  // 1 (with OVERLAP): P(t) packed once P V(t-1) has landed, one P register set
#endif
// FA_RESCALE_SLACK (include/fa/softmax.cuh; > 0 with OVERLAP): the overlapped loop skips the
// output's rescale wherever no row of a warp moved its max (a warp vote)
#ifndef PRODUCER_REGISTERS
#define PRODUCER_REGISTERS 24
#endif
#ifndef CONSUMER_REGISTERS
#define CONSUMER_REGISTERS 240
#endif

#define BLOCK_M (64 * CONSUMERS)
#define THREADS (128 * (CONSUMERS + 1))
// The swizzle span: 128 bytes (64 columns) where head_dim is whole 64-column chunks, else
// 64 bytes (32 columns: head_dim 96), as CUTLASS's smem selector and FlashAttention-3 have it.
#define SWIZZLE_BYTES (HEAD_DIM % 64 == 0 ? 128 : 64)
#define CHUNK_COLS (SWIZZLE_BYTES / 2)            // columns of a chunk (one swizzled row)
#define CHUNKS (HEAD_DIM / CHUNK_COLS)            // chunks of a tile row
#define Q_TILE_BYTES (64 * HEAD_DIM * 2)          // one consumer's Q
#define KV_TILE_BYTES (BLOCK_N * HEAD_DIM * 2)    // one K or one V tile
#define Q_OFFSET 0
#define K_OFFSET (CONSUMERS * Q_TILE_BYTES)
#define V_OFFSET (K_OFFSET + STAGES * KV_TILE_BYTES)
#define BARRIER_OFFSET (V_OFFSET + STAGES * KV_TILE_BYTES)
#define BARRIERS (2 + 4 * STAGES)  // q_full, q_empty, k_full[], v_full[], k_empty[], v_empty[]
#define SMEM_BYTES (BARRIER_OFFSET + 8 * BARRIERS + 1024)
#define S_REGS (BLOCK_N / 2)                      // S accumulators a thread (m64nBLOCK_N f32)
#define O_REGS (HEAD_DIM / 2)                     // O accumulators a thread

static_assert(HEAD_DIM % CHUNK_COLS == 0 && HEAD_DIM <= 256,
              "head_dim of whole swizzled chunks (64 or 32 columns), up to 256");
static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 64 && BLOCK_N <= 192,
              "key tiles of whole k16 steps (P V), 64 to 192 keys");
static_assert(CONSUMERS >= 1 && CONSUMERS <= 3, "one to three consumer warpgroups");
static_assert(!PINGPONG || (CONSUMERS >= 2 && OVERLAP), "the ping-pong: 2 or 3 consumers, overlapped");
static_assert(!LATE_PACK || OVERLAP, "late packing: a choice of the overlapped loop");
static_assert(!FA_RESCALE_SLACK || OVERLAP, "the rescale slack: a choice of the overlapped loop");
static_assert(STAGES >= 2 && STAGES <= 4, "a ring of 2 to 4 stages");
static_assert(PERSISTENT == 0 || PERSISTENT == 1, "persistent: 0 or 1");
static_assert(STAGED_STORE >= 0 && STAGED_STORE <= 2, "staged store: 0, 1 or 2 (TMA)");
static_assert(SMEM_BYTES <= 232448, "227 KB of shared memory a block on sm_90");
static_assert(BLOCKS_PER_SM * SMEM_BYTES <= 233472, "228 KB of shared memory an SM");
static_assert(BLOCKS_PER_SM * (PRODUCER_REGISTERS + CONSUMER_REGISTERS * CONSUMERS) * 128 <= 65536,
              "the register file: 64K registers an SM, shared by its blocks");
static_assert(PRODUCER_REGISTERS % 8 == 0 && CONSUMER_REGISTERS % 8 == 0 &&
              PRODUCER_REGISTERS >= 24 && CONSUMER_REGISTERS <= 256, "setmaxnreg: 24..256, by 8");

struct Traits : fa::SwitchedVariant {
    using Elem = fa::HalfType<IS_FP16>::type;
    using SGemm = fa::Wgmma<BLOCK_N, Elem>;   // S = Q K^T, m64nBLOCK_N
    using OGemm = fa::Wgmma<HEAD_DIM, Elem>;  // O += P V, m64nHEAD_DIM
};
typedef Traits::Elem elem_t;

// ---------------------------------------------------------------- consumer steps
// (a consumer thread's accumulators are the m16n8 fragment rows of include/fa/fragment.cuh
// for its warp's 16 rows: S_REGS / 4 chunks of S, O_REGS / 4 chunks of O)

// S = Q K^T for one tile: HEAD_DIM / 16 wgmmas, both operands K-major in shared memory.
__device__ __forceinline__ void issue_s(float* s_acc, uint32_t q_tile, uint32_t k_tile) {
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 16; ++j)
        Traits::SGemm::ss(s_acc, fa::swizzled_k_major<SWIZZLE_BYTES>(q_tile, 64, j),
                          fa::swizzled_k_major<SWIZZLE_BYTES>(k_tile, BLOCK_N, j), j > 0);
}

// O += P V for one tile: BLOCK_N / 16 wgmmas, P from registers, V MN-major in shared memory.
__device__ __forceinline__ void issue_pv(float* o_acc, const uint32_t (*p_frag)[4],
                                         uint32_t v_tile) {
#pragma unroll
    for (int j = 0; j < BLOCK_N / 16; ++j)
        Traits::OGemm::rs(o_acc, p_frag[j], fa::swizzled_mn_major<SWIZZLE_BYTES>(v_tile, BLOCK_N, j),
                           1);
}

// P to 16-bit A fragments: k16 step j covers n8 chunks 2j and 2j + 1 (the register-A layout
// of m64nNk16 for a warp's 16 rows is mma.sync m16n8k16's A fragment).
__device__ __forceinline__ void pack_p(const float* s_acc, uint32_t (*p_frag)[4]) {
#pragma unroll
    for (int j = 0; j < BLOCK_N / 16; ++j) fa::pack_a_fragment<elem_t>(s_acc + 8 * j, p_frag[j]);
}

// The score modifications, the mask and the online softmax of one S tile: P replaces S in
// place and `correction` is what O's rows must be scaled by before P V is added.
struct TileSoftmax {
    Traits::MaskType mask;
    Traits::ScoreModType score_mod;
    fa::FragmentRows rows;  // this thread's two rows
    int wg_row0;      // the warpgroup's first row
    int lane;
    fa::SoftmaxRows state;

    __device__ __forceinline__ void operator()(float* s_acc, int key0, float (&correction)[2]) {
        score_mod.apply<S_REGS / 4>(s_acc, key0, rows, lane);
        if (mask.partial(key0, BLOCK_N, wg_row0, wg_row0 + 63))
            mask.apply<S_REGS / 4>(s_acc, key0, rows, lane);
        state.update<S_REGS / 4>(s_acc, score_mod.softmax_scale(), correction);
    }
};

// The ping-pong's turns (PINGPONG): the consumers issue their GEMMs in turn, round robin
// (FlashAttention-3's scheduler barrier). Consumer c issues between a sync on named barrier
// 1 + c and an arrive on the next consumer's, 1 + (c + 1) % CONSUMERS (256 threads each: the
// owner's sync and the previous consumer's arrive). Consumer 0 arrives on its own barrier
// once to take the first turn; the last consumer skips its last arrive (no turn of consumer 0
// follows), so every phase that starts completes and no barrier is left half-arrived at exit.
// Every consumer of a block walks the same key tiles, so each takes as many turns. PERSISTENT
// repeats the turns per work item: consumer 0's first turn of the next item needs that item's
// Q, which the producer loads only after the last consumer's q_empty arrive, i.e. after its
// last turn of this item, so two items' phases never mix on a barrier.
struct GemmTurns {
    int consumer;
    __device__ __forceinline__ void start(int tiles) const {
        if (PINGPONG && consumer == 0 && tiles > 0) fa::named_barrier_arrive(1, 256);
    }
    __device__ __forceinline__ void take() const {
        if (PINGPONG) fa::named_barrier_sync(1 + consumer, 256);
    }
    __device__ __forceinline__ void pass(bool last = false) const {
        if (PINGPONG && !(last && consumer == CONSUMERS - 1))
            fa::named_barrier_arrive(1 + (consumer + 1) % CONSUMERS, 256);
    }
};
// named barriers 1 .. CONSUMERS take the turns; the staged store's come after them
#define STAGED_STORE_BARRIER (1 + CONSUMERS)

// The output of a consumer (64 rows x HEAD_DIM, scaled by each row's 1 / sum) through its
// own Q tile, dead once the last S product has landed (STAGED_STORE): each thread writes its
// fragment pairs into the tile in the swizzle (conflict-free: the 8 rows of a warp's store
// land in 8 different 16-byte units), the warpgroup meets at its own named barrier,
// then each thread moves whole 16-byte units of a row to global memory: full 32-byte sectors,
// where the fragment's own stores write 16 bytes of a row per quad of lanes (half of each
// sector: Nsight Compute on the H200, 2026-12-04).
// STAGED_STORE = 2: the TMA writes the tile (o_map, the Q map's twin over the output; rows
// past seq_len are not written), issued by the warpgroup's first thread once every thread's
// writes are fenced to the async proxy and the warpgroup has met; that thread waits until the
// TMA has read the tile before its warp releases it (release_q) or the block exits. The
// consumer's threads no longer load the tile back and store it themselves.
__device__ __forceinline__ void staged_store(elem_t* out_bh, uint32_t tile, const float* o_acc,
                                             const float (&inv)[2], int wg_row0, int consumer,
                                             int seq_len, int warp, int lane,
                                             const CUtensorMap* o_map, int bh) {
    // Its 40 swizzled offsets depend on the thread only: a persistent block's consumers would
    // compute them once, above the work loop, and keep them live through it (ptxas spilled
    // them, 396 B, at head_dim 128).
    if (PERSISTENT) {
        fa::opaque(warp);
        fa::opaque(lane);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = 16 * warp + fa::fragment_row(lane, half);
#pragma unroll
        for (int c = 0; c < O_REGS / 4; ++c) {
            const int column = 8 * c + fa::fragment_column(lane);
            const uint32_t pair = fa::pack_pair<elem_t>(o_acc[4 * c + 2 * half] * inv[half],
                                                        o_acc[4 * c + 2 * half + 1] * inv[half]);
            fa::st_shared_u32(tile + fa::swizzled_offset<SWIZZLE_BYTES>(64, row, 2 * column),
                              pair);
        }
    }
    if (STAGED_STORE == 2) fa::fence_proxy_async_shared();  // before the TMA reads them
    fa::named_barrier_sync(STAGED_STORE_BARRIER + consumer, 128);
    if (STAGED_STORE == 2) {
        if (warp == 0 && lane == 0) {
#pragma unroll
            for (int chunk = 0; chunk < CHUNKS; ++chunk)
                fa::tma_store_3d(o_map, tile + chunk * 64 * SWIZZLE_BYTES, chunk * CHUNK_COLS,
                                 wg_row0, bh);
            fa::bulk_commit();
            fa::bulk_wait_read<0>();
        }
        return;
    }
    constexpr int UNITS = HEAD_DIM * 2 / 16;  // 16-byte units of a row
    const int tid = 32 * warp + lane;
#pragma unroll
    for (int i = 0; i < 64 * UNITS / 128; ++i) {
        const int unit = i * 128 + tid, row = unit / UNITS, u = unit % UNITS;
        if (wg_row0 + row >= seq_len) continue;
        const uint4 value = fa::ld_shared_v4(tile + fa::swizzled_offset<SWIZZLE_BYTES>(64, row, 16 * u));
        *reinterpret_cast<uint4*>(out_bh + (size_t)(wg_row0 + row) * HEAD_DIM + 8 * u) = value;
    }
}

// ---------------------------------------------------------------- work

// The row blocks a block computes. One block per row block: its own (grid = (row blocks,
// splits, heads)). PERSISTENT: grid = (SMs x BLOCKS_PER_SM, 1, 1), and block b walks work
// items b, b + gridDim.x, ... of the row_blocks x batch_heads queue (row blocks fastest, or
// heaviest first under causal: fa::work_coordinates), so that its producer loads the next
// item's K, V and Q while its consumers finish the last one (FlashAttention-3's static
// persistent scheduler). Producer and consumers walk the same items: every tile loaded is
// consumed and released.
struct WorkQueue {
    int first, end, stride, row_blocks, batch_heads;

    __device__ __forceinline__ WorkQueue(int seq_len, int batch_heads_) {
        row_blocks = (seq_len + BLOCK_M - 1) / BLOCK_M;
        batch_heads = batch_heads_;
        first = PERSISTENT ? static_cast<int>(blockIdx.x) : 0;
        end = PERSISTENT ? row_blocks * batch_heads : 1;
        stride = PERSISTENT ? static_cast<int>(gridDim.x) : 1;
    }

    __device__ __forceinline__ fa::RowBlock<Traits, BLOCK_M, BLOCK_N> block(
        int item, int seq_len, int kv_len, int group, int keys_per_split, int window_left,
        int window_right) const {
        if (!PERSISTENT)
            return {seq_len, kv_len, group, keys_per_split, window_left, window_right};
        return {fa::work_coordinates<Traits::kCausal>(item, row_blocks, batch_heads),
                0, 1, seq_len, kv_len, group, keys_per_split, window_left, window_right};
    }
};

// A K/V tile's place in the ring: the ring-th tile through it (counted over every work item).
struct RingSlot {
    int stage;
    uint32_t parity;
    __device__ __forceinline__ explicit RingSlot(int ring)
        : stage(ring % STAGES), parity(static_cast<uint32_t>(ring / STAGES) & 1) {}
};

// ---------------------------------------------------------------- attention

extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM)
wgmma_f16_attention(const __grid_constant__ CUtensorMap q_map,
                    const __grid_constant__ CUtensorMap k_map,
                    const __grid_constant__ CUtensorMap v_map,
#if STAGED_STORE == 2
                    const __grid_constant__ CUtensorMap o_map,
#endif
                    const elem_t* __restrict__ q,
                    const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                    elem_t* __restrict__ out, float* __restrict__ partial_o,
                    float* __restrict__ partial_lse, int seq_len, int kv_len, int group,
                    int keys_per_split, float scale_log2, int heads, int window_left,
                    int window_right, float softcap, const float* __restrict__ alibi_slopes,
                    const float* __restrict__ sinks, float* __restrict__ lse, int batch_heads) {
    extern __shared__ __align__(1024) unsigned char shared_raw[];
    // The swizzle is a function of address bits 4-9: tiles must start 1024-byte aligned.
    const uint32_t base = (fa::smem_addr(shared_raw) + 1023) & ~1023u;
    const uint32_t s_q = base + Q_OFFSET;
    const uint32_t s_k = base + K_OFFSET;
    const uint32_t s_v = base + V_OFFSET;
    const uint32_t q_full = base + BARRIER_OFFSET;
    const uint32_t q_empty = q_full + 8;
    const uint32_t k_full = q_empty + 8;               // + 8 * stage
    const uint32_t v_full = k_full + 8 * STAGES;
    const uint32_t k_empty = v_full + 8 * STAGES;
    const uint32_t v_empty = k_empty + 8 * STAGES;

    const int tid = threadIdx.x;
    const int warpgroup = tid / 128;  // 0: producer, 1..CONSUMERS: consumers
    const int warp = (tid % 128) / 32;
    const int lane = tid % 32;
    const WorkQueue work(seq_len, batch_heads);

    if (tid == 0) {
        fa::mbar_init(q_full, 1);
        fa::mbar_init(q_empty, 4 * CONSUMERS);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            fa::mbar_init(k_full + 8 * s, 1);
            fa::mbar_init(v_full + 8 * s, 1);
            fa::mbar_init(k_empty + 8 * s, 4 * CONSUMERS);
            fa::mbar_init(v_empty + 8 * s, 4 * CONSUMERS);
        }
        fa::mbar_fence_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        // ---------------------------------------------------------------- producer
        fa::setmaxnreg_dec<PRODUCER_REGISTERS>();
        if (warp == 0 && lane == 0) {
            fa::prefetch_tensor_map(&q_map);
            fa::prefetch_tensor_map(&k_map);
            fa::prefetch_tensor_map(&v_map);
#if STAGED_STORE == 2
            fa::prefetch_tensor_map(&o_map);
#endif
            int ring = 0;  // K/V tiles through the ring so far
            int items = 0;
            for (int item = work.first; item < work.end; item += work.stride, ++items) {
                const auto block = work.block(item, seq_len, kv_len, group, keys_per_split,
                                              window_left, window_right);
                const fa::KeyTiles& tiles = block.tiles;
                // Q once the consumers are done with the last item's (its S products, or the
                // staged store through it): loaded behind the item's first K tile, which can
                // go into the ring while the consumers still finish the last item.
                auto load_q = [&] {
                    fa::mbar_wait(q_empty, (items & 1) ^ 1);
                    fa::mbar_arrive_expect_tx(q_full, CONSUMERS * Q_TILE_BYTES);
#pragma unroll
                    for (int c = 0; c < CONSUMERS; ++c)
#pragma unroll
                        for (int chunk = 0; chunk < CHUNKS; ++chunk)
                            fa::tma_load_3d(s_q + c * Q_TILE_BYTES + chunk * 64 * SWIZZLE_BYTES,
                                            &q_map, chunk * CHUNK_COLS, block.row0 + 64 * c,
                                            block.bh, q_full);
                };
                // (one block per row block: Q first, as its first S product needs it)
                if (!PERSISTENT) load_q();
                for (int t = 0; t < tiles.count; ++t) {
                    const RingSlot slot(ring + t);
                    const int key0 = tiles.begin + t * BLOCK_N;
                    fa::mbar_wait(k_empty + 8 * slot.stage, slot.parity ^ 1);
                    fa::mbar_arrive_expect_tx(k_full + 8 * slot.stage, KV_TILE_BYTES);
#pragma unroll
                    for (int chunk = 0; chunk < CHUNKS; ++chunk)
                        fa::tma_load_3d(
                            s_k + slot.stage * KV_TILE_BYTES + chunk * BLOCK_N * SWIZZLE_BYTES,
                            &k_map, chunk * CHUNK_COLS, key0, block.kv_bh, k_full + 8 * slot.stage);
                    if (PERSISTENT && t == 0) load_q();
                    fa::mbar_wait(v_empty + 8 * slot.stage, slot.parity ^ 1);
                    fa::mbar_arrive_expect_tx(v_full + 8 * slot.stage, KV_TILE_BYTES);
#pragma unroll
                    for (int chunk = 0; chunk < CHUNKS; ++chunk)
                        fa::tma_load_3d(
                            s_v + slot.stage * KV_TILE_BYTES + chunk * BLOCK_N * SWIZZLE_BYTES,
                            &v_map, chunk * CHUNK_COLS, key0, block.kv_bh, v_full + 8 * slot.stage);
                }
                if (PERSISTENT && tiles.count == 0) load_q();
                ring += tiles.count;
            }
        }
    } else {
        // ---------------------------------------------------------------- consumers
        fa::setmaxnreg_inc<CONSUMER_REGISTERS>();
        const int consumer = warpgroup - 1;
        const uint32_t q_tile = s_q + consumer * Q_TILE_BYTES;
        const GemmTurns turns{consumer};
        int ring = 0;  // K/V tiles through the ring so far
        int items = 0;
        for (int item = work.first; item < work.end; item += work.stride, ++items) {
            const auto block = work.block(item, seq_len, kv_len, group, keys_per_split, window_left,
                                          window_right);
            const fa::KeyTiles& tiles = block.tiles;
            const int bh = block.bh;
            const int wg_row0 = block.row0 + 64 * consumer;
            const int my_row = wg_row0 + 16 * warp + fa::fragment_row(lane, 0);  // and my_row + 8

            TileSoftmax softmax{block.mask,
                                block.score_mod(scale_log2, softcap, seq_len, kv_len, alibi_slopes,
                                                heads),
                                {{my_row, my_row + 8}}, wg_row0, lane, {}};
            float o_acc[O_REGS];
            fa::fill_zero<O_REGS>(o_acc);
            // This warp is done with Q (PERSISTENT: the producer may load the next item's).
            auto release_q = [&] {
                if (!PERSISTENT) return;
                fa::fence_proxy_async_shared();  // the staged store's accesses, before the TMA's
                __syncwarp();
                if (lane == 0) fa::mbar_arrive(q_empty);
            };

            fa::mbar_wait(q_full, items & 1);
#if !OVERLAP
            uint32_t p_frag[BLOCK_N / 16][4];
            for (int t = 0; t < tiles.count; ++t) {
                const RingSlot slot(ring + t);

                // ---- S = Q K^T
                float s_acc[S_REGS];
                fa::mbar_wait(k_full + 8 * slot.stage, slot.parity);
                fa::wgmma_fence();
                issue_s(s_acc, q_tile, s_k + slot.stage * KV_TILE_BYTES);
                fa::wgmma_commit();
                fa::wgmma_wait<0>();
                fa::fence_registers<S_REGS>(s_acc);
                __syncwarp();  // this warp's share of S has read the K tile
                if (lane == 0) fa::mbar_arrive(k_empty + 8 * slot.stage);
                float correction[2];
                softmax(s_acc, tiles.begin + t * BLOCK_N, correction);
                fa::rescale_rows<O_REGS / 4>(o_acc, correction);
                pack_p(s_acc, p_frag);

                // ---- O += P V
                fa::mbar_wait(v_full + 8 * slot.stage, slot.parity);
                fa::fence_registers<O_REGS>(o_acc);
                fa::wgmma_fence();
                issue_pv(o_acc, p_frag, s_v + slot.stage * KV_TILE_BYTES);
                fa::wgmma_commit();
                fa::wgmma_wait<0>();
                fa::fence_registers<O_REGS>(o_acc);
                __syncwarp();  // and P V the V tile
                if (lane == 0) fa::mbar_arrive(v_empty + 8 * slot.stage);
            }
#else
            // FlashAttention-3's intra-warpgroup overlap: S(t) is issued, then P(t-1) V(t-1);
            // the softmax of S(t) runs while P V(t-1) is still in the tensor cores, and O is
            // rescaled only after that product has landed. Groups complete in commit order, so
            // wait_group 1 after the two commits means S(t) is done, P V(t-1) maybe not.
            // P alternates between two register sets (the loop is unrolled by two): packing P(t)
            // into the registers P V(t-1) is still reading would make ptxas wait for that product
            // before the softmax (seen in SASS as wait_group 0 hoisted above the exp2s).
            // LATE_PACK (FlashAttention-3's order) keeps S(t) in fp32 until P V(t-1) has landed and
            // then packs P(t) into the one set: S + P + O live at the peak instead of S + 2P + O
            // (what lets 80-key tiles at head_dim 256 and 112 at 192 run unspilled), at the cost
            // of the packing running after the product rather than under it.
            uint32_t p_a[BLOCK_N / 16][4];
            uint32_t p_b_set[LATE_PACK ? 1 : BLOCK_N / 16][4];
            auto p_b = LATE_PACK ? p_a : p_b_set;
            auto overlapped_tile = [&](int t, const uint32_t(*p_previous)[4],
                                       uint32_t(*p_next)[4]) {
                const RingSlot slot(ring + t), previous(ring + t - 1);
                float s_acc[S_REGS];
                fa::mbar_wait(k_full + 8 * slot.stage, slot.parity);
                fa::mbar_wait(v_full + 8 * previous.stage, previous.parity);
                fa::fence_registers<O_REGS>(o_acc);
                turns.take();
                fa::wgmma_fence();
                issue_s(s_acc, q_tile, s_k + slot.stage * KV_TILE_BYTES);
                fa::wgmma_commit();
                issue_pv(o_acc, p_previous, s_v + previous.stage * KV_TILE_BYTES);
                fa::wgmma_commit();
                turns.pass();
                fa::wgmma_wait<1>();  // S(t) has landed
                fa::fence_registers<S_REGS>(s_acc);
                float correction[2];
                softmax(s_acc, tiles.begin + t * BLOCK_N, correction);
                if (!LATE_PACK) pack_p(s_acc, p_next);
                // K(t)'s slot is free since S(t) landed; released after the softmax, a tile before
                // P V(t) frees V(t)'s
                __syncwarp();
                if (lane == 0) fa::mbar_arrive(k_empty + 8 * slot.stage);
                // P(t-1) V(t-1) has landed after this wait: V(t-1)'s slot is free. ptxas schedules
                // a wait with no operands as early as its basic block allows, i.e. above the
                // softmax, which would undo the overlap (seen in SASS); behind a branch on the
                // row sums (which need every exp2 of the tile) it stays below the softmax. The
                // branch is always taken unless a sum is NaN, and then waits all the same.
                if (softmax.state.sum[0] + softmax.state.sum[1] >= 0.f) {
                    fa::wgmma_wait<0>();
                } else {
                    fa::wgmma_wait<0>();
                    softmax.state.sum[0] = NAN;  // keeps the two branches distinct (not merged)
                }
                fa::fence_registers<O_REGS>(o_acc);
                __syncwarp();
                if (lane == 0) fa::mbar_arrive(v_empty + 8 * previous.stage);
                if (LATE_PACK) pack_p(s_acc, p_next);  // into the set P V(t-1) has done reading
                fa::rescale_rows_if_moved<O_REGS / 4>(o_acc, correction);
            };
            auto last_product = [&](const uint32_t(*p_last)[4]) {
                const RingSlot last(ring + tiles.count - 1);
                fa::mbar_wait(v_full + 8 * last.stage, last.parity);
                fa::fence_registers<O_REGS>(o_acc);
                turns.take();
                fa::wgmma_fence();
                issue_pv(o_acc, p_last, s_v + last.stage * KV_TILE_BYTES);
                fa::wgmma_commit();
                turns.pass(/*last=*/true);
                fa::wgmma_wait<0>();
                fa::fence_registers<O_REGS>(o_acc);
                __syncwarp();
                if (lane == 0) fa::mbar_arrive(v_empty + 8 * last.stage);
            };
            turns.start(tiles.count);
            if (tiles.count > 0) {
                const RingSlot first(ring);
                float s_acc[S_REGS];
                fa::mbar_wait(k_full + 8 * first.stage, first.parity);
                turns.take();
                fa::wgmma_fence();
                issue_s(s_acc, q_tile, s_k + first.stage * KV_TILE_BYTES);
                fa::wgmma_commit();
                turns.pass();
                fa::wgmma_wait<0>();
                fa::fence_registers<S_REGS>(s_acc);
                __syncwarp();
                if (lane == 0) fa::mbar_arrive(k_empty + 8 * first.stage);
                float correction[2];
                softmax(s_acc, tiles.begin, correction);  // O is still 0
                pack_p(s_acc, p_a);
            }
            int t = 1;
            for (; t + 1 < tiles.count; t += 2) {
                overlapped_tile(t, p_a, p_b);
                overlapped_tile(t + 1, p_b, p_a);
            }
            if (t < tiles.count) {
                overlapped_tile(t, p_a, p_b);
                last_product(p_b);
            } else if (tiles.count > 0) {
                last_product(p_a);
            }
#endif
            ring += tiles.count;

            // ---- epilogue
            softmax.state.finish();
            if (!STAGED_STORE) release_q();  // every S product has landed
            if (block.splits == 1) {
                const float sink = Traits::sink(sinks, bh % heads);
                elem_t* out_bh = out + (size_t)bh * seq_len * HEAD_DIM;
                float inv[2];
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = my_row + 8 * half;
                    const fa::RowResult result =
                        fa::row_result(softmax.state.max[half], softmax.state.sum[half], sink);
                    inv[half] = result.inv;
                    if (row >= seq_len) continue;
                    if (!STAGED_STORE)
                        fa::store_fragment_row<O_REGS / 4>(out_bh + (size_t)row * HEAD_DIM, o_acc,
                                                           half, result.inv, lane);
                    if (lse != nullptr && lane % 4 == 0)
                        lse[(size_t)bh * seq_len + row] = fa::lse_natural(result.lse2);
                }
                if (STAGED_STORE) {
#if STAGED_STORE == 2
                    const CUtensorMap* o_tensor = &o_map;
#else
                    const CUtensorMap* o_tensor = nullptr;
#endif
                    staged_store(out_bh, q_tile, o_acc, inv, wg_row0, consumer, seq_len, warp,
                                 lane, o_tensor, bh);
                    release_q();
                }
            } else {
                // float32 partial output (normalised by this split's sum) and the split's
                // log2-sum-exp (-inf where the split saw no key of the row).
                const size_t part_row0 = ((size_t)bh * block.splits + block.split) * seq_len;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = my_row + 8 * half;
                    if (row >= seq_len) continue;
                    const fa::RowResult result =
                        fa::partial_result(softmax.state.max[half], softmax.state.sum[half]);
                    fa::store_fragment_row<O_REGS / 4>(partial_o + (part_row0 + row) * HEAD_DIM,
                                                       o_acc, half, result.inv, lane);
                    if (lane % 4 == 0) partial_lse[part_row0 + row] = result.lse2;
                }
            }
        }
    }
}

// ---------------------------------------------------------------- split merge

extern "C" __global__ void __launch_bounds__(fa::kMergeThreads)
wgmma_f16_split_merge(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
                      elem_t* __restrict__ out, int seq_len, int splits, int total_rows, int heads,
                      const float* __restrict__ sinks, float* __restrict__ lse) {
    fa::merge_splits<elem_t, HEAD_DIM>(partial_o, partial_lse, out, seq_len, splits, total_rows,
                                       heads, sinks, lse);
}
