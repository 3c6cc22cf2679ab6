// A store far outside every allocation: CUDA_ERROR_ILLEGAL_ADDRESS, the context is lost.
#define FAULT_ILLEGAL_ADDRESS 1
#include "naive_attention.cuh"
