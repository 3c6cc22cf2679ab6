// Score modifications applied before the softmax (FlashInfer's variants, FlexAttention's
// score_mod): the logit softcap (Gemma 2) and the ALiBi bias (BLOOM, MPT). Both run on the
// raw scores s = q.k of one tile and map them to the log2-domain logits the online softmax
// takes; without either, the softmax folds the scale into its exp2 argument instead (one
// FFMA a score, the fast path), so apply() is a no-op.
//
//   softcap:  logit = softcap * tanh(s * scale / softcap)
//   ALiBi:    logit += -slope_h * |r + off - k|    (off = kv_len - seq_len; slope per query head)
// both multiplied by log2(e) for exp2. Scores of the m16n8 accumulator layout (see mask.cuh).
// The softcap's tanh runs on the SFU (tanh.approx, about 2^-11 relative error: below a half
// type's rounding) unless PreciseTanh asks for the float32 library tanh (float32 problems).
#pragma once

#include "fa/fragment.cuh"
#include "fa/ptx.cuh"

namespace fa {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <bool Softcap, bool Alibi, bool PreciseTanh = false>
struct ScoreMod {
    static constexpr bool kActive = Softcap || Alibi;

    float scale_log2;  // log2(e) * softmax scale
    float cap_in;      // softmax scale / softcap
    float cap_out;     // softcap * log2(e)
    float slope[2];    // -slope * log2(e) of the heads of a thread's two rows (ALiBi)
    int offset;        // kv_len - seq_len

    __device__ __forceinline__ ScoreMod(float scale_log2_, float softcap, int seq_len, int kv_len)
        : scale_log2(scale_log2_), offset(kv_len - seq_len) {
        cap_out = softcap * kLog2e;
        cap_in = Softcap ? scale_log2_ / cap_out : 0.f;
        slope[0] = slope[1] = 0.f;
    }
    // The heads of the thread's two rows (they differ only where decode packs a group's
    // heads into one tile).
    __device__ __forceinline__ void set_heads(const float* alibi_slopes, int head0, int head1) {
        if (Alibi) {
            slope[0] = -alibi_slopes[head0] * kLog2e;
            slope[1] = -alibi_slopes[head1] * kLog2e;
        }
    }
    // What the online softmax multiplies scores by: 1 once apply() has made them logits.
    __device__ __forceinline__ float softmax_scale() const { return kActive ? 1.f : scale_log2; }

    template <int NChunks>
    __device__ __forceinline__ void apply(float* s, int key0, const FragmentRows& rows,
                                          int lane) const {
        if constexpr (kActive) {
#pragma unroll
            for (int c = 0; c < NChunks; ++c)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int key = key0 + 8 * c + 2 * (lane % 4) + (i % 2);
                    float unused;
                    s[4 * c + i] = logit(s[4 * c + i], rows[i / 2], key, i / 2, unused);
                }
        }
    }

    // One raw score x = q.k of query row `row` and key `key` as its log2-domain logit (what
    // apply() does to every score; `half` picks the row's ALiBi slope), and in `derivative`
    // d logit / d (x * scale) in natural units, for the backward pass: 1 - tanh^2 under the
    // softcap (logit = softcap * tanh(x * scale / softcap)), 1 otherwise (ALiBi's bias does
    // not depend on x). The backward recomputes P with exactly the forward's arithmetic.
    __device__ __forceinline__ float logit(float x, int row, int key, int half,
                                           float& derivative) const {
        if (Softcap) {
            const float t = PreciseTanh ? tanhf(x * cap_in) : fast_tanh(x * cap_in);
            derivative = 1.f - t * t;
            x = cap_out * t;
        } else {
            derivative = 1.f;
            x *= scale_log2;
        }
        if (Alibi) x += slope[half] * fabsf(static_cast<float>(row + offset - key));
        return x;
    }
};

}  // namespace fa
