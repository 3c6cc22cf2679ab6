// The CUDA execution model on host threads, so the project's kernel sources run unchanged on
// a machine without a GPU (tests/test_device_emulation.py): one std::thread per CUDA thread
// of a block, blocks one after another in launch order (x fastest), warp-synchronous
// instructions (ldmatrix, mma.sync, stmatrix, shuffles, and a warp's share of wgmma) as
// exchanges between a warp's 32 threads at a barrier, __syncthreads as a block barrier.
// Shared memory is one buffer, filled with NaN bytes before every block (a read of an
// unwritten byte shows). The emulated PTX wrappers are include/fa/ptx.cuh, hopper.cuh and
// wgmma_ops.cuh beside this file, which shadow the real ones on the include path.
//
// What it checks: every index, fragment layout, mask and barrier of a kernel, at the PTX
// ISA's semantics of the instructions it uses. What it does not: timing, bank conflicts,
// the asynchrony of cp.async, the TMA and wgmma (copies and products land when issued) and
// races between blocks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__

using std::max;
using std::min;

namespace emu {

struct Dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline thread_local Dim3 thread_index;
inline thread_local Dim3 block_index;
inline Dim3 grid_dim;
inline Dim3 block_dim;
// Counts the blocks run, so per-block state kept outside shared memory (mbarriers, named
// barriers: include/fa/hopper.cuh) knows when a new block starts.
inline std::atomic<unsigned> block_serial{0};

// What a CUtensorMap carries here (in its 128 opaque bytes): the global tensor (base, dims
// innermost first, byte strides of the outer dims), the box and the swizzle span.
struct TensorMapInfo {
    const unsigned char* base;
    int element_bytes;
    int swizzle_bytes;
    uint64_t dims[3];
    uint64_t strides[2];
    uint32_t box[3];
};

constexpr size_t kSharedBytes = 256 * 1024;

// What one warp's lanes exchange at a warp-synchronous instruction.
struct WarpExchange {
    uint32_t words[32][12];
    std::barrier<> barrier{32};
};

struct Block {
    std::unique_ptr<std::barrier<>> barrier;
    std::vector<std::unique_ptr<WarpExchange>> warps;
};
inline Block block;

inline WarpExchange& warp_exchange() { return *block.warps[thread_index.x / 32]; }
inline int lane_id() { return static_cast<int>(thread_index.x % 32); }

// Lane `lane` deposits `count` words; after the barrier every lane reads the warp's words;
// `read` runs between two barriers, so no lane overwrites its slot while another reads it.
template <class Read>
inline void exchange(const uint32_t* mine, int count, Read read) {
    WarpExchange& warp = warp_exchange();
    std::memcpy(warp.words[lane_id()], mine, count * sizeof(uint32_t));
    warp.barrier.arrive_and_wait();
    read(warp.words);
    warp.barrier.arrive_and_wait();
}

}  // namespace emu

#define threadIdx (emu::thread_index)
#define blockIdx (emu::block_index)
#define gridDim (emu::grid_dim)
#define blockDim (emu::block_dim)

alignas(128) inline unsigned char shared_raw[emu::kSharedBytes];

inline void __syncthreads() { emu::block.barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_exchange().barrier.arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float __log2f(float x) { return std::log2(x); }
template <typename T>
inline T __ldg(const T* address) { return *address; }  // the read-only cache path

template <typename T>
inline T __shfl_xor_sync(unsigned, T value, int lane_mask) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    uint32_t word;
    std::memcpy(&word, &value, 4);
    T result;
    emu::exchange(&word, 1, [&](const uint32_t (*words)[12]) {
        std::memcpy(&result, &words[emu::lane_id() ^ lane_mask][0], 4);
    });
    return result;
}

// The vote: whether any lane of the (whole) warp passes `predicate`.
inline int __any_sync(unsigned, int predicate) {
    const uint32_t word = predicate != 0;
    int any = 0;
    emu::exchange(&word, 1, [&](const uint32_t (*words)[12]) {
        for (int lane = 0; lane < 32; ++lane) any |= words[lane][0] != 0;
    });
    return any;
}

template <typename T>
inline T __shfl_sync(unsigned, T value, int source_lane) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    uint32_t word;
    std::memcpy(&word, &value, 4);
    T result;
    emu::exchange(&word, 1, [&](const uint32_t (*words)[12]) {
        std::memcpy(&result, &words[source_lane % 32][0], 4);
    });
    return result;
}

namespace emu {

// Runs kernel(args...) on grid x block threads, blocks in launch order (x fastest).
template <class Kernel>
inline void launch(Dim3 grid, Dim3 threads, size_t shared_bytes, Kernel kernel) {
    if (shared_bytes > kSharedBytes) {
        std::fprintf(stderr, "launch asks for %zu B of shared memory\n", shared_bytes);
        std::exit(2);
    }
    if (threads.y != 1 || threads.z != 1 || threads.x % 32) {
        std::fprintf(stderr, "blocks must be whole warps in x\n");
        std::exit(2);
    }
    grid_dim = grid;
    block_dim = threads;
    const int count = static_cast<int>(threads.x);
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                std::memset(shared_raw, 0xFF, kSharedBytes);  // NaN in every float type
                ++block_serial;
                block.barrier = std::make_unique<std::barrier<>>(count);
                block.warps.clear();
                for (int w = 0; w < count / 32; ++w)
                    block.warps.push_back(std::make_unique<WarpExchange>());
                std::vector<std::thread> workers;
                workers.reserve(count);
                for (int t = 0; t < count; ++t)
                    workers.emplace_back([&, t, x, y, z] {
                        thread_index = {static_cast<unsigned>(t), 0, 0};
                        block_index = {x, y, z};
                        kernel();
                        // A finished thread leaves every barrier, as an exited CUDA thread does.
                        block.barrier->arrive_and_drop();
                        block.warps[t / 32]->barrier.arrive_and_drop();
                    });
                for (auto& worker : workers) worker.join();
            }
}

}  // namespace emu
