// Everything a forward attention kernel composes, in one include: the PTX wrappers, element
// types, tile loads and the K/V ring, the split-KV contract, masks and score modifications,
// the online softmax, the accumulator fragment, and the split merge.
#pragma once

#include "fa/dtype.cuh"
#include "fa/fragment.cuh"
#include "fa/mask.cuh"
#include "fa/ptx.cuh"
#include "fa/score_mod.cuh"
#include "fa/softmax.cuh"
#include "fa/split_kv.cuh"
#include "fa/split_merge.cuh"
#include "fa/tile_load.cuh"
#include "fa/variant.cuh"
