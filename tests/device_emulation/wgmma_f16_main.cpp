// kernels/wgmma_f16.cu (the Hopper forward: TMA, mbarriers, warp specialisation, wgmma) on the
// emulator; compile with its -D defines.
#include "harness.hpp"
#include "wgmma_f16.cu"

int main() {
    return emu::serve({EMULATED_ENTRY(wgmma_f16_attention), EMULATED_ENTRY(wgmma_f16_split_merge)});
}
