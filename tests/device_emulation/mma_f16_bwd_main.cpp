// kernels/mma_f16_bwd.cu (the backward) on the emulator; compile with its -D defines.
#include "harness.hpp"
#include "mma_f16_bwd.cu"

int main() {
    return emu::serve({EMULATED_ENTRY(mma_f16_bwd_preprocess), EMULATED_ENTRY(mma_f16_bwd_attention),
                       EMULATED_ENTRY(mma_f16_bwd_dq), EMULATED_ENTRY(mma_f16_bwd_dkv),
                       EMULATED_ENTRY(mma_f16_bwd_sinks)});
}
