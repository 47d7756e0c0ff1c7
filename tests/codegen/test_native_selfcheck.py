"""The native kernels' self-check (codegen/cpu/selfcheck.py): here every entry point that runs passes
it well inside its tolerance, in well under 2 s; an entry point that disagrees (or raises) is refused
with a warning naming it: an always-used one refuses the whole library, a gated one turns its flag
off, a failing AMX path turns AMX off; and kernels() without a compiler is None with the reason."""
import re
import time
import warnings

import pytest
import torch

from deepfuse.codegen.cpu import native, selfcheck
from tests.conftest import CI, has_compiler


@pytest.fixture(scope="module")
def module():
    """The native module itself, unchecked."""
    m = native.build()
    if m is None:
        if has_compiler() or CI:
            pytest.fail(f"the native kernels failed to build: {native.build_error}")
        pytest.skip(f"no C++ compiler here ({native.build_error})")
    return m


class Sabotaged:
    """The native module with one entry point's outputs scaled by `factor` (in place: a kernel that
    writes into `out` writes wrong values there), when `when(args, kwargs)` holds; `flags` answer
    for the module's availability flags; every call is recorded."""

    def __init__(self, m, name=None, factor=1.0, when=lambda args, kwargs: True, raises=False, **flags):
        self.m, self.name, self.factor, self.when, self.raises, self.flags = m, name, factor, when, raises, flags
        self.calls = []

    def __getattr__(self, name):
        if name in self.flags:
            return lambda: self.flags[name]
        fn = getattr(self.m, name)

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == self.name and self.raises:
                raise RuntimeError(f"{name}: broken here")
            out = fn(*args, **kwargs)
            if name == self.name and self.when(args, kwargs):
                for t in out if isinstance(out, tuple) else (out,):
                    t.mul_(self.factor)
            return out

        return call


