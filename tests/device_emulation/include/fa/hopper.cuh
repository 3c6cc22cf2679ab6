// kernels/include/fa/hopper.cuh emulated on host threads (../../emulator.hpp). The real header
// is included with its instructions renamed away, so its arithmetic (the shared-memory matrix
// descriptors, their steps, the swizzled offsets) is what the emulated kernels use; the
// instructions the emulated kernels issue are redefined below as the PTX ISA says they act,
// their asynchrony at its latest:
//   * a TMA copy completes its bytes on its mbarrier when issued and lands at the first wait
//     on the phase it completes;
//   * wgmma's products run at the wait that retires their group (wgmma_ops.cuh);
//   * mbarriers (arrivals, transaction bytes, phases) and named barriers block the waiting
//     host thread, and a wait that lasts a minute is reported as a deadlock;
//   * stmatrix, the bulk reductions and the TMA stores act when issued; the fences and setmaxnreg do nothing
//     (proxies and registers are not emulated).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "fa/ptx.cuh"

#define fence_proxy_async_shared real_fence_proxy_async_shared
#define wgmma_fence real_wgmma_fence
#define wgmma_commit real_wgmma_commit
#define wgmma_wait real_wgmma_wait
#define fence_registers real_fence_registers
#define stmatrix_x4_trans real_stmatrix_x4_trans
#define bulk_reduce_add_f32 real_bulk_reduce_add_f32
#define bulk_commit real_bulk_commit
#define bulk_wait_read real_bulk_wait_read
#define bulk_wait real_bulk_wait
#define mbar_init real_mbar_init
#define mbar_fence_init real_mbar_fence_init
#define mbar_arrive_expect_tx real_mbar_arrive_expect_tx
#define mbar_arrive real_mbar_arrive
#define mbar_wait real_mbar_wait
#define prefetch_tensor_map real_prefetch_tensor_map
#define tma_load_3d real_tma_load_3d
#define tma_store_3d real_tma_store_3d
#define named_barrier_sync real_named_barrier_sync
#define named_barrier_arrive real_named_barrier_arrive
#define setmaxnreg_dec real_setmaxnreg_dec
#define setmaxnreg_inc real_setmaxnreg_inc
#include "../../../../kernels/include/fa/hopper.cuh"
#undef fence_proxy_async_shared
#undef wgmma_fence
#undef wgmma_commit
#undef wgmma_wait
#undef fence_registers
#undef stmatrix_x4_trans
#undef bulk_reduce_add_f32
#undef bulk_commit
#undef bulk_wait_read
#undef bulk_wait
#undef mbar_init
#undef mbar_fence_init
#undef mbar_arrive_expect_tx
#undef mbar_arrive
#undef mbar_wait
#undef prefetch_tensor_map
#undef tma_load_3d
#undef tma_store_3d
#undef named_barrier_sync
#undef named_barrier_arrive
#undef setmaxnreg_dec
#undef setmaxnreg_inc

namespace fa {

// The 16-byte unit of a shared address XOR (address / 128) modulo span / 16: the 128-, 64- and
// 32-byte swizzles as the TMA writes and wgmma reads them (atoms aligned to 8 x span bytes).
inline uint32_t emulated_swizzle(uint32_t address, uint32_t span) {
    return address ^ (((address >> 7) & (span / 16 - 1)) << 4);
}

// ---------------------------------------------------------------- barriers

// A TMA copy issued on an mbarrier: it lands when the phase it completes is first waited on.
struct EmulatedCopy {
    uint32_t dst;
    emu::TensorMapInfo map;
    int c0, c1, c2;
    unsigned phase;  // the barrier phase whose bytes it carries
};
void land_copy(const EmulatedCopy& copy);

struct EmulatedMbarrier {
    int expected = 0, pending = 0;
    long long transaction_bytes = 0;
    unsigned phase = 0;  // completed phases; the current one's parity is phase % 2
    std::vector<EmulatedCopy> copies;  // issued, not yet landed
};
struct EmulatedNamedBarrier {
    int arrived = 0;
    unsigned generation = 0;
};
// Per-block barrier state, reset when a new block touches it (emu::block_serial).
struct EmulatedBarriers {
    std::mutex mutex;
    std::condition_variable changed;
    unsigned serial = ~0u;
    std::map<uint32_t, EmulatedMbarrier> mbarriers;
    std::map<int, EmulatedNamedBarrier> named;

