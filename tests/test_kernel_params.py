"""The direct launcher's parameter block (flexplan.aot.kernel_params), on the CPU: which arguments
reach the kernel, as which C values, and the PTX parameter sizes they are checked against.
(Against real binaries: tests/test_aot.py; on a GPU: tests/test_aot_direct_gpu.py.)"""
from __future__ import annotations

import ctypes

import pytest
import torch

from flexplan.aot.kernel_params import ParamBlock, Unsupported, kernel_params, param_bytes, ptx_param_bytes

SIGNATURE = {"x_ptr": "*fp16", "n": "i32", "BLOCK": "constexpr", "one": "constexpr", "offset": "i64",
             "scale": "fp32", "half": "fp16", "brain": "bf16", "flag": "i1", "out_ptr": "*i32"}


def _packed(signature: dict, args: list, scratch: tuple[int, int]) -> list[int]:
    """The bytes each void* of the packed block points to, as unsigned ints of the parameter's
    size (what the kernel receives)."""
    params = kernel_params(signature)
    block = ParamBlock(params)  # owns the slots the pointers point at
    pointers = block.pack(args, scratch)
    return [int.from_bytes(ctypes.string_at(address, size), "little")
            for address, size in zip(pointers, param_bytes(params), strict=True)]


def test_constexprs_are_dropped_and_scratch_pointers_appended():
    params = kernel_params(SIGNATURE)
    names = list(SIGNATURE)
    assert [names[p.index] for p in params] == ["x_ptr", "n", "offset", "scale", "half", "brain", "flag", "out_ptr"]
    assert param_bytes(params) == [8, 4, 8, 4, 2, 2, 1, 8, 8, 8]


def test_pack_passes_triton_3_6_c_values():
    x, out = torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.int32)
    args = [x, 7, 64, 1, -3, 0.5, 1.0, 1.0, True, out]
    got = _packed(SIGNATURE, args, (0, 0))
    assert got == [x.data_ptr(), 7, (-3) % 2**64, 0x3F000000, 0x3C00, 0x3F80, 1, out.data_ptr(), 0, 0]


def test_bf16_truncates_like_triton():
    # 1 + 2**-8 + 2**-9 rounds up to 1 + 2**-7 in bf16, but Triton 3.6's pack_bf16 truncates.
    assert _packed({"b": "bf16"}, [1 + 2**-8 + 2**-9], (0, 0))[0] == 0x3F80


def test_scratch_pointers_and_null_pointer():
    assert _packed({"p": "*fp32"}, [None], (0x1000, 0x2000)) == [0, 0x1000, 0x2000]


def test_a_block_packs_each_call_anew():
    block = ParamBlock(kernel_params({"n": "i32", "p": "*i32"}))
    first = list(block.pack([5, 0x10], (0, 0)))
    assert list(block.pack([-1, 0x20], (1, 2))) == first  # same slots, new values
    got = [int.from_bytes(ctypes.string_at(a, s), "little") for a, s in zip(first, (4, 8, 8, 8))]
    assert got == [2**32 - 1, 0x20, 1, 2]


@pytest.mark.parametrize("ty", [("*fp32", "i32"), "tensordesc<fp16[64, 64]>", "nvTmaDesc"])
def test_tuples_and_tensor_descriptors_are_left_to_triton(ty):
    with pytest.raises(Unsupported):
        kernel_params({"a": "i32", "b": ty})


PTX = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u32 k_param_1,
	.param .align 64 .b8 k_param_2[128],
	.param .f32 k_param_3,
	.param .u8 k_param_4
)
.maxntid 128, 1, 1
{
	ret;
}
.visible .entry k2(
	.param .u64 k2_param_0
)
"""


def test_ptx_param_bytes():
    assert ptx_param_bytes(PTX, "k") == [8, 4, 128, 4, 1]
    assert ptx_param_bytes(PTX, "k2") == [8]
    with pytest.raises(ValueError):
        ptx_param_bytes(PTX, "missing")
