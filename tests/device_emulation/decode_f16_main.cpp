// kernels/decode_f16.cu (FlashDecoding: GQA rows packed per KV head, split-KV) on the
// emulator; compile with its -D defines.
#include "harness.hpp"
#include "decode_f16.cu"

int main() {
    return emu::serve(
        {EMULATED_ENTRY(decode_f16_attention), EMULATED_ENTRY(decode_f16_split_merge)});
}