    std::unique_lock<std::mutex> lock() {
        std::unique_lock<std::mutex> held(mutex);
        if (serial != emu::block_serial) {
            serial = emu::block_serial;
            mbarriers.clear();
            named.clear();
        }
        return held;
    }
    EmulatedMbarrier& mbarrier(uint32_t bar) {
        auto found = mbarriers.find(bar);
        if (found == mbarriers.end()) {
            std::fprintf(stderr, "mbarrier at shared byte %u used before mbarrier.init\n", bar);
            std::abort();
        }
        return found->second;
    }
    // Arrivals and transaction bytes both done: the phase completes and the next begins.
    void settle(EmulatedMbarrier& b) {
        if (b.pending < 0 || b.transaction_bytes < 0) {
            std::fprintf(stderr, "an mbarrier got more arrivals or bytes than its phase expects\n");
            std::abort();
        }
        if (b.pending == 0 && b.transaction_bytes == 0) {
            ++b.phase;
            b.pending = b.expected;
            changed.notify_all();
        }
    }
    template <class Done>
    void wait(std::unique_lock<std::mutex>& held, Done done, const char* what) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (!done()) {
            if (changed.wait_until(held, deadline) == std::cv_status::timeout && !done()) {
                std::fprintf(stderr, "%s never completed (deadlock)\n", what);
                std::abort();
            }
        }
    }
};
inline EmulatedBarriers emulated_barriers;

inline void mbar_init(uint32_t bar, int count) {
    auto held = emulated_barriers.lock();
    emulated_barriers.mbarriers[bar] = EmulatedMbarrier{count, count, 0, 0, {}};
}
inline void mbar_fence_init() {}
inline void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    auto held = emulated_barriers.lock();
    EmulatedMbarrier& b = emulated_barriers.mbarrier(bar);
    b.transaction_bytes += bytes;
    --b.pending;
    emulated_barriers.settle(b);
}
inline void mbar_arrive(uint32_t bar) {
    auto held = emulated_barriers.lock();
    EmulatedMbarrier& b = emulated_barriers.mbarrier(bar);
    --b.pending;
    emulated_barriers.settle(b);
}
// Returns once the phase of parity `parity` has completed: the current phase's parity differs
// (a fresh barrier's current phase is 0, so parity 1 returns at once).
// The TMA copies of the completed phases land now (the latest the PTX ISA allows): a thread
// that reads a box before waiting on its barrier reads what was there before.
inline void mbar_wait(uint32_t bar, uint32_t parity) {
    auto held = emulated_barriers.lock();
    emulated_barriers.wait(
        held, [&] { return emulated_barriers.mbarrier(bar).phase % 2 != parity; }, "an mbarrier wait");
    EmulatedMbarrier& b = emulated_barriers.mbarrier(bar);
    std::vector<EmulatedCopy> later;
    for (const EmulatedCopy& copy : b.copies) {
        if (copy.phase < b.phase)
            land_copy(copy);
        else
            later.push_back(copy);
    }
    b.copies = std::move(later);
}

// bar.sync / bar.arrive: `threads` arrivals (a thread each here) complete the barrier's phase.
inline void named_barrier_arrive(int id, int threads) {
    auto held = emulated_barriers.lock();
    EmulatedNamedBarrier& n = emulated_barriers.named[id];
    if (++n.arrived == threads) {
        n.arrived = 0;
        ++n.generation;
        emulated_barriers.changed.notify_all();
    }
}
inline void named_barrier_sync(int id, int threads) {
    auto held = emulated_barriers.lock();
    EmulatedNamedBarrier& n = emulated_barriers.named[id];
    const unsigned generation = n.generation;
    if (++n.arrived == threads) {
        n.arrived = 0;
        ++n.generation;
        emulated_barriers.changed.notify_all();
        return;
    }
    emulated_barriers.wait(
        held, [&] { return emulated_barriers.named[id].generation != generation; },
        "a named barrier");
}

template <int N>
inline void setmaxnreg_dec() {}
template <int N>
inline void setmaxnreg_inc() {}

// ---------------------------------------------------------------- TMA

