// The one extension module of deepfuse's native CPU kernels (native.py builds it).
#include <torch/extension.h>

#include "kernels.h"

void bind_program(py::module& m);  // program.cpp: StepProgram

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("paged_decode", &paged_decode, "decode attention over the paged cache (paged_decode.cpp)", py::arg("q"),
          py::arg("cache"), py::arg("tables"), py::arg("lens"), py::arg("num_heads"), py::arg("window"),
          py::arg("scale"), py::arg("out"), py::arg("amx_rows") = 2,
          py::arg("batch_invariant") = false);
    m.def("paged_prefill", &paged_prefill,
          "causal prefill attention over the paged cache, AMX or AVX512-BF16 (prefill_attention.cpp)", py::arg("q"),
          py::arg("cache"), py::arg("tables"), py::arg("rows"), py::arg("qlens"), py::arg("lens"), py::arg("num_heads"),
          py::arg("window"), py::arg("scale"), py::arg("out"), py::arg("amx") = true);
    m.def("paged_prefill_available", &paged_prefill_available,
          "whether this build has paged_prefill (AVX512-BF16; prefill_attention.cpp)");
    m.def("pack_panels", &pack_panels, "an f32 weight [N, K] as 16-column panels (panel_gemm.cpp)");
    m.def("panel_gemm", &panel_gemm, "x [M, K] @ w^T over pack_panels(w), into out if given (panel_gemm.cpp)",
          py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("out") = py::none());
    m.def("rms_norm", &rms_norm, "x [T, D] / rms(x) * w (norms.cpp)", py::arg("x"), py::arg("w"), py::arg("eps"),
          py::arg("out") = py::none());
    m.def("add_rms_norm", &add_rms_norm, "(x + res, rms_norm(x + res, w)) (norms.cpp)", py::arg("x"), py::arg("res"),
          py::arg("w"), py::arg("eps"), py::arg("sum_out") = py::none(), py::arg("norm_out") = py::none());
    m.def("amx_available", &amx_available, "whether bf16 GEMMs can use AMX tiles here (bf16_gemm.cpp)");
    m.def("bf16_gemm_available", &bf16_gemm_available,
          "whether bf16_gemm and q4_gemm run here: AMX or AVX512-BF16 (bf16_gemm.cpp)");
    m.def("pack_vnni", &pack_vnni, "a bf16 weight [N, K] as VNNI panels (bf16_gemm.cpp)");
    m.def("bf16_gemm", &bf16_gemm,
          "x [M, K] @ w^T over pack_vnni(w), on AMX tiles or AVX512-BF16, into out if given (bf16_gemm.cpp)",
          py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("out") = py::none(), py::arg("amx") = true);
    m.def("q4_gemm", &q4_gemm, "x [M, K] @ int4 w^T, dequantized to bf16 panels in the GEMM (bf16_gemm.cpp)",
          py::arg("x"), py::arg("nibbles"), py::arg("scales"), py::arg("mins"), py::arg("n"), py::arg("out") = py::none(),
          py::arg("amx") = true);
    m.def("i8_gemm_available", &i8_gemm_available, "whether i8_gemm runs here: AVX512-VNNI (i8_gemm.cpp)");
    m.def("pack_w8", &pack_w8, "a linear_w8a8 weight u8 [N, K] as 16-column panels of k quads (i8_gemm.cpp)");
    m.def("i8_gemm", &i8_gemm,
          "x [M, K] quantized per row and group to int8, @ (wq - 128)^T * scale over pack_w8(wq) (i8_gemm.cpp)",
          py::arg("x"), py::arg("panels"), py::arg("scale"), py::arg("n"), py::arg("group"), py::arg("out") = py::none());
    m.def("i8_gemm_swiglu", &i8_gemm_swiglu, "i8_gemm over swiglu(x) for x [M, 2K], the activation never stored (i8_gemm.cpp)",
          py::arg("x"), py::arg("panels"), py::arg("scale"), py::arg("n"), py::arg("group"), py::arg("out") = py::none());
    m.def("i8_gemm_norm", &i8_gemm_norm,
          "i8_gemm over rms_norm(x (+ res), w), x + res into sum_out when res is given (i8_gemm.cpp)", py::arg("x"),
          py::arg("res"), py::arg("w"), py::arg("eps"), py::arg("sum_out"), py::arg("panels"), py::arg("scale"),
          py::arg("n"), py::arg("group"), py::arg("out") = py::none());
    m.def("q4a8_gemm_available", &q4a8_gemm_available, "whether q4a8_gemm runs here: AVX512-VNNI (q4a8_gemm.cpp)");
    m.def("q4a8_gemm", &q4a8_gemm,
          "x [M, K] quantized per row and group of 32 to int8, @ an int4 w^T over pack_q4a8's blocks (q4a8_gemm.cpp)",
          py::arg("x"), py::arg("blocks"), py::arg("n"), py::arg("out") = py::none());
    m.def("q4a8_gemm_swiglu", &q4a8_gemm_swiglu,
          "q4a8_gemm over swiglu(x) for x [M, 2K], the activation never stored (q4a8_gemm.cpp)", py::arg("x"),
          py::arg("blocks"), py::arg("n"), py::arg("out") = py::none());
    m.def("q4a8_gemm_norm", &q4a8_gemm_norm,
          "q4a8_gemm over rms_norm(x (+ res), w), x + res into sum_out when res is given (q4a8_gemm.cpp)", py::arg("x"),
          py::arg("res"), py::arg("w"), py::arg("eps"), py::arg("sum_out"), py::arg("blocks"), py::arg("n"),
          py::arg("out") = py::none());
    m.def("swiglu", &swiglu, "silu(x[:, :F]) * x[:, F:] for x [T, 2F], into out if given (rows.cpp)", py::arg("x"),
          py::arg("out") = py::none());
    m.def("rope_cache", &rope_cache, "rotary q and k of qkv rows, k and v into the paged cache (rows.cpp)");
    m.def("argmax", &argmax, "first index of each f32 row's largest value, into out if given (rows.cpp)",
          py::arg("x"), py::arg("out") = py::none());
    m.def("sample_available", &sample_available, "whether sample runs here (the self-check may refuse it; sample.cpp)");
    m.def("sample", &sample,
          "the sample op on f32 logits rows: argmax, or the seeded top-k/top-p draw, into out if given (sample.cpp)",
          py::arg("x"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("seeds"),
          py::arg("out") = py::none());
    m.def("spec_verify", &spec_verify, "the spec_verify op: tokens, -1 after a sequence's first rejected draft (sample.cpp)",
          py::arg("tokens"), py::arg("drafts"), py::arg("out") = py::none());
    bind_program(m);
}