def warned(fn):
    """(fn(), the messages of the warnings it gave)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in seen]


def one_line_naming(messages: list[str], pattern: str) -> bool:
    """Whether a warning matches pattern, every warning being one line."""
    return any(re.search(pattern, m) for m in messages) and all("\n" not in m for m in messages)


def expected_names(m) -> set[str]:
    names = {"panel_gemm", "argmax", "sample", "spec_verify", "rope_cache[f32]", "rope_cache[bf16]",
             "rope_cache[bf16,int8 cache]",
             "paged_decode[f32]", "paged_decode[bf16,amx_rows=0]", "paged_decode[bf16,amx_rows=1,window]",
             "paged_decode[bf16,amx_rows=2]", "paged_decode[f32,int8 cache,window]", "paged_decode[bf16,int8 cache]",
             "paged_decode[bf16,lone row]", "paged_decode[bf16,int8 cache,lone row]"}
    names |= {f"{op}[{t}]" for op in ("rms_norm", "add_rms_norm", "swiglu") for t in ("f32", "bf16")}
    amx = [""] + ([",amx"] if m.amx_available() else [])
    if m.bf16_gemm_available():
        names |= {f"{op}{'[amx]' if a else ''}" for op in ("bf16_gemm", "q4_gemm") for a in amx}
    if m.paged_prefill_available():
        names |= {f"paged_prefill[{c}{a}]" for c in ("bf16", "int8 cache,window") for a in amx}
    if m.i8_gemm_available():
        names |= {f"{op}[{t}]" for op in ("i8_gemm", "i8_gemm_swiglu", "i8_gemm_norm") for t in ("f32", "bf16")}
        names |= {"i8_gemm_norm[f32,res]", "i8_gemm_norm[bf16,res]"}
    if m.q4a8_gemm_available():
        names |= {"q4a8_gemm[f32]", "q4a8_gemm[bf16]"}
    return names


def test_every_entry_point_passes_here_well_inside_its_tolerance(module):
    report = selfcheck.run(module)
    assert set(report) == expected_names(module)
    # the tolerances come from the output's dtype (int8 cache rows: one quantization step), and
    # the errors found here sit well inside them: f32 ~1e-7; bf16 about one rounding of the output
    # (up to 2^-8 of a value); int8 rows at most half a step plus k's rounding to bf16
    well_inside = {1e-4: 1e-5, 1e-2: 6e-3, 1 / 127: 0.75 / 127, 0.0: 0.0}
    for name, r in report.items():
        assert r.ok and r.tol in well_inside and r.error <= well_inside[r.tol], (name, r)
    assert selfcheck.last_report() == {n: (r.error, r.tol, True) for n, r in report.items()}
    checked = native.kernels()
    assert isinstance(checked, native.CheckedKernels) and checked.refused == frozenset()
    assert set(checked.selfcheck) == set(report) and native.kernels() is checked  # once per process
    assert checked.paged_decode is module.paged_decode  # nothing between the callers and the module
    assert checked.bf16_gemm_available() == module.bf16_gemm_available()
    assert "-no-" not in native.fingerprint() and native.build_error is None


def test_the_check_takes_well_under_two_seconds(module):
    start = time.perf_counter()
    selfcheck.run(module)
    assert time.perf_counter() - start < 2.0


def test_the_check_leaves_the_global_rng_and_the_thread_count_alone(module):
    threads = torch.get_num_threads()
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    selfcheck.run(module)
    assert torch.equal(torch.rand(3), want) and torch.get_num_threads() == threads


def test_a_wrong_always_used_kernel_refuses_the_whole_library(module, monkeypatch):
    """rms_norm 0.1% off (ten times the f32 tolerance): every op must then take its torch path."""
    checked, said = warned(lambda: selfcheck.check(Sabotaged(module, "rms_norm", 1.001)))
    assert checked is None
    assert one_line_naming(said, r"^deepfuse: native kernel rms_norm\[f32\] failed its self-check on this CPU "
                           r"\(error .* > tolerance 0\.0001\); the native kernels are off")
    assert not selfcheck.last_report()["rms_norm[f32]"][2]
    # through kernels(): None, and build_error says why
    monkeypatch.setattr(native, "build_error", None)
    monkeypatch.setattr(native, "build", lambda: Sabotaged(module, "paged_decode", 1.05))
    checked, said = warned(native.kernels.__wrapped__)
    assert checked is None and one_line_naming(said, r"native kernel paged_decode\[f32\]")
    assert "paged_decode[f32]" in native.build_error and "self-check" in native.build_error


def test_a_kernel_that_raises_is_refused(module):
    checked, said = warned(lambda: selfcheck.check(Sabotaged(module, "argmax", raises=True)))
    assert checked is None and one_line_naming(said, r"native kernel argmax failed .*\(RuntimeError: argmax: broken here\)")


def test_a_wrong_gated_kernel_turns_its_flag_off_and_keeps_the_rest(module, monkeypatch):
    if not module.bf16_gemm_available():
        pytest.skip("no bf16 GEMM on this CPU")
    checked, said = warned(lambda: selfcheck.check(Sabotaged(module, "bf16_gemm", 1.05)))
    assert one_line_naming(said, r"native kernel bf16_gemm failed .* bf16_gemm_available\(\) reads False")
    amx = {"amx"} if module.amx_available() else set()  # its AMX path is wrong as well there
    assert len(said) == 1 + len(amx) and checked is not None and checked.refused == {"bf16_gemm"} | amx
    assert checked.bf16_gemm_available() is False
    assert checked.i8_gemm_available() == module.i8_gemm_available()
    assert checked.paged_prefill_available() == module.paged_prefill_available()
    x, w = torch.randn(3, 16), torch.ones(16)
    torch.testing.assert_close(checked.rms_norm(x, w, 1e-5), module.rms_norm(x, w, 1e-5))
    monkeypatch.setattr(native, "kernels", lambda: checked)
    assert native.fingerprint().endswith("-no-bf16_gemm")  # measured step times are keyed apart


def test_a_wrong_int8_gemm_turns_its_flag_off(module):
    if not module.i8_gemm_available():
        pytest.skip("no AVX512-VNNI on this CPU")
    checked, said = warned(lambda: selfcheck.check(Sabotaged(module, "i8_gemm_swiglu", 1.03)))
    assert one_line_naming(said, r"i8_gemm_swiglu\[bf16\] .* i8_gemm_available\(\) reads False")
    assert checked.refused == {"i8_gemm"} and checked.i8_gemm_available() is False


def test_a_wrong_int4_int8_gemm_turns_its_flag_off(module):
    if not module.q4a8_gemm_available():
        pytest.skip("no AVX512-VNNI on this CPU")
    checked, said = warned(lambda: selfcheck.check(Sabotaged(module, "q4a8_gemm", 1.03)))
    assert one_line_naming(said, r"q4a8_gemm\[f32\] .* q4a8_gemm_available\(\) reads False")
    assert checked.refused == {"q4a8_gemm"} and checked.q4a8_gemm_available() is False
    assert checked.i8_gemm_available() == module.i8_gemm_available()


def test_a_wrong_sampler_turns_its_flag_off_and_sampled_rows_run_the_reference(module, monkeypatch):
    from deepfuse.codegen.cpu import row_kernels
    from deepfuse.ir import OPS

    bad = Sabotaged(module, "sample", 2)
    checked, said = warned(lambda: selfcheck.check(bad))
    assert one_line_naming(said, r"sample .* sample_available\(\) reads False")
    assert checked.refused == {"sample"} and checked.sample_available() is False
    monkeypatch.setattr(row_kernels, "native_kernels", lambda: checked)
    x, t = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), torch.tensor([0.0, 0.9, 1.2])
    k, p, seeds = torch.tensor([0, 4, 0]), torch.tensor([1.0, 1.0, 0.8]), torch.tensor([1, 2, 3])
    assert row_kernels.native_sampler() is None
    bad.calls.clear()
    assert torch.equal(row_kernels.sample_rows(x, t, k, p, seeds), OPS["sample"].reference(x, t, k, p, seeds))
    greedy = torch.zeros(3)
    assert torch.equal(row_kernels.sample_rows(x, greedy, k, p, seeds), x.argmax(-1))
    assert [name for name, _, _ in bad.calls] == ["argmax"]  # never the refused sampler


def test_a_wrong_amx_path_turns_amx_off_and_the_vector_paths_run(module):
    """A module claiming AMX whose bf16_gemm is wrong only with amx=True: AMX reads False, bf16_gemm
    stays, and the wrapper's entry points with an AMX switch ask the module for their vector paths."""
    if not module.bf16_gemm_available():
        pytest.skip("no bf16 GEMM on this CPU")
    amx_requested = lambda args, kwargs: kwargs.get("amx", args[4] if len(args) > 4 else True)
    bad = Sabotaged(module, "bf16_gemm", 1.05, when=amx_requested, amx_available=True)
    checked, said = warned(lambda: selfcheck.check(bad))
    assert one_line_naming(said, r"bf16_gemm\[amx\] .* AMX tiles are off")
    assert checked.refused == {"amx"} and checked.amx_available() is False and checked.bf16_gemm_available()
    assert all(ok for name, (_, _, ok) in checked.selfcheck.items() if name != "bf16_gemm[amx]")
    bad.calls.clear()
    x, w = torch.randn(4, 32).bfloat16(), torch.randn(24, 32).bfloat16()
    y = checked.bf16_gemm(x, module.pack_vnni(w), 24)  # the caller asks for AMX (the default)
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, atol=0.05, rtol=1e-2)
    q, cache = torch.randn(1, 64).bfloat16(), torch.randn(2, 2, 16, 1, 64).bfloat16()
    checked.paged_decode(q, cache, torch.tensor([[0, 1]]), torch.tensor([20]), 1, 0, 0.125, torch.empty_like(q), 1)
    calls = {name: args for name, args, _ in bad.calls}
    assert list(calls) == ["bf16_gemm", "paged_decode"] and calls["bf16_gemm"][-1] is False
    amx_rows, invariant = calls["paged_decode"][-2:]  # AMX rows forced to 0; batch invariance as asked
    assert type(amx_rows) is int and amx_rows == 0 and invariant is False


def test_without_a_compiler_kernels_is_none_with_the_reason(monkeypatch):
    import torch.utils.cpp_extension as cpp

    def no_compiler(**kwargs):
        raise RuntimeError("g++: command not found")

    monkeypatch.setattr(cpp, "load", no_compiler)
    monkeypatch.setattr(native, "build_error", None)
    with pytest.warns(UserWarning, match="could not be built"):
        assert native.build.__wrapped__() is None
    assert native.build_error == "RuntimeError: g++: command not found"
    monkeypatch.setattr(native, "build", lambda: None)
    assert native.kernels.__wrapped__() is None