inline void prefetch_tensor_map(const CUtensorMap*) {}
// The box at (c0, c1, c2) of the map's tensor (zeros outside it) into shared memory at `dst`:
// box row r at dst + r x (the box's inner bytes), swizzled.
inline void land_copy(const EmulatedCopy& copy) {
    const emu::TensorMapInfo& info = copy.map;
    const uint32_t pitch = info.box[0] * info.element_bytes;
    for (uint32_t r = 0; r < info.box[1]; ++r)
        for (uint32_t e = 0; e < info.box[0]; ++e) {
            const uint64_t x = static_cast<uint64_t>(copy.c0) + e;
            const uint64_t y = static_cast<uint64_t>(copy.c1) + r;
            const bool inside = copy.c0 >= 0 && copy.c1 >= 0 && copy.c2 >= 0 && x < info.dims[0] &&
                                y < info.dims[1] && static_cast<uint64_t>(copy.c2) < info.dims[2];
            unsigned char* to = shared_raw + emulated_swizzle(copy.dst + r * pitch + e * info.element_bytes,
                                                              info.swizzle_bytes);
            if (inside)
                std::memcpy(to, info.base + copy.c2 * info.strides[1] + y * info.strides[0] +
                                    x * info.element_bytes,
                            info.element_bytes);
            else
                std::memset(to, 0, info.element_bytes);
        }
}
// The map of a TMA copy between shared memory at `smem` and a tensor: the box must be one
// swizzle row wide, of one plane, and lie in shared memory 128-byte aligned (else abort).
inline emu::TensorMapInfo checked_box(const CUtensorMap* map, uint32_t smem, const char* what) {
    emu::TensorMapInfo info;
    std::memcpy(&info, map, sizeof(info));
    const uint32_t pitch = info.box[0] * info.element_bytes;
    const uint32_t bytes = pitch * info.box[1] * info.box[2];
    if (smem % 128 || smem + bytes > emu::kSharedBytes || info.box[2] != 1 ||
        pitch != static_cast<uint32_t>(info.swizzle_bytes)) {
        std::fprintf(stderr, "%s of %u bytes at shared %u: misaligned, out of range, or not one "
                             "swizzle row wide\n", what, bytes, smem);
        std::abort();
    }
    return info;
}
// Issues the copy: its bytes complete on `bar` now (so the phase completes as on the GPU), its
// data lands at the first wait on that phase (mbar_wait).
inline void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                        uint32_t bar) {
    const emu::TensorMapInfo info = checked_box(map, dst, "a TMA load");
    const uint32_t bytes = info.box[0] * info.element_bytes * info.box[1];
    auto held = emulated_barriers.lock();
    EmulatedMbarrier& b = emulated_barriers.mbarrier(bar);
    b.copies.push_back({dst, info, c0, c1, c2, b.phase});
    b.transaction_bytes -= bytes;
    emulated_barriers.settle(b);
}

// cp.async.bulk.tensor (shared to global): the box at `src`, laid out as a load of the same
// map leaves it (swizzled), to the map's coordinates (c0, c1, c2); elements outside the map's
// dims are not written. Acts when issued (the writes the fence and barrier before it order).
inline void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
    const emu::TensorMapInfo info = checked_box(map, src, "a TMA store");
    const uint32_t pitch = info.box[0] * info.element_bytes;
    for (uint32_t r = 0; r < info.box[1]; ++r)
        for (uint32_t e = 0; e < info.box[0]; ++e) {
            const uint64_t x = static_cast<uint64_t>(c0) + e;
            const uint64_t y = static_cast<uint64_t>(c1) + r;
            if (c0 < 0 || c1 < 0 || c2 < 0 || x >= info.dims[0] || y >= info.dims[1] ||
                static_cast<uint64_t>(c2) >= info.dims[2])
                continue;
            unsigned char* to = const_cast<unsigned char*>(info.base) + c2 * info.strides[1] +
                                y * info.strides[0] + x * info.element_bytes;
            std::memcpy(to, shared_raw + emulated_swizzle(src + r * pitch + e * info.element_bytes,
                                                          info.swizzle_bytes),
                        info.element_bytes);
        }
}

// ---------------------------------------------------------------- fences, wgmma's groups

inline void fence_proxy_async_shared() {}
inline void wgmma_fence() {}
inline void wgmma_commit();  // wgmma_ops.cuh: the products' queue
template <int N>
inline void wgmma_wait();
template <int N>
inline void fence_registers(float*) {}

// Four 8x8 b16 matrices, transposed: register i of lane l holds row l / 4, columns 2 (l % 4)
// and 2 (l % 4) + 1 of matrix i; lane 8 i + r gives the address of stored row r of matrix i,
// which receives column r of the matrix (8 b16, 16 bytes).
inline void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
    const uint32_t mine[5] = {r[0], r[1], r[2], r[3], addr};
    emu::exchange(mine, 5, [&](const uint32_t (*words)[12]) {
        const int lane = emu::lane_id(), matrix = lane / 8, column = lane % 8;
        const uint32_t row = words[lane][4];
        check_shared(row, 16, "a stmatrix row");
        for (int q = 0; q < 8; ++q) {
            const uint32_t word = words[4 * q + column / 2][matrix];
            const uint16_t bits = static_cast<uint16_t>(column % 2 ? word >> 16 : word & 0xFFFF);
            std::memcpy(shared_raw + row + 2 * q, &bits, 2);
        }
    });
}

// cp.reduce.async.bulk .add.f32: `bytes` of float32 at shared `src` added to global `dst`.
inline void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
    if (src % 16 || bytes % 16 || reinterpret_cast<uintptr_t>(dst) % 16 ||
        src + bytes > emu::kSharedBytes) {
        std::fprintf(stderr, "bulk reduction of %u bytes from %u: misaligned or out of range\n",
                     bytes, src);
        std::abort();
    }
    for (uint32_t i = 0; i < bytes / 4; ++i) {
        float value;
        std::memcpy(&value, shared_raw + src + 4 * i, 4);
        std::atomic_ref<float>(dst[i]).fetch_add(value);
    }
}
inline void bulk_commit() {}
template <int N>
inline void bulk_wait_read() {}
template <int N>
inline void bulk_wait() {}

}  // namespace fa
