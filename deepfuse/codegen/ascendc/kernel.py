"""What an emitted AscendC kernel is (AscendKernel: source, GM arguments, host tiling), the
Ascend 950 (arch 3510) sizes the emitters plan for, and the small expression language a
tiling field is computed in -- evaluated here for the emulator, rendered as C++ for the
artifact's host code, so both compute the same tiling.

Argument forms (one per GM_ADDR, in kernel order, before `workspace` and `tiling`):
    ["in", i] / ["out", j] / ["tmp", j]     a node input / output / per-launch scratch tensor
Tiling expressions: a number, ["shape", i, axis] (input i's size), ["tmp_shape", j, axis],
["cdiv", e, n], ["mul", e, n], ["min", e, n].
"""
from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field

UB_BYTES = 248 * 1024  # unified buffer per AI vector core
L0A_BYTES = L0B_BYTES = 64 * 1024  # cube operand buffers
L0C_BYTES = 256 * 1024  # cube accumulator
BLOCK = 32  # DataCopy granule and UB alignment, bytes
AIC_CORES = 32  # cube cores launched by a matmul kernel
AIV_CORES = 64  # vector cores: two per cube core
KV_BLOCK = 16  # the paged cache's block size the attention kernels are built for
CTYPE = {"f32": "float", "bf16": "bfloat16_t", "f16": "half", "i32": "int32_t", "i64": "int64_t"}
SIZE = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i64": 8}
FLOATS = ("f32", "bf16", "f16")  # activation dtypes the kernels take; bf16 / f16 compute in fp32 in UB
FIELD_FORMAT = {"uint32_t": "I", "int32_t": "i", "float": "f"}

# a scalar read after vector work (or the reverse) must wait for the other pipe: the idiom of
# the public kernels, emitted once per kernel file
WAIT_PIPE = """\
template <HardEvent EVENT>
__aicore__ inline void WaitPipe()
{
    event_t id = static_cast<event_t>(GetTPipePtr()->FetchEventID(EVENT));
    SetFlag<EVENT>(id);
    WaitFlag<EVENT>(id);
}
"""


# the lowest finite float: an empty maximum's start and the mask of a discarded choice. Kernels
# have no INFINITY (no host <cmath> on the AI core); the kit starts ReduceMax at this value too
LOWEST = "-3.402823466e+38f"


