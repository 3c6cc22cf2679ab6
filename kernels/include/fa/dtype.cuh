// Element types: what a family's IS_FP16 define selects, and the conversions from the fp32
// accumulators to stored values (16-bit pairs for mma A fragments and outputs, float4 rows
// for split partials and float32 outputs) and back (the backward pass reads O and dO).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace fa {

template <bool IsFp16>
struct HalfType {
    using type = __nv_bfloat16;
};
template <>
struct HalfType<true> {
    using type = __half;
};

// Two fp32 values as one 32-bit register of two 16-bit elements (lo in the low half).
template <typename Elem>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack_pair<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}

// One 32-bit register of two 16-bit elements as two fp32 values (lo first): pack_pair's inverse.
template <typename Elem>
__device__ __forceinline__ float2 unpack_pair(uint32_t packed);

template <>
__device__ __forceinline__ float2 unpack_pair<__nv_bfloat16>(uint32_t packed) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&packed));
}
template <>
__device__ __forceinline__ float2 unpack_pair<__half>(uint32_t packed) {
    return __half22float2(*reinterpret_cast<__half2*>(&packed));
}

// Two adjacent values of a row: a 4-byte pair of 16-bit elements, or a float2.
template <typename Out>
__device__ __forceinline__ void store_pair(Out* dst, float lo, float hi) {
    *reinterpret_cast<uint32_t*>(dst) = pack_pair<Out>(lo, hi);
}
template <>
__device__ __forceinline__ void store_pair<float>(float* dst, float lo, float hi) {
    *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
}

// Four adjacent values of a row: 8 bytes of 16-bit elements, or a float4.
template <typename Out>
__device__ __forceinline__ void store_quad(Out* dst, float4 value) {
    uint2 packed;
    packed.x = pack_pair<Out>(value.x, value.y);
    packed.y = pack_pair<Out>(value.z, value.w);
    *reinterpret_cast<uint2*>(dst) = packed;
}
template <>
__device__ __forceinline__ void store_quad<float>(float* dst, float4 value) {
    *reinterpret_cast<float4*>(dst) = value;
}

}  // namespace fa
