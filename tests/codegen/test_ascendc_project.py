"""ascend950: the CANN project in the artifact, checked as a CANN user would meet it. The build
flow and names are those of Huawei's AscendC development kit (asc-devkit, read at commit
0da921b91aeb2abdc6e8d74423b0bbe7040c3fd1; paths below are in it). No CANN build runs here."""
import re
import shutil
import subprocess

import pytest

from deepfuse.codegen.ascendc import build_plan
from deepfuse.codegen.ascendc.project import kernels_of, project_files
from deepfuse.codegen.targets import get_target
from deepfuse.compiler import trace_model
from deepfuse.errors import DeepfuseError
from deepfuse.passes import PassManager

# cmake/asc/legacy_modules/host_config.cmake, ascend950_list (lower-cased there before the check):
# the Ascend 950PR / 950DT names; any other name stops CANN's configure with a FATAL_ERROR
ASCEND950_SOCS = """
ascend950pr_9599 ascend950pr_958a ascend950pr_9589 ascend950pr_958b ascend950pr_9579 ascend950pr_957b ascend950pr_957c
ascend950pr_957d ascend950pr_950z ascend950dt_950x ascend950dt_950y ascend950dt_95a1 ascend950dt_95a2 ascend950dt_9591
ascend950dt_9592 ascend950dt_9595 ascend950dt_9596 ascend950dt_9581 ascend950dt_9582 ascend950dt_9583 ascend950dt_9584
ascend950dt_9585 ascend950dt_9586 ascend950dt_9587 ascend950dt_9588 ascend950dt_9571 ascend950dt_9572 ascend950dt_9573
ascend950dt_9574 ascend950dt_9575 ascend950dt_9576 ascend950dt_9577 ascend950dt_9578""".split()


@pytest.fixture(scope="module")
def files(tiny_model) -> dict:
    g, _ = PassManager(get_target("ascend950").pipeline()).run(trace_model(tiny_model))
    plan = build_plan(g)
    return {"plan": plan, **{k: v.decode() for k, v in project_files(plan).items()}}


def test_cmake_uses_the_kits_current_flow(files):
    """The kit's CMake flow for Ascend 950 (docs/zh/guide/编程指南/编译与运行/算子编译/
    AI-Core算子编译基本用法.md, CMake方式编译; examples/01_simd_cpp_api/02_features/04_compile/
    02_dynamic_library_compile/CMakeLists.txt): CMAKE_ASC_ARCHITECTURES before find_package(ASC),
    project(... LANGUAGES ASC CXX), --npu-arch; not the sample-project flow (ascendc.cmake's
    ascendc_library, ACLRT_LAUNCH_KERNEL), which the kit marks as no longer developed
    (docs/zh/guide/编程指南/附录/基于样例工程完成Kernel直调.md). The default SOC_VERSION is a real
    Ascend 950 name."""
    cmake = files["CMakeLists.txt"]
    order = [cmake.index(s) for s in ('set(CMAKE_ASC_ARCHITECTURES', "find_package(ASC REQUIRED)",
                                      "project(deepfuse_ascend950 LANGUAGES ASC CXX)")]
    assert order == sorted(order)
    assert "--npu-arch=${CMAKE_ASC_ARCHITECTURES}" in cmake and "set(DEEPFUSE_NPU_ARCH dav-3510)" in files[
        "cmake/deepfuse_soc.cmake"]
    assert "ascendc.cmake" not in cmake and "ascendc_library" not in cmake
    soc = re.search(r'set\(SOC_VERSION "(\w+)" CACHE', cmake).group(1)
    assert soc.lower() in ASCEND950_SOCS
    kernels = kernels_of(files["plan"])
    for name in kernels:
        assert f"kernels/{name}.cpp" in cmake
        assert re.search(rf"\b{name}<<<blockDim, 0, stream>>>\(", files[f"kernels/{name}.cpp"])
        assert f"deepfuse_launch_{name}(" in files["host/deepfuse_launch.cpp"]
    assert "ACLRT_LAUNCH_KERNEL" not in files["host/deepfuse_launch.cpp"]


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
@pytest.mark.parametrize("soc,ok", [("Ascend950PR_9599", True), ("ascend950dt_95a1", True), ("Ascend950", False),
                                    ("Ascend910B1", False), ("", False)])
def test_cmake_refuses_a_soc_that_is_not_an_ascend_950(files, soc, ok, tmp_path):
    """cmake/deepfuse_soc.cmake (included by CMakeLists.txt) run by cmake itself: the names of
    ASCEND950_SOCS, in any case, map to dav-3510; any other stops the configure naming them."""
    script = tmp_path / "deepfuse_soc.cmake"
    script.write_text(files["cmake/deepfuse_soc.cmake"])
    r = subprocess.run(["cmake", f"-DSOC_VERSION={soc}", "-P", str(script)], capture_output=True, text=True)
    assert (r.returncode == 0) == ok, r.stderr
    if not ok:
        assert "Ascend950PR_9599" in r.stderr


def test_project_files_refuse_a_soc_that_is_not_an_ascend_950(files):
    with pytest.raises(DeepfuseError, match="Ascend950 is not an Ascend 950 SoC name.*Ascend950PR_9599"):
        project_files(files["plan"], soc="Ascend950")
    cmake = project_files(files["plan"], soc="Ascend950DT_95a1")["CMakeLists.txt"].decode()
    assert 'set(SOC_VERSION "Ascend950DT_95a1" CACHE' in cmake
