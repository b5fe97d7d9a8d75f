"""Which launched variants came from a bundle and which were compiled (flexplan/aot/served.py):
the runtime's JIT hook notes each, the doctor's --workload report lists them, and without a GPU
--workload says it needs one. CPU only (the interpreter launches no binary): fake records."""
from __future__ import annotations

import json

import pytest
import torch

from flexplan.aot import served
from flexplan.aot.served import BUNDLE, COMPILED, DIRECT, Served


def test_report_counts_sources_and_groups_compiled_variants_by_reason():
    records = [
        Served("conv_wgrad_kernel", "*fp16 BLOCK_M=64 num_warps=4 num_stages=3", BUNDLE),
        Served("conv_wgrad_kernel", "*fp16 BLOCK_M=32 num_warps=4 num_stages=3", DIRECT),
        Served("conv_gather_gemm_kernel", "*fp16 BLOCK_M=128", DIRECT),
        Served("conv_gather_gemm_kernel", "*fp32 BLOCK_M=16", COMPILED,
               "this specialization / target was not built (sm_90, Triton 3.6.0)"),
        Served("hash_insert_kernel", "- V=1", COMPILED, "no installed bundle has this kernel"),
    ]
    lines = served.report_lines(records)
    assert lines[0] == "launched: 5 kernel variants, 3 from bundles, 2 compiled"
    assert lines[1:5] == [
        "compiled (no installed bundle has this kernel):",
        "  hash_insert_kernel - V=1",
        "compiled (this specialization / target was not built (sm_90, Triton 3.6.0)):",
        "  conv_gather_gemm_kernel *fp32 BLOCK_M=16"]
    assert lines[5] == "from bundles, launched through Triton's launcher: conv_wgrad_kernel x1"
    assert lines[6] == ("from bundles, launched through the CUDA driver API: "
                        "conv_gather_gemm_kernel x1, conv_wgrad_kernel x1")
    assert "nothing recorded" in served.report_lines([])[0]


def test_the_jit_hook_notes_a_compiled_variant_with_its_reason(tmp_path, monkeypatch):
    """Triton's pre-compile hook for a kernel no bundle has: left to the JIT and noted, with the
    feature dtype, constexprs, warps and stages that tell the variant apart."""
    from triton.backends.compiler import GPUTarget

    from flexplan.aot import runtime
    from flexplan.kernels_src.conv_wgrad import conv_wgrad_kernel

    monkeypatch.setenv("FLEXPLAN_AOT_PATH", str(tmp_path / "none"))
    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path / "cache"))
    runtime.reset()
    names = conv_wgrad_kernel.arg_names
    signature = {name: ("*fp16" if name.endswith("ptr") and "pair" not in name else
                        "*i32" if name.endswith("ptr") else "i32") for name in names}
    constants = {}
    for name, value in (("BLOCK_M", 64), ("BLOCK_N", 32), ("PRECISION", "ieee")):
        signature[name] = "constexpr"
        constants[(names.index(name),)] = value

    class Jit:  # the kernel's JITFunction as the hook reads it (this suite interprets kernels)
        fn, arg_names = conv_wgrad_kernel.fn, names
        device_caches = {"fake": ({}, None, GPUTarget("cuda", 90, 32), None, None)}

    class Hooked:  # what Triton hands the hook
        jit_function = Jit
    compile_inputs = {"device": "fake", "signature": signature, "constants": constants,
                      "configs": [{}],
                      "specialization_data": json.dumps({"options": {"num_warps": 4, "num_stages": 3}})}
    try:
        assert runtime._jit_cache_hook(key="k", repr="r", fn=Hooked, compile=compile_inputs,
                                       is_manual_warmup=False, already_compiled=False) is None
        (record,) = served.records()
    finally:
        runtime.reset()
    assert record.kernel == "conv_wgrad_kernel" and record.source == COMPILED
    assert record.variant == "*fp16 BLOCK_M=64 BLOCK_N=32 PRECISION=ieee num_warps=4 num_stages=3"
    assert record.reason.startswith("no installed bundle has this kernel (sm_90, Triton ")
    assert served.records() == []  # runtime.reset forgets them


@pytest.mark.skipif(torch.cuda.is_available(), reason="what the doctor says without a GPU")
def test_workload_needs_a_gpu(capsys, monkeypatch, tmp_path):
    from flexplan.aot import doctor, runtime

    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLEXPLAN_AOT_PATH", str(tmp_path / "none"))
    try:
        assert doctor.main(["--workload", "e2e"]) == 1
    finally:
        runtime.reset()
    out = capsys.readouterr().out
    assert "workload: needs a GPU" in out
    assert (doctor._SOURCE_TREE / doctor.WORKLOADS["e2e"]).is_file()  # the script it would run
