// kernels/wgmma_f16_bwd.cu (the Hopper backward) on the emulator; compile with its -D defines.
#include "harness.hpp"
#include "wgmma_f16_bwd.cu"

int main() {
    return emu::serve({EMULATED_ENTRY(wgmma_f16_bwd_preprocess),
                       EMULATED_ENTRY(wgmma_f16_bwd_attention), EMULATED_ENTRY(wgmma_f16_bwd_dq),
                       EMULATED_ENTRY(wgmma_f16_bwd_dkv), EMULATED_ENTRY(wgmma_f16_bwd_sinks)});
}
