"""Kernel configuration facts shared by the planner, the kernels, the tuner and the AOT build."""

# Row-block sizes of the masked implicit GEMM kernels. The planner builds valid_kernel /
# valid_kernel_seg for each, so every masked-kernel config must take its BLOCK_N from here.
PLAN_BLOCK_SIZES = (16, 32, 64, 128)
