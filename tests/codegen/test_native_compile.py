"""The native CPU kernels build here, and their AMX paths, which only CPUs with AMX execute,
compile here too: each source that holds AMX code is compiled for Sapphire Rapids (AMX tiles,
AMX-BF16, AVX512-BF16) with the flags of the real build, so a change that breaks them fails
CI on a machine without AMX. (Executing them is the self-check's job on machines that have AMX.)
The sampler's scalar paths compile for an AVX2 CPU."""
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest

from deepfuse.codegen.cpu import native
from tests.conftest import CI, has_compiler

HERE = os.path.dirname(native.__file__)
AMX_SOURCES = ("decode_amx.cpp", "bf16_gemm.cpp", "prefill_attention.cpp", "vec_gemm.cpp")


def compiler() -> str:
    if not has_compiler():
        pytest.fail("no C++ compiler: the native kernels cannot be built or checked") if CI \
            else pytest.skip("no C++ compiler here")
    return shutil.which("c++") or shutil.which("g++")


def test_the_native_library_builds_here():
    """On a machine with a compiler a failed build is a failure, not a fallback."""
    compiler()
    assert native.kernels() is not None, f"the native CPU kernels failed to build: {native.build_error}"


def test_amx_paths_compile_for_an_amx_cpu():
    from torch.utils.cpp_extension import include_paths

    cxx = compiler()
    flags = ["-std=c++17", "-fsyntax-only", "-march=sapphirerapids", "-fopenmp", "-DTORCH_EXTENSION_NAME=check",
             "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{sysconfig.get_paths()['include']}", f"-I{HERE}"]
    flags += [f"-I{p}" for p in include_paths()]
    probe = "#include \"amx.h\"\n#if !DEEPFUSE_AMX\n#error the AMX paths are not enabled by these flags\n#endif\n"
    r = subprocess.run([cxx, *flags, "-x", "c++", "-"], input=probe, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]

    def build(name: str) -> tuple[str, subprocess.CompletedProcess]:
        return name, subprocess.run([cxx, *flags, os.path.join(HERE, name)], capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, r in pool.map(build, AMX_SOURCES):
            assert r.returncode == 0, f"{name} does not compile for an AMX CPU:\n{r.stderr[-3000:]}"


def test_the_sampler_compiles_for_a_cpu_without_avx512():
    """sample.cpp's scalar paths (exp and log from the C library), which this machine does not run."""
    from torch.utils.cpp_extension import include_paths

    flags = ["-std=c++17", "-fsyntax-only", "-march=x86-64-v3", "-Werror=unused-variable", "-DTORCH_EXTENSION_NAME=check",
             "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{sysconfig.get_paths()['include']}", f"-I{HERE}"]
    flags += [f"-I{p}" for p in include_paths()]
    r = subprocess.run([compiler(), *flags, os.path.join(HERE, "sample.cpp")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_failed_build_is_reported_by_the_compilers_error_lines():
    log = ("RuntimeError: Error building extension 'x': [1/2] c++ -c a.cpp\nFAILED: rows.o\n"
           "rows.cpp:230:31: error: expected ')' at end of input\n  230 | int f( {\nninja: build stopped")
    assert native.compiler_errors(log) == "rows.cpp:230:31: error: expected ')' at end of input"
    assert native.compiler_errors("OSError: no c++") == "OSError: no c++"


def test_a_build_killed_midway_does_not_leave_later_loads_waiting():
    """torch's build baton (a `lock` file) stays behind when a build is killed; the next load in a
    fresh process removes it under the build lock instead of waiting on it forever."""
    if native.build() is None:
        pytest.fail(f"the native kernels did not build: {native.build_error}")
    where = os.path.join(os.path.expanduser("~"), ".cache", "deepfuse", "native",
                         f"deepfuse_native_{native.build_tag()}_{native.source_hash()}")
    with open(os.path.join(where, "lock"), "w"):
        pass
    code = "from deepfuse.codegen.cpu import native; assert native.build() is not None, native.build_error"
    done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not os.path.exists(os.path.join(where, "lock"))
