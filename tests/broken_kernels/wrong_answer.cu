// Finite, plausible, wrong: the softmax scale lacks its 1/sqrt(HEAD_DIM).
#define FAULT_WRONG_SCALE 1
#include "naive_attention.cuh"
