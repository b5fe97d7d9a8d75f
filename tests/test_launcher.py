"""flexplan.launcher's repeat path: a call whose arguments fall in a class seen before skips
Triton's binder. On the CPU: the classes and the constexpr tail; on a GPU: launches of every
class compute the right thing, and profilers' hooks still see launches."""
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from flexplan import launcher


def _add_one(src, dst, n, scale, BLOCK: tl.constexpr, TWICE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n) * scale + 1
    if TWICE:
        x = x + 1
    tl.store(dst + offs, x, mask=offs < n)


def _constexpr_first(BLOCK: tl.constexpr, src):
    pass


def _one_arg(a):
    pass


def test_call_classes_separate_what_triton_specializes_on():
    t = torch.zeros(8, dtype=torch.float32)
    kernel = JITFunction(_one_arg)

    def cls(arg, **constexprs):
        return launcher._call_key(kernel, 0, (arg,), constexprs)

    assert cls(t) != cls(t[1:])                  # 16-byte alignment
    assert cls(t) != cls(t.to(torch.float16))    # dtype
    assert len({cls(1), cls(2), cls(16), cls(2**31), cls(2**63)}) == 5  # value 1, % 16, width
    assert cls(2) == cls(3) and cls(16) == cls(32)
    assert cls(True) != cls(False) and cls(True) != cls(1)
    assert cls(1, BLOCK=64) != cls(1, BLOCK=128)
    assert launcher._call_key(kernel, 0, (t,), {}) != launcher._call_key(JITFunction(_one_arg), 0, (t,), {})
    assert cls(0.5) == cls(1e-3) != cls(1) and cls("x") is None  # floats: fp32, any value


def test_call_class_keeps_tensors_off_the_gpu():
    """Arguments go to Triton's launcher as addresses only when every tensor is a GPU tensor:
    a CPU tensor stays a tensor (Triton's launcher then raises its own error, not a kernel
    reading a host address). The class is the same either way."""
    t = torch.zeros(8)
    kernel = JITFunction(_add_one)
    args = (t, t, 8, 2.0)
    key, addressed = launcher._call_class(kernel, 0, args, {"BLOCK": 8})
    assert addressed is args and key == launcher._call_key(kernel, 0, args, {"BLOCK": 8})
    assert launcher._call_class(kernel, 0, (t, "x", 8, 2.0), {}) == (None, (t, "x", 8, 2.0))


@pytest.mark.parametrize("option", ["do_not_specialize", "do_not_specialize_on_alignment"])
def test_call_classes_leave_out_what_the_decorator_does_not_specialize(option):
    """As Triton (3.6 and 3.9): do_not_specialize keeps an int's width and a tensor's dtype only;
    do_not_specialize_on_alignment drops divisibility by 16 and alignment, keeps value 1."""
    t = torch.zeros(8, dtype=torch.float32)
    kernel = JITFunction(_one_arg, **{option: ["a"]})
    expected = (launcher.NOT_SPECIALIZED if option == "do_not_specialize"
                else launcher.NO_ALIGNMENT)
    assert launcher.arg_specialization(kernel) == (expected,)

    def cls(arg):
        return launcher._call_key(kernel, 0, (arg,), {})

    assert cls(t) == cls(t[1:]) and cls(t) != cls(t.to(torch.float16))
    assert cls(2) == cls(3) == cls(16) and cls(16) != cls(2**31)
    assert (cls(1) == cls(2)) == (option == "do_not_specialize")
    # The launcher's classes never split what Triton's binder joins, nor join what it splits.
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params,
                                            make_backend(GPUTarget("cuda", 90, 32)))
    values = [1, 2, 3, 16, 32, 2**31, 2**31 + 16, t, t[1:], t[4:], t.to(torch.float16)]
    for a in values:
        for b in values:
            same_class = type(a) is type(b) and cls(a) == cls(b)
            assert same_class == (binder(a)[1] == binder(b)[1] and type(a) is type(b)), (a, b)


def test_constexpr_tail_follows_the_parameters():
    fn = JITFunction(_add_one)
    t = torch.zeros(4)
    assert launcher._constexpr_tail(fn, (t, t, 4, 2), {"BLOCK": 64}) == (64, False)
    assert launcher._constexpr_tail(fn, (t, t, 4, 2), {"BLOCK": 64, "TWICE": True,
                                                       "num_warps": 2}) == (64, True)
    assert launcher._constexpr_tail(fn, (t, t, 4, 2), {}) is None          # BLOCK missing
    assert launcher._constexpr_tail(fn, (t, t, 4), {"BLOCK": 64}) is None  # runtime arg after
    assert launcher._constexpr_tail(JITFunction(_constexpr_first), (64, t), {}) is None


