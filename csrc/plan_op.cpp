// The planner's private ops (plan.h): fusednorm::_plan returns the plan of a call described by
// its sizes, without any tensor or device, and fusednorm::_reload_kernel_overrides reads the
// FUSEDNORM_* overrides again. Both take no tensor, so they are registered for
// CompositeExplicitAutograd, the kernel a call with no dispatch key reaches: they run in every
// build, CPU-only ones included.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "group_norm.h"
#include "plan.h"

#include <string>

namespace fusednorm {
namespace {

// sizes: the input's (N, C, *spatial); operands: the epilogue's and affine parameters present,
// comma-separated ("weight", "bias", "scale", "shift", "residual", "multiplier", "multiplier=residual" for one
// tensor as both), and "strided_rows" for an input whose rows are not back to back
// (Problem::strided_rows); device: (SMs, major, minor, opt-in shared memory a CTA, shared memory
// an SM, L2 bytes, cooperative launch, clusters of 16), empty for an H200.
std::string plan_op(c10::IntArrayRef sizes, int64_t num_groups, at::ScalarType dtype, bool channels_last,
    c10::string_view activation, c10::string_view operands, bool backward, c10::IntArrayRef device) {
  TORCH_CHECK(sizes.size() >= 2, "Expected at least 2 dimensions for input tensor but received ", sizes.size());
  TORCH_CHECK(num_groups > 0, "Expected num_groups to be positive, but got num_groups=", num_groups);
  TORCH_CHECK(sizes[1] % num_groups == 0,
      "Expected number of channels in input to be divisible by num_groups, but got input of shape ", sizes,
      " and num_groups=", num_groups);
  TORCH_CHECK_NOT_IMPLEMENTED(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
      "\"fusednorm::_plan\" not implemented for '", c10::toString(dtype), "'");
  plan::Problem p;
  p.N = sizes[0];
  p.C = sizes[1];
  p.S = 1;
  for (size_t d = 2; d < sizes.size(); ++d) p.S *= sizes[d];
  p.G = num_groups;
  p.elem_bytes = static_cast<int>(c10::elementSize(dtype));
  p.bfloat16 = dtype == at::kBFloat16;
  // Rank-2 inputs have no channels-last layout: ChannelsFirst then (layout_for).
  p.channels_last = channels_last && sizes.size() > 2;
  p.act = static_cast<plan::Act>(static_cast<int>(parse_activation(activation)));
  std::string names(operands.data(), operands.size());
  for (size_t pos = 0; pos < names.size();) {
    size_t end = names.find(',', pos);
    if (end == std::string::npos) end = names.size();
    const std::string name = names.substr(pos, end - pos);
    pos = end + 1;
    if (name.empty()) continue;
    if (name == "weight") p.weight = true;
    else if (name == "bias") p.bias = true;
    else if (name == "scale") p.scale = true;
    else if (name == "shift") p.shift = true;
    else if (name == "residual") p.residual = true;
    else if (name == "multiplier") p.multiplier = true;
    else if (name == "multiplier=residual") p.residual = p.multiplier = p.multiplier_is_residual = true;
    else if (name == "strided_rows") p.strided_rows = !backward && !p.channels_last;
    else TORCH_CHECK_VALUE(false, "fusednorm::_plan: unknown operand '", name, "'");
  }
  p.backward = backward;
  // The backward of fusednorm.group_norm: every gradient its inputs need.
  p.mask = {true, p.weight, p.bias, p.scale, p.shift, p.residual, p.multiplier};
  plan::DeviceInfo dev = plan::h200();
  if (!device.empty()) {
    TORCH_CHECK_VALUE(device.size() == 8, "fusednorm::_plan: device takes 8 values, got ", device.size());
    dev.sms = static_cast<int>(device[0]);
    dev.major = static_cast<int>(device[1]);
    dev.minor = static_cast<int>(device[2]);
    dev.smem_optin = device[3];
    dev.smem_per_sm = device[4];
    dev.l2_bytes = device[5];
    dev.cooperative_launch = device[6] != 0;
    dev.clusters_of_16 = device[7] != 0;
  }
  return plan::plan_call(p, dev, plan::modeled_residency(dev), plan::overrides()).to_string();
}

std::string reload_kernel_overrides_op() {
  const plan::Overrides& o = plan::reload_overrides();
  return std::string("tuning_knobs=") + (plan::tuning_knobs_compiled() ? "1" : "0") +
      (o.to_string().empty() ? "" : " ") + o.to_string();
}

}  // namespace

TORCH_LIBRARY_IMPL(fusednorm, CompositeExplicitAutograd, m) {
  m.impl("_plan", &plan_op);
  m.impl("_reload_kernel_overrides", &reload_kernel_overrides_op);
}

}  // namespace fusednorm