def reduce_tmp_bytes(count: int, size: int = 4) -> int:
    """Bytes of the sharedTmpBuffer ReduceSum needs on Ascend 950 for `count` elements of `size`
    bytes: one partial sum per 256-byte repeat, in whole 32-byte blocks (ReduceSum.md, 方式二).
    It must not be ReduceSum's source (only its destination may overlap it)."""
    return align(cdiv(count, 256 // size) * size)


def rstd_on_vector(sums: str, n: int, eps: str) -> str:
    """C++ turning sums[0] (a sum of squares over n elements, a vector result) into
    1 / sqrt(sums[0] / n + eps), on the vector unit: the scalar unit has no float sqrt to call
    (host sqrt(double) is not device code). Sqrt and Div round as torch's rsqrt does to within an
    ulp; the docs advise against Rsqrt / Reciprocal where precision matters (Rsqrt.md,
    Reciprocal.md). `sums` is a 64-byte TBuf tensor (sums[8] is scratch); ends with the V_S
    handover, so the caller reads sums.GetValue(0)."""
    return (f"        Duplicate({sums}[8], (float){n}, 1);\n        Div({sums}, {sums}, {sums}[8], 1);\n"
            f"        Adds({sums}, {sums}, {eps}, 1);\n        Sqrt({sums}, {sums}, 1);\n"
            f"        Duplicate({sums}[8], 1.0f, 1);\n        Div({sums}, {sums}[8], {sums}, 1);\n"
            "        WaitPipe<HardEvent::V_S>();\n")


@dataclass
class AscendKernel:
    """One `extern "C" __global__ __vector__` (core "aiv") or `__cube__` (core "aic") entry:
    name(GM args..., workspace, tiling), the tiling struct by value (tiling_type)."""
    name: str
    source: str
    args: list[list]  # argument forms, one per GM_ADDR
    tiling: list[list]  # [field, ctype, expression] in the tiling struct's order
    block_dim: int  # AI cores launched
    core: str = "aiv"  # "aiv" (vector) or "aic" (cube)
    workspace: int = 0  # bytes of GM workspace the kernel asks for (the Matmul API's)
    requires: list[list] = field(default_factory=list)  # [input, axis, n, what]: built for shape[axis] == n
    notes: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def launch_symbol(k: AscendKernel) -> str:
    return f"deepfuse_launch_{k.name}"


def tiling_type(k: AscendKernel) -> str:
    """The C++ type of k's tiling argument: the kit's TCubeTiling for a GEMM, else the kernel's
    own struct (tiling_struct)."""
    return "AscendC::tiling::TCubeTiling" if k.core == "aic" else f"{k.name}_tiling"


def launch_signature(k: AscendKernel) -> str:
    """The C++ signature of k's host-side launch function (see launch_function)."""
    params = "".join(f"uint8_t* a{i}, " for i in range(len(k.args)))
    return (f'extern "C" void {launch_symbol(k)}(uint32_t blockDim, void* stream, {params}uint8_t* workspace, '
            f"{tiling_type(k)} tiling)")


def launch_function(k: AscendKernel) -> str:
    """Host-side C++ in k's own file, as the kit's direct-call samples write it: a function that
    queues k on `stream` with `<<<blockDim, 0, stream>>>`. bisheng compiles it with the kernel;
    the host launch code calls it; the emulator rewrites only the `<<<>>>`."""
    args = "".join(f"a{i}, " for i in range(len(k.args)))
    return (f"\n// host side: queues {k.name} on `stream` (the kernel direct-call launch)\n{launch_signature(k)}\n{{\n"
            f"    {k.name}<<<blockDim, 0, stream>>>({args}workspace, tiling);\n}}\n")


def kernel_file(k: AscendKernel) -> str:
    """kernels/<name>.cpp of the artifact: the kernel and its launch function."""
    return k.source + launch_function(k)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def align(n: int, to: int = BLOCK) -> int:
    return cdiv(n, to) * to


def tiling_struct(name: str, fields: list[list]) -> str:
    """The C declaration of a kernel's tiling struct (4-byte fields: no padding)."""
    body = "".join(f"    {ctype} {f};\n" for f, ctype, _ in fields)
    return f"struct {name}_tiling {{\n{body}}};\n"


def evaluate(expr, shapes: list[tuple], tmp_shapes: list[tuple] = ()) -> int | float:
    """The value of a tiling expression for a launch whose inputs have `shapes`."""
    if isinstance(expr, (int, float)):
        return expr
    op, *a = expr
    if op == "shape":
        return shapes[a[0]][a[1]]
    if op == "tmp_shape":
        return tmp_shapes[a[0]][a[1]]
    x, n = evaluate(a[0], shapes, tmp_shapes), evaluate(a[1], shapes, tmp_shapes)
    return {"cdiv": lambda: cdiv(x, n), "mul": lambda: x * n, "min": lambda: min(x, n)}[op]()


def render(expr) -> str:
    """The C++ of a tiling expression, over the host code's in_shape / tmp_shape arrays."""
    if isinstance(expr, float):
        return repr(expr) + "f"
    if isinstance(expr, int):
        return str(expr)
    op, *a = expr
    if op == "shape":
        return f"in_shape[{a[0]}][{a[1]}]"
    if op == "tmp_shape":
        return f"tmp_shape[{a[0]}][{a[1]}]"
    x, n = render(a[0]), render(a[1])
    return {"cdiv": f"CeilDiv({x}, {n})", "mul": f"({x} * {n})", "min": f"Min({x}, {n})"}[op]


def pack(fields: list[list], shapes: list[tuple], tmp_shapes: list[tuple] = ()) -> bytes:
    """The tiling struct's bytes for one launch (4-byte fields in order, as the struct lays them
    out)."""
    out = b""
    for _, ctype, expr in fields:
        v = evaluate(expr, shapes, tmp_shapes)
        out += struct.pack("<" + FIELD_FORMAT[ctype], float(v) if ctype == "float" else int(v))
    return out


def copy_row(dst: str, src: str, d: int, size: int, to_gm: bool, ct: str = "float") -> str:
    """DataCopy for whole 32-byte blocks, DataCopyPad (one row of d*size bytes) otherwise."""
    if d * size % BLOCK == 0:
        return f"DataCopy({dst}, {src}, {d});"
    params = f"DataCopyExtParams{{1, {d * size}, 0, 0, 0}}"
    if to_gm:
        return f"DataCopyPad({dst}, {src}, {params});"
    return f"DataCopyPad({dst}, {src}, {params}, DataCopyPadExtParams<{ct}>{{false, 0, 0, 0}});"


def to_f32(dst: str, src: str, n: int) -> str:
    """Widening Cast of a bf16 / f16 UB tensor into fp32 (exact)."""
    return f"Cast({dst}, {src}, RoundMode::CAST_NONE, {n});"


def from_f32(dst: str, src: str, n: int) -> str:
    """Narrowing Cast of fp32 into bf16 / f16, rounding to nearest even (as torch does)."""
    return f"Cast({dst}, {src}, RoundMode::CAST_RINT, {n});"


def rows_tiling(rows_expr, cores: int, extra: list[list] = ()) -> list[list]:
    """Tiling of a row-parallel kernel: rows, rowsPerCore, then `extra` fields."""
    return [["rows", "uint32_t", rows_expr], ["rowsPerCore", "uint32_t", ["cdiv", rows_expr, cores]], *extra]
