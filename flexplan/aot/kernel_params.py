"""The parameter block of a Triton kernel launch on CUDA, exactly as Triton 3.6's generated host
launcher builds it (triton/backends/nvidia/driver.py: make_launcher, ty_to_cpp, pack_fp16/bf16):
one C value per argument whose signature type is not "constexpr" (constexprs and the ints and
Nones the JIT specialized away are compiled into the binary), in argument order, then two
pointers Triton appends to every kernel, global scratch and profile scratch.

Pure (no CUDA): the layout is a function of the signature, checked against the parameter sizes
the build read from the kernel's PTX (`ptx_param_bytes`), so a launcher/compiler mismatch is
refused instead of launching with a wrong parameter block.
"""
from __future__ import annotations

import ctypes
import re
import struct
from dataclasses import dataclass
from typing import Callable

# C storage of each scalar signature type (Triton 3.6 ty_to_cpp, FLOAT_STORAGE_TYPE).
_STORAGE = {
    "i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32,
    "i64": ctypes.c_int64, "u1": ctypes.c_uint8, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16,
    "u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "fp16": ctypes.c_uint16, "bf16": ctypes.c_uint16,
    "fp32": ctypes.c_float, "f32": ctypes.c_float, "fp64": ctypes.c_double,
}


def _fp16_bits(value: float) -> int:
    return struct.unpack("<H", struct.pack("<e", value))[0]  # PyFloat_Pack2, as pack_fp16


def _bf16_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0] >> 16  # truncation, as pack_bf16


def _pointer(value) -> int:
    # Tensors pass data_ptr(); Triton also accepts a raw int and None (a null pointer).
    if value is None:
        return 0
    return value if isinstance(value, int) else value.data_ptr()


_ENCODE = {"fp16": _fp16_bits, "bf16": _bf16_bits}

SCRATCH_POINTERS = 2  # global_scratch, profile_scratch (CUdeviceptr each), after the arguments


class Unsupported(Exception):
    """A kernel the direct launcher does not cover; Triton's own launcher runs it."""


@dataclass(frozen=True)
class Param:
    index: int                                # position in the kernel's argument list
    ctype: type                               # C type of the value in the parameter block
    encode: Callable[[object], object] | None  # Python value -> C value, None: as is


def kernel_params(signature: dict) -> list[Param]:
    """The kernel arguments that reach the parameter block, for a compile signature {name: type}."""
    params = []
    for index, ty in enumerate(signature.values()):
        if ty == "constexpr":
            continue
        if not isinstance(ty, str):
            raise Unsupported("tuple arguments")
        if ty.startswith("*"):
            params.append(Param(index, ctypes.c_uint64, _pointer))
        elif ty in _STORAGE:
            params.append(Param(index, _STORAGE[ty], _ENCODE.get(ty)))
        else:  # tensor descriptors: Triton builds TMA descriptors on the host
            raise Unsupported(f"argument type {ty}")
    return params


def is_pointer(param: Param) -> bool:
    """Does the parameter take a pointer (a tensor's address, an int, or None)?"""
    return param.encode is _pointer


def param_bytes(params: list[Param]) -> list[int]:
    """Sizes of the parameter block's entries, scratch pointers included (compare ptx_param_bytes)."""
    return [ctypes.sizeof(p.ctype) for p in params] + [ctypes.sizeof(ctypes.c_uint64)] * SCRATCH_POINTERS


# struct codes of the C types above, for packing a whole parameter block in one call.
_CODE = {ctypes.c_int8: "b", ctypes.c_int16: "h", ctypes.c_int32: "i", ctypes.c_int64: "q",
         ctypes.c_uint8: "B", ctypes.c_uint16: "H", ctypes.c_uint32: "I", ctypes.c_uint64: "Q",
         ctypes.c_float: "f", ctypes.c_double: "d"}
_SLOT = 8  # bytes per parameter slot: every C value above fits, at its natural alignment


def struct_code(param: Param) -> str:
    """The struct module's code of the parameter's C storage ("i" int32, "Q" uint64, "f" ...)."""
    return _CODE[param.ctype]


class ParamBlock:
    """A kernel's parameter block, packed in place: one 8-byte slot per parameter in one buffer,
    filled by one struct.pack_into (C speed), and the void* array of cuLaunchKernelEx pointing at
    the slots; both made once per kernel. Not reentrant: hold a lock from pack to launch (the
    driver copies the values during the launch call)."""

    def __init__(self, params: list[Param]):
        codes = [_CODE[p.ctype] for p in params] + [_CODE[ctypes.c_uint64]] * SCRATCH_POINTERS
        self._struct = struct.Struct("<" + "".join(
            f"{code}{_SLOT - struct.calcsize(code)}x" if struct.calcsize(code) < _SLOT else code
            for code in codes))
        self._getters = [(p.index, p.encode) for p in params]
        self._buffer = ctypes.create_string_buffer(_SLOT * len(codes))
        base = ctypes.addressof(self._buffer)
        self.pointers = (ctypes.c_void_p * len(codes))(*(base + _SLOT * i for i in range(len(codes))))

    def pack(self, args: list, scratch: tuple[int, int]):
        """The void* array, its slots now holding the call's C values (args: all the bound
        arguments, in argument order; scratch: the two scratch pointers)."""
        values = [encode(args[i]) if encode else args[i] for i, encode in self._getters]
        self._struct.pack_into(self._buffer, 0, *values, *scratch)
        return self.pointers


_PTX_ENTRY = r"\.entry\s+{}\s*\((.*?)\)"
_PTX_TYPE = re.compile(r"\.[bsuf](8|16|32|64)\b")
_PTX_ARRAY = re.compile(r"\[(\d+)\]\s*$")


def ptx_param_bytes(ptx: str, name: str) -> list[int]:
    """Byte size of each `.param` of kernel `name`'s `.entry` in PTX: the binary's real ABI."""
    match = re.search(_PTX_ENTRY.format(re.escape(name)), ptx, re.S)
    if match is None:
        raise ValueError(f"no .entry {name} in the PTX")
    sizes = []
    for decl in filter(None, (d.strip() for d in match.group(1).split(","))):
        bits = int(_PTX_TYPE.search(decl).group(1))
        count = _PTX_ARRAY.search(decl)
        sizes.append(bits // 8 * (int(count.group(1)) if count else 1))
    return sizes
