// The build's switches of a forward family's attention variant: the -DCAUSAL, -DWINDOW,
// -DSOFTCAP, -DALIBI, -DSINKS that tuner.planner.families.base.variant_defines passes (a
// plain problem passes none of the last four), each off unless defined, and the Variant
// traits they make. This is the one header that reads the including file's macros: it turns
// them into the template arguments every other header takes.
#pragma once

#include "fa/variant.cuh"

#ifndef CAUSAL
#define CAUSAL 0
#endif
#ifndef WINDOW
#define WINDOW 0
#endif
#ifndef SOFTCAP
#define SOFTCAP 0
#endif
#ifndef ALIBI
#define ALIBI 0
#endif
#ifndef SINKS
#define SINKS 0
#endif

namespace fa {
using SwitchedVariant = Variant<CAUSAL, WINDOW, SOFTCAP, ALIBI, SINKS>;
}  // namespace fa
