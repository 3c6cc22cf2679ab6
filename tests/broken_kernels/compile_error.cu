// A typo that nvcc rejects: an identifier that is declared nowhere.
#include "naive_attention.cuh"

__device__ float misspelt() { return undeclared_value; }