class CudaLauncher:
    """Stands in for Triton's launcher of one compiled kernel: records how it is called."""

    def __init__(self, scratch: int):
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.calls = []
        self.launch = lambda *args: self.calls.append(("c", args))

    def __call__(self, *args):
        self.calls.append(("python", args))


class _Compiled:
    def __init__(self, scratch: int):
        self.run, self.function, self.packed_metadata = CudaLauncher(scratch), "fn", "meta"


@pytest.mark.parametrize("scratch_free_launcher", [False, True])
@pytest.mark.parametrize("scratch", [0, 256])
def test_repeat_launches_call_tritons_launcher_as_it_expects(monkeypatch, scratch_free_launcher, scratch):
    """Triton 3.6 without scratch: its C launcher directly (grid, stream, function, cooperative,
    pdl, no scratch, metadata, no hooks, arguments); otherwise CudaLauncher.__call__."""
    monkeypatch.setattr(launcher, "_SCRATCH_FREE_CUDA_LAUNCHER", scratch_free_launcher)
    compiled = _Compiled(scratch)
    launcher._triton_run(compiled)((5,), 7, ("a", 3))
    if scratch_free_launcher and not scratch:
        expected = ("c", (5, 1, 1, 7, "fn", False, True, None, None, "meta", None, None, None, "a", 3))
    else:
        expected = ("python", (5, 1, 1, 7, "fn", "meta", None, None, None, "a", 3))
    assert compiled.run.calls == [expected]


@pytest.mark.gpu
def test_repeated_launches_of_every_class_compute_the_right_thing():
    kernel = triton.jit(_add_one)
    base = torch.randn(1000, device="cuda")
    launcher.forget_calls()
    for _ in range(2):  # the second round takes the repeat path
        for offset, n, scale, twice in ((0, 1000, 2.0, False), (1, 999, 3.0, False),
                                        (0, 16, 2.0, True), (3, 1, 1.0, False)):
            src = base[offset:offset + n]
            dst = torch.empty_like(src)
            launcher.launch(kernel, (triton.cdiv(n, 128),), src, dst, n, scale, BLOCK=128,
                            TWICE=twice)
            torch.testing.assert_close(dst, src * scale + 1 + twice)
    src = base[1:]
    key, addressed = launcher._call_class(kernel, 0, (src, src, 999, 2.0), {"BLOCK": 128})
    assert addressed == (src.data_ptr(), src.data_ptr(), 999, 2.0)  # what the launcher gets
    # One class per call above (alignment, the size's class, TWICE); a float scale any value.
    assert len([key for key in launcher._calls if key[0] == id(kernel)]) == 4
    launcher.launch(kernel, (8,), base, base.clone(), 1000, 1, BLOCK=128)  # an int scale
    launcher.launch(kernel, (8,), base[1:], base.clone()[1:], 999, 1, BLOCK=128)
    assert len([key for key in launcher._calls if key[0] == id(kernel)]) == 6


@pytest.mark.gpu
def test_native_launches_compute_what_tritons_launcher_does():
    """Where the native launcher is built (flexplan/launch_native.py), repeated launches go
    through it (records made) and compute the same as the Python path; a list grid and a
    switched-off native path take the Python path."""
    from flexplan import launch_native

    if launch_native.module() is None:
        pytest.skip(f"native launcher unavailable: {launch_native.why_not}")
    kernel = triton.jit(_add_one)
    base = torch.randn(1000, device="cuda")
    launcher.forget_calls()
    for native in (True, False, True):
        launcher.NATIVE_LAUNCHES = native
        try:
            for offset, n, scale, twice, grid in ((0, 1000, 2.0, False, (8,)),
                                                  (1, 999, 3.0, True, [8]),
                                                  (3, 17, 1, False, (1, 1))):
                src = base[offset:offset + n]
                for _ in range(2):
                    dst = torch.zeros_like(src)
                    launcher.launch(kernel, grid, src, dst, n, scale, BLOCK=128, TWICE=twice)
                    torch.testing.assert_close(dst, src * scale + 1 + twice)
        finally:
            launcher.NATIVE_LAUNCHES = True
    assert any(key[0] == id(kernel) for key in launcher._native_calls)


