// A kernel's attention variant: the compile-time half (which masks, score modifications and
// sinks exist: CAUSAL, WINDOW, SOFTCAP, ALIBI, SINKS defines, so a plain kernel carries none
// of their code) as a traits struct, and the run-time half (window bounds, cap, slopes, sinks) as the
// kernel arguments every forward entry takes after its scale:
//   ..., float scale_log2, int heads, int window_left, int window_right, float softcap,
//   const float* alibi_slopes, const float* sinks, float* lse
// heads indexes the per-head slopes and sinks (head = bh % heads); lse (nullable) receives
// each row's natural-log log-sum-exp, for the backward pass.
#pragma once

#include "fa/mask.cuh"
#include "fa/score_mod.cuh"
#include "fa/softmax.cuh"

namespace fa {

template <bool Causal, bool Window, bool Softcap, bool Alibi, bool Sinks>
struct Variant {
    static constexpr bool kCausal = Causal;
    static constexpr bool kWindow = Window;
    static constexpr bool kSoftcap = Softcap;
    static constexpr bool kAlibi = Alibi;
    static constexpr bool kSinks = Sinks;
    using MaskType = Mask<Causal, Window>;
    using ScoreModType = ScoreMod<Softcap, Alibi>;

    // A head's sink logit in the log2 domain; -inf (none) unless the variant has sinks.
    static __device__ __forceinline__ float sink(const float* sinks, int head) {
        return Sinks ? sink_log2(sinks, head) : -INFINITY;
    }
};

}  // namespace fa
