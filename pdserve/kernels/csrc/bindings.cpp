// The Python module: the ops of kernels.h, and the constants Python must agree with (PANEL) or may
// check (ISA, VECTOR_FLOATS: what this variant was compiled for). The module's name,
// TORCH_EXTENSION_NAME, is set per variant by pdserve/kernels/build.py, so that two variants can be
// imported side by side (the tests load both).
//
// Only this file includes the pybind11 side of torch (torch/python.h); the kernels include ATen
// alone, which keeps each variant's build to well under a minute on two cores.

#include <torch/csrc/Exceptions.h>
#include <torch/python.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pdserve's fused CPU ops (fp32); see pdserve/kernels/cpu_kernels.py";
  // wrap_pybind_function: a failed TORCH_CHECK reaches Python as the exception torch would raise.
  m.def("decode_attention", torch::wrap_pybind_function(pdserve::decode_attention));
  m.def("rope_write_kv", torch::wrap_pybind_function(pdserve::rope_write_kv));
  m.def("rms_norm", torch::wrap_pybind_function(pdserve::rms_norm));
  m.def("silu_mul", torch::wrap_pybind_function(pdserve::silu_mul));
  m.def("packed_linear", torch::wrap_pybind_function(pdserve::packed_linear));
  m.def("packed_rows", torch::wrap_pybind_function(pdserve::packed_rows));
  m.def("gated_delta_net", torch::wrap_pybind_function(pdserve::gated_delta_net));
  m.attr("PANEL") = pdserve::PANEL;
  m.attr("VECTOR_FLOATS") = pdserve::VEC;
  m.attr("ISA") = pdserve::ISA;
}