@pytest.mark.gpu
def test_launch_hooks_see_repeated_launches():
    kernel = triton.jit(_add_one)
    src = torch.randn(256, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(2):
        launcher.launch(kernel, (2,), src, dst, 256, 1, BLOCK=128)
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        launcher.launch(kernel, (2,), src, dst, 256, 1, BLOCK=128)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(seen) == 1


def _mixed(t, u, n, m, flag, scale, v, BLOCK: tl.constexpr):
    pass


def test_generated_call_classes_equal_the_generic_ones():
    """The class function generated from a first call (launcher._class_function) gives the
    generic classes for every later call: ints around 1, 16 and the widths, tensors aligned or
    not and of other dtypes; calls of other kinds (an int where a tensor was, a bool where an
    int was) take the generic path and get its answer too."""
    kernel = JITFunction(_mixed, do_not_specialize=["m"], do_not_specialize_on_alignment=["u", "v"])
    t = torch.zeros(64)
    first = (t, t, 16, 3, True, 0.5, 7)
    assert launcher._class_function(kernel, first) is not None
    cases = [first]
    for n in (1, 2, 16, 17, 2**31, -1, -2**31 - 1, 2**63):
        for m in (1, 16, 2**40):
            cases.append((t[1:], t, n, m, False, 2.0, 1))
            cases.append((t, t[2:].to(torch.float16), n, m, True, 1e-3, 32))
    cases += [(3, t, 16, 3, True, 0.5, 7), (t, t, True, 3, True, 0.5, 7),
              (t, t, 16, 3, 1, 0.5, 7), (t, t, 16, 3, True, 1, 7), (t, None, 16, 3, True, 0.5, 7)]
    launcher._call_key(kernel, 0, first, {"BLOCK": 8})  # generates it
    assert launcher._class_fns[(id(kernel), len(first))][1] is not None
    for args in cases:
        for constexprs in ({"BLOCK": 8}, {}):
            assert (launcher._call_class(kernel, 0, args, constexprs)
                    == launcher._generic_call_class(kernel, 0, args, constexprs)), args


class _OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on GPU `index` (the address path, without a GPU)."""
    index = 0

    def get_device(self):
        return self.index


class _OnOtherDevice(_OnDevice):
    index = 1


def test_call_class_hands_addresses_only_for_tensors_on_the_current_gpu():
    """The arguments the launcher gets: every tensor's address when all are on the current GPU
    (generated and generic paths alike), the tensors themselves when one is elsewhere."""
    kernel = JITFunction(_add_one)
    t = torch.zeros(64)
    here, there = t.as_subclass(_OnDevice), t[4:].as_subclass(_OnOtherDevice)
    for call_class in (launcher._call_class, launcher._generic_call_class):
        key, addressed = call_class(kernel, 0, (here, here[1:], 8, 2.0), {"BLOCK": 8})
        assert addressed == (t.data_ptr(), t.data_ptr() + 4, 8, 2.0) and key is not None
        args = (here, there, 8, 2.0)
        assert call_class(kernel, 0, args, {"BLOCK": 8})[1] is args
        assert call_class(kernel, 1, (here, here, 8, 2.0), {})[1] == (here, here, 8, 2.0)


def _native_or_skip():
    from flexplan import launch_native

    native = launch_native.module(driver=False)
    if native is None:
        pytest.skip(f"native launcher not built: {launch_native.why_not}")
    return native


def test_native_call_classes_equal_the_generic_ones():
    """The C class (flexplan/launch_native.py) of every call equals launcher's generic one, or
    is None exactly where the C path steps aside (an int past 64 bits, an argument of another
    kind, a tensor off the given device): the Python path then launches."""
    native = _native_or_skip()
    kernel = JITFunction(_mixed, do_not_specialize=["m"], do_not_specialize_on_alignment=["u", "v"])
    spec = bytes(launcher.arg_specialization(kernel))
    t = torch.zeros(64)
    cases = []
    for n in (1, 2, 15, 16, 17, 2**31 - 1, 2**31, 2**32, -1, -16, -2**31, -2**31 - 1, 2**62):
        for m in (1, 16, 2**40):
            cases.append((t[1:], t, n, m, False, 2.0, 1))
            cases.append((t, t[2:].to(torch.float16), n, m, True, 1e-3, 32))
            cases.append((t[4:].to(torch.bfloat16), t[3:], m, n, n == 1, -0.0, 0))
    for args in cases:
        for constexprs in ({"BLOCK": 8}, {}, {"BLOCK": 8, "TWICE": True}):
            got = native.call_class(id(kernel), spec, -1, args, constexprs)  # CPU tensors: -1
            assert got == launcher._generic_call_class(kernel, -1, args, constexprs)[0], args
            assert native.call_class(id(kernel), spec, 0, args, constexprs) is None  # off GPU 0
    here = t.as_subclass(_OnDevice)
    args = (here, here[1:], 16, 3, True, 0.5, 7)
    assert native.call_class(id(kernel), spec, 0, args, {}) == launcher._generic_call_class(
        kernel, 0, args, {})[0]
    for other in ((t, t, 2**63, 3, True, 0.5, 7), (t, None, 16, 3, True, 0.5, 7),
                  (t, t, 16, 3, True, 0.5, "7"), (here, t.as_subclass(_OnOtherDevice), 16, 3,
                                                  True, 0.5, 7)):
        assert native.call_class(id(kernel), spec, 0, other, {}) is None, other


def test_native_records_follow_the_signature():
    """A binary's record skips constexprs (and ints Triton specialized to 1), takes pointers
    and scalars in argument order, and refuses what it cannot pack as Triton does."""
    from types import SimpleNamespace

    from flexplan import launch_native

    native = _native_or_skip()
    seen = []
    recorder = SimpleNamespace(record=lambda *a: seen.append(a) or "record")

    def compiled(signature, **meta):
        run = SimpleNamespace(global_scratch_size=0, profile_scratch_size=0,
                              launch_cooperative_grid=False, launch_pdl=False)
        metadata = SimpleNamespace(num_warps=4, shared=1024, num_ctas=1, cluster_dims=(1, 1, 1))
        for name, value in meta.items():
            setattr(run if hasattr(run, name) else metadata, name, value)
        return SimpleNamespace(run=run, metadata=metadata, function=1234,
                               src=SimpleNamespace(signature=signature))

    sig = {"src": "*fp32", "dst": "*fp16", "n": "i32", "m": "constexpr", "scale": "fp32",
           "flag": "i1", "big": "i64", "BLOCK": "constexpr"}
    assert launch_native.record_of(recorder, compiled(sig)) == "record"
    assert seen == [(1234, 128, 1024, (0, 1, 2, 4, 5, 6), b"ppifbq")]
    for bad in (compiled(sig, num_ctas=2), compiled(sig, launch_pdl=True),
                compiled(sig, global_scratch_size=64), compiled(sig, cluster_dims=(2, 1, 1)),
                compiled({**sig, "half": "fp16"}), compiled({**sig, "desc": "nvTmaDesc"})):
        assert launch_native.record_of(recorder, bad) is None
    assert native.record(1234, 128, 0, (0, 2), b"pi") is not None


def test_native_library_is_kept_and_only_loaded_where_trusted(tmp_path, monkeypatch):
    """The native launcher's library is built into flexplan's cache and loaded from there by
    later processes; a process that may not compile (bundle-served: build=False) loads it only
    where it exists, and nothing is loaded from a directory other users can write."""
    import os
    import shutil
    import stat
    import subprocess
    import sys

    from flexplan import launch_native

    def fresh_process():
        monkeypatch.setattr(launch_native, "_module", launch_native._UNKNOWN)
        monkeypatch.setattr(launch_native, "why_not", None)
        monkeypatch.setattr(launch_native, "_tried_building", False)

    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(tmp_path))
    fresh_process()
    assert launch_native.module(driver=False, build=False) is None
    assert launch_native.why_not == launch_native._NOT_BUILT
    if shutil.which(os.environ.get("CC") or "cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    os.umask(old_umask := os.umask(0o002))  # (as desktop Linux sets it: group-writable files)
    try:
        built = launch_native.module(driver=False)  # asked with build=True: built now
    finally:
        os.umask(old_umask)
    assert built is not None, launch_native.why_not
    path = launch_native.library_path()
    assert path.is_file() and path.parent == tmp_path / "native"
    fresh_process()
    again = launch_native.module(driver=False, build=False)  # kept where it is trusted
    assert again is not None and os.path.samefile(again.__file__, path), launch_native.why_not
    kernel = JITFunction(_one_arg)
    assert again.call_class(id(kernel), bytes(launcher.arg_specialization(kernel)), -1, (16,),
                            {}) == launcher._generic_call_class(kernel, -1, (16,), {})[0]
    os.chmod(path.parent, os.stat(path.parent).st_mode | stat.S_IWOTH)
    try:
        fresh_process()
        assert launch_native.module(driver=False, build=False) is None
        assert "other users can write it" in launch_native.why_not
    finally:
        os.chmod(path.parent, stat.S_IMODE(os.stat(path.parent).st_mode) & ~stat.S_IWOTH)
    # A damaged library (a new file: the loaded one stays mapped intact; new processes, since
    # this one keeps the extension it loaded from that path): not loaded, rebuilt where allowed.
    damaged = path.with_name("damaged")
    damaged.write_bytes(b"not a library")
    os.replace(damaged, path)
    probe = ("from flexplan import launch_native as n; a = n.module(driver=False, build=False); "
             "print(a is None, n.why_not); print(n.module(driver=False) is not None, n.why_not)")
    again = ("from flexplan import launch_native as n; "
             "print(n.module(driver=False, build=False) is not None, n.why_not)")
    env = dict(os.environ, FLEXPLAN_CACHE_DIR=str(tmp_path))
    first = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                           text=True, timeout=300)
    lines = first.stdout.splitlines()
    assert first.returncode == 0 and len(lines) == 2, first.stdout + first.stderr
    assert lines[0].startswith("True") and "does not load" in lines[0], lines
    assert lines[1].startswith("True"), lines
    second = subprocess.run([sys.executable, "-c", again], env=env, capture_output=True,
                            text=True, timeout=300)
    assert second.stdout.startswith("True"), second.stdout + second.stderr


def test_native_library_still_serves_where_the_cache_cannot_keep_it(tmp_path, monkeypatch):
    """A cache root that cannot be written (here a file) keeps the library from the next
    process, not this process's native launches."""
    import shutil as _shutil

    from flexplan import launch_native

    if _shutil.which("cc") is None and _shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    blocked = tmp_path / "afile"
    blocked.write_text("")
    monkeypatch.setenv("FLEXPLAN_CACHE_DIR", str(blocked))
    monkeypatch.setattr(launch_native, "_module", launch_native._UNKNOWN)
    monkeypatch.setattr(launch_native, "why_not", None)
    monkeypatch.setattr(launch_native, "_tried_building", False)
    assert launch_native.module(driver=False) is not None, launch_native.why_not


def test_native_records_of_bundle_binaries_follow_their_parameter_block():
    """A bundle binary's record (launch_native.direct_record_of) takes the parameters in the
    order and C storage the direct launch packs them (kernel_params), and refuses binaries whose
    launch is not plain (scratch, clusters, cooperative or PDL launches, 16-bit scalars)."""
    from ctypes import c_void_p
    from types import SimpleNamespace

    from flexplan import launch_native

    seen = []
    recorder = SimpleNamespace(record=lambda *a: seen.append(a) or "record")

    def binary(signature, scratch=(), num_ctas=1, **meta):
        cuda = SimpleNamespace(function=c_void_p(4321), threads=256, shared=2048,
                               num_ctas=num_ctas)
        metadata = {"launch_cooperative_grid": False, "launch_pdl": False, **meta}
        return SimpleNamespace(cuda=cuda, metadata=metadata, signature=signature,
                               scratch_kinds=list(scratch))

    sig = {"src": "*fp32", "dst": "*fp16", "n": "i32", "m": "constexpr", "scale": "fp32",
           "flag": "i1", "big": "i64", "u": "u32", "BLOCK": "constexpr"}
    assert launch_native.direct_record_of(recorder, binary(sig)) == "record"
    assert seen == [(4321, 256, 2048, (0, 1, 2, 4, 5, 6, 7), b"ppifbqI")]
    for bad in (binary(sig, scratch=("global",)), binary(sig, num_ctas=2),
                binary(sig, launch_cooperative_grid=True), binary(sig, launch_pdl=True),
                binary({**sig, "half": "fp16"}), binary({**sig, "b": "bf16"})):
        assert launch_native.direct_record_of(recorder, bad) is None
