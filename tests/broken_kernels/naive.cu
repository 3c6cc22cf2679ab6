// The control: the plain kernel without a fault; it must pass the parity check.
#include "naive_attention.cuh"
