// kernels/mma_f16.cu (the forward) on the emulator; compile with its -D defines.
#include "harness.hpp"
#include "mma_f16.cu"

int main() {
    return emu::serve(
        {EMULATED_ENTRY(mma_f16_attention), EMULATED_ENTRY(mma_f16_split_merge)});
}
