// Autograd of the forward kernel ops, group_norm_forward and fused_group_norm_forward (and, at
// the end, replication_pad's, which is ATen's pad wherever a graph is recorded): C++ autograd
// Functions at the Autograd key, as ATen's own norms have. A backward then runs no Python, and
// the graph a call records is one C++ node: the host time of small shapes (the UNet rows at batch
// 2, where the kernels take 5-40 us) is what bounds them. It also gives programs that run without
// Python (TorchScript loaded by torch::jit::load) a backward.
//
// The formulas are in the backward ops (group_norm_backward, fused_group_norm_backward); this file
// decides which gradients are wanted and maps the backward op's outputs to the forward's
// arguments. The kernels have no other derivatives, so the same function composed of
// differentiable ATen ops (ComposedForward) stands in where more is asked:
//   - with create_graph (double backward: gradient penalties, Hessian-vector products) the
//     backward takes the gradients through it, so that they carry a graph;
//   - a call with a forward-mode tangent (torch.func.jvp / jacfwd, torch.autograd.forward_ad), or
//     one that records a graph under a functorch transform (torch.func.grad / vjp / jacrev /
//     hessian, which refuse C++ autograd Functions), returns its output.
#include <ATen/FuncTorchTLS.h>
#include <ATen/ops/pad.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <string>
#include <vector>

#include "group_norm.h"
#include "kernel_ops.h"

namespace fusednorm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Saved tensors are at::Tensor, undefined where an optional argument was absent.
at::Tensor or_undefined(const OptTensor& t) {
  return t.has_value() ? *t : at::Tensor();
}

OptTensor as_optional(const at::Tensor& t) {
  return t.defined() ? OptTensor(t) : c10::nullopt;
}

bool requires_grad(const OptTensor& t) {
  return t.has_value() && t->defined() && t->requires_grad();
}

// Whether a call records a graph: as torch.library's autograd kernels, a call that records none
// skips the Function (its context and saved tensors) altogether.
bool records_graph(std::initializer_list<const OptTensor*> tensors) {
  if (!at::GradMode::is_enabled()) return false;
  for (const OptTensor* t : tensors) {
    if (requires_grad(*t)) return true;
  }
  return false;
}

// Which inputs want a gradient, as Python's ctx.needs_input_grad: their requires_grad at the
// forward (which runs only while a graph is recorded), saved in the context and read back by the
// backward as its op's output mask.
void save_wanted(AutogradContext* ctx, std::initializer_list<const OptTensor*> tensors) {
  c10::List<bool> out;
  for (const OptTensor* t : tensors) out.push_back(requires_grad(*t));
  ctx->saved_data["wanted"] = out;
}

template <size_t K>
std::array<bool, K> wanted_mask(AutogradContext* ctx) {
  const c10::List<bool> want = ctx->saved_data["wanted"].toBoolList();
  std::array<bool, K> mask{};
  for (size_t i = 0; i < K; ++i) mask[i] = want[i];
  return mask;
}

// mean and rstd have no derivative. They leave a Function's forward through this argument rather
// than as its outputs: outputs marked non-differentiable make compiled autograd
// (torch._dynamo.compiled_autograd) fail an internal assert on the node, and unmarked ones would
// take gradients that the backward ignores. The Function's one output then needs no zero-filled
// gradients for the others.
struct Statistics {
  at::Tensor mean, rstd;
};

// The forward as differentiable ATen ops of its tensor arguments by position: input, weight, bias
// and, for the fused op, scale, shift, residual, multiplier (undefined where absent). at::group_norm
// is differentiated by ATen in both modes and twice, and so is apply_epilogue.
struct ComposedForward {
  int64_t num_groups;
  double eps;
  c10::string_view activation = "none";
  double negative_slope = 0.01;

  at::Tensor operator()(const variable_list& v) const {
    // On a contiguous copy, the result then in the input's memory format: torch 2.1's
    // forward-mode formula of group_norm views a channels-last input, and fails.
    at::Tensor z = at::group_norm(v[0].contiguous(), num_groups, v[1], v[2], eps, /*cudnn_enabled=*/false);
    if (v.size() > 3) {
      const OptTensor scale = as_optional(v[3]), shift = as_optional(v[4]), residual = as_optional(v[5]),
                      multiplier = as_optional(v[6]);
      z = apply_epilogue(z, v[0], EpilogueArgs{activation, negative_slope, scale, shift, residual, multiplier});
    }
    // channels-last through movedim rather than contiguous(memory_format): functorch's vmap (in
    // jacfwd, hessian, vmap(jvp)) implements only contiguous_format and preserve_format clones.
    // The strides are the same.
    const auto format = v[0].suggest_memory_format();
    if (format == at::MemoryFormat::Contiguous) return z.contiguous();
    return z.movedim(1, -1).contiguous().movedim(-1, 1);
  }
};

// The arguments cast (differentiably) to the kernels' precision: float32, or float64 for float64
// input.
variable_list in_opmath(const variable_list& inputs) {
  const auto opmath = inputs[0].scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  variable_list out;
  for (const at::Tensor& t : inputs) out.push_back(t.defined() ? t.to(opmath) : t);
  return out;
}

// The create_graph backward: the gradients of the composed forward for the `wanted` positions of
// `inputs`, with a graph; undefined at the other positions. (One tensor as residual and
// multiplier is one input reached by two casts: its gradient at the residual's position is the
// whole of it.)
template <size_t K>
variable_list differentiable_grads(const variable_list& inputs, const std::array<bool, K>& wanted,
    const at::Tensor& grad_out, const ComposedForward& forward) {
  TORCH_INTERNAL_ASSERT(inputs.size() == K);
  const at::Tensor z = forward(in_opmath(inputs));
  variable_list targets;
  std::vector<size_t> positions;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (wanted[i]) {
      targets.push_back(inputs[i]);
      positions.push_back(i);
    }
  }
  const variable_list grads = torch::autograd::grad({z}, targets, {grad_out.to(z.scalar_type())},
      /*retain_graph=*/true, /*create_graph=*/true, /*allow_unused=*/true);
  variable_list out(inputs.size());
  for (size_t k = 0; k < positions.size(); ++k) {
    // In the input's dtype (autograd would cast too), and zeros where allow_unused left none:
    // the kernels' gradient there.
    const at::Tensor& t = inputs[positions[k]];
    out[positions[k]] = grads[k].defined() ? grads[k].to(t.scalar_type()) : at::zeros_like(t);
  }
  return out;
}

// Whether a functorch transform is active: the condition under which Function::apply refuses C++
// autograd Functions, tested as apply tests it (functorch's layer stack is not in the installed
// headers' reach: its header needs one torch does not ship).
bool in_functorch_transform() {
  const auto& tls = at::functorch::functorchTLSAccessor();
  if (!tls) return false;
  try {
    tls->checkSupportsCppAutogradFunction();
    return false;
  } catch (const c10::Error&) {
    return true;
  }
}

// Whether the call must go through the composed forward: an argument carries a forward-mode
// tangent (at ATen's level, 0), or a graph is recorded (`graph`, records_graph of the same
// tensors, which the caller needs too) under a functorch transform.
bool needs_composition(std::initializer_list<const OptTensor*> tensors, bool graph) {
  for (const OptTensor* t : tensors) {
    if (t->has_value() && (*t)->defined() && (*t)->_fw_grad(/*level=*/0).defined()) return true;
  }
  return graph && in_functorch_transform();
}

// The result of a call that needs_composition: the composed forward's output, which carries the
// tangents and the graph, in the input's dtype; mean and rstd, which have no derivative, from the
// kernel op.
std::tuple<at::Tensor, at::Tensor, at::Tensor> through_composition(
    const std::tuple<at::Tensor, at::Tensor, at::Tensor>& kernel_result, const variable_list& inputs,
    const ComposedForward& forward) {
  const at::Tensor z = forward(in_opmath(inputs)).to(inputs[0].scalar_type());
  return {z, std::get<1>(kernel_result), std::get<2>(kernel_result)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_forward_below_autograd(const at::Tensor& input,
    int64_t num_groups, const OptTensor& weight, const OptTensor& bias, double eps) {
  static auto op = find_op<ForwardFn>("fusednorm::group_norm_forward");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(input, num_groups, weight, bias, eps);
}

class GroupNormForward : public torch::autograd::Function<GroupNormForward> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, int64_t num_groups,
      const OptTensor& weight, const OptTensor& bias, double eps, Statistics* stats) {
    auto [output, mean, rstd] = group_norm_forward_below_autograd(input, num_groups, weight, bias, eps);
    *stats = {mean, rstd};
    ctx->save_for_backward({input, mean, rstd, or_undefined(weight), or_undefined(bias)});
    ctx->saved_data["num_groups"] = num_groups;
    ctx->saved_data["eps"] = eps;
    const OptTensor x(input);
    save_wanted(ctx, {&x, &weight, &bias});
    // The op returns parameter gradients in the weight's dtype; the bias may have another.
    if (requires_grad(bias)) ctx->saved_data["bias_dtype"] = bias->scalar_type();
    return {output};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // (One output, its gradient materialised: grads[0] is defined.)
    const at::Tensor& grad_out = grads[0];
    const variable_list saved = ctx->get_saved_variables();
    const std::array<bool, 3> mask = wanted_mask<3>(ctx);
    const int64_t num_groups = ctx->saved_data["num_groups"].toInt();
    if (at::GradMode::is_enabled()) {  // create_graph
      const ComposedForward forward{num_groups, ctx->saved_data["eps"].toDouble()};
      const variable_list g =
          differentiable_grads({saved[0], saved[3], saved[4]}, mask, grad_out, forward);
      return {g[0], {}, g[1], g[2], {}, {}};
    }
    static auto op = find_op<BackwardFn>("fusednorm::group_norm_backward");
    variable_list out(6);
    auto [grad_input, grad_weight, grad_bias] =
        op.call(grad_out, saved[0], saved[1], saved[2], as_optional(saved[3]), num_groups, mask);
    if (mask[0]) out[0] = grad_input;
    if (mask[1]) out[2] = grad_weight;
    if (mask[2]) out[3] = grad_bias.to(ctx->saved_data["bias_dtype"].toScalarType());
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_forward_autograd(const at::Tensor& input,
    int64_t num_groups, const OptTensor& weight, const OptTensor& bias, double eps) {
  const OptTensor x(input);
  const bool graph = records_graph({&x, &weight, &bias});
  if (needs_composition({&x, &weight, &bias}, graph)) {
    return through_composition(group_norm_forward_below_autograd(input, num_groups, weight, bias, eps),
        {input, or_undefined(weight), or_undefined(bias)}, ComposedForward{num_groups, eps});
  }
  if (!graph) return group_norm_forward_below_autograd(input, num_groups, weight, bias, eps);
  Statistics stats;
  variable_list out = GroupNormForward::apply(input, num_groups, weight, bias, eps, &stats);
  return {out[0], stats.mean, stats.rstd};
}

// The arguments of fused_group_norm_forward besides input, weight and bias.
struct FusedArgs {
  int64_t num_groups;
  double eps;
  const OptTensor& scale;
  const OptTensor& shift;
  const OptTensor& residual;
  c10::string_view activation;
  double negative_slope;
  const OptTensor& multiplier;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_group_norm_forward_below_autograd(const at::Tensor& input,
    const OptTensor& weight, const OptTensor& bias, const FusedArgs& a, const OptTensor& input_bias = c10::nullopt) {
  static auto op = find_op<FusedForwardFn>("fusednorm::fused_group_norm_forward");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(input, a.num_groups, weight, bias, a.eps, a.scale, a.shift, a.residual, a.activation,
      a.negative_slope, a.multiplier, input_bias);
}

class FusedGroupNormForward : public torch::autograd::Function<FusedGroupNormForward> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, int64_t num_groups,
      const OptTensor& weight, const OptTensor& bias, double eps, const OptTensor& scale,
      const OptTensor& shift, const OptTensor& residual, c10::string_view activation,
      double negative_slope, const OptTensor& multiplier, bool residual_is_multiplier, Statistics* stats) {
    const FusedArgs args{num_groups, eps, scale, shift, residual, activation, negative_slope, multiplier};
    auto [output, mean, rstd] = fused_group_norm_forward_below_autograd(input, weight, bias, args);
    *stats = {mean, rstd};
    ctx->save_for_backward({input, mean, rstd, or_undefined(weight), or_undefined(bias), or_undefined(scale),
        or_undefined(shift), or_undefined(residual), or_undefined(multiplier)});
    ctx->saved_data["num_groups"] = num_groups;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["negative_slope"] = negative_slope;
    const OptTensor x(input);
    save_wanted(ctx, {&x, &weight, &bias, &scale, &shift, &residual, &multiplier});
    ctx->saved_data["residual_is_multiplier"] = residual_is_multiplier;
    return {output};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad_out = grads[0];  // defined, as above
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &mean = saved[1], &rstd = saved[2], &weight = saved[3],
                     &bias = saved[4], &scale = saved[5], &shift = saved[6], &residual = saved[7],
                     &multiplier = saved[8];
    // In the order of the backward op's outputs: input, weight, bias, scale, shift, residual,
    // multiplier.
    const std::array<bool, 7> mask = wanted_mask<7>(ctx);
    const bool summed = ctx->saved_data["residual_is_multiplier"].toBool();
    const int64_t num_groups = ctx->saved_data["num_groups"].toInt();
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const double negative_slope = ctx->saved_data["negative_slope"].toDouble();
    // summed: mask[6] is false (the multiplier came in detached) and the residual's gradient is the
    // tensor's whole gradient.
    if (at::GradMode::is_enabled()) {  // create_graph
      const ComposedForward forward{num_groups, ctx->saved_data["eps"].toDouble(), activation, negative_slope};
      const variable_list g = differentiable_grads(
          {input, weight, bias, scale, shift, residual, summed ? residual : multiplier}, mask, grad_out,
          forward);
      return {g[0], {}, g[1], g[2], {}, g[3], g[4], g[5], {}, {}, g[6], {}, {}};
    }
    static auto op = find_op<FusedBackwardFn>("fusednorm::fused_group_norm_backward");
    auto [g_input, g_weight, g_bias, g_scale, g_shift, g_residual, g_multiplier] = op.call(grad_out,
        input, mean, rstd, as_optional(weight), as_optional(bias), num_groups, as_optional(scale),
        as_optional(shift), as_optional(residual), activation, negative_slope, as_optional(multiplier),
        mask, summed);
    variable_list out(13);  // one per forward argument
    // Parameter and modulation gradients come in their parameters' dtypes; scale's and shift's in
    // shape (N, C).
    if (mask[0]) out[0] = g_input;
    if (mask[1]) out[2] = g_weight;
    if (mask[2]) out[3] = g_bias;
    if (mask[3]) out[5] = g_scale.reshape_symint(scale.sym_sizes());
    if (mask[4]) out[6] = g_shift.reshape_symint(shift.sym_sizes());
    if (mask[5]) out[7] = g_residual;
    if (mask[6]) out[10] = g_multiplier;
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_group_norm_forward_autograd(const at::Tensor& input,
    int64_t num_groups, const OptTensor& weight, const OptTensor& bias, double eps, const OptTensor& scale,
    const OptTensor& shift, const OptTensor& residual, c10::string_view activation, double negative_slope,
    const OptTensor& multiplier, const OptTensor& input_bias) {
  const OptTensor x(input);
  const FusedArgs args{num_groups, eps, scale, shift, residual, activation, negative_slope, multiplier};
  if (defined(input_bias)) {
    // Without a graph or a tangent the kernels add input_bias themselves; otherwise the op runs on
    // input + input_bias materialized by ATen, which differentiates the addition (docs/design.md,
    // "Input bias").
    const std::initializer_list<const OptTensor*> all{
        &x, &weight, &bias, &scale, &shift, &residual, &multiplier, &input_bias};
    const bool graph = records_graph(all);
    if (!graph && !needs_composition(all, graph)) {
      return fused_group_norm_forward_below_autograd(input, weight, bias, args, input_bias);
    }
    check_input_bias(input, *input_bias);
    return fused_group_norm_forward_autograd(add_input_bias(input, *input_bias), num_groups, weight, bias, eps,
        scale, shift, residual, activation, negative_slope, multiplier, c10::nullopt);
  }
  const std::initializer_list<const OptTensor*> tensors{&x, &weight, &bias, &scale, &shift, &residual, &multiplier};
  const bool graph = records_graph(tensors);
  if (needs_composition(tensors, graph)) {
    return through_composition(fused_group_norm_forward_below_autograd(input, weight, bias, args),
        {input, or_undefined(weight), or_undefined(bias), or_undefined(scale), or_undefined(shift),
            or_undefined(residual), or_undefined(multiplier)},
        ComposedForward{num_groups, eps, activation, negative_slope});
  }
  if (!graph) return fused_group_norm_forward_below_autograd(input, weight, bias, args);
  // One tensor as both residual and multiplier (problem 3's (h + y) * y): the node takes it once,
  // as the residual, and the backward op returns its whole gradient there, rather than two that
  // autograd would add in a pass of its own. The multiplier slot gets a detached alias, so that the
  // node has no second edge to the tensor (compiled autograd adds the gradients of two edges even
  // where one is undefined, and failed on it).
  const bool same = residual.has_value() && multiplier.has_value() && residual->is_same(*multiplier);
  const OptTensor multiplier_input = same ? OptTensor(multiplier->detach()) : multiplier;
  Statistics stats;
  variable_list out = FusedGroupNormForward::apply(input, num_groups, weight, bias, eps, scale, shift,
      residual, activation, negative_slope, multiplier_input, same, &stats);
  return {out[0], stats.mean, stats.rstd};
}

// The residual-add prologue: without a graph or a tangent the kernels compute the sum; otherwise
// ATen does (input + other + input_bias, which it differentiates) and the fused op normalizes it,
// the sum's gradient then that of both uses (docs/design.md, "Residual-add prologue").
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_group_norm_forward_autograd(
    const at::Tensor& input, const at::Tensor& other, int64_t num_groups, const OptTensor& weight,
    const OptTensor& bias, double eps, const OptTensor& scale, const OptTensor& shift, const OptTensor& residual,
    c10::string_view activation, double negative_slope, const OptTensor& multiplier, const OptTensor& input_bias) {
  const OptTensor x(input), o(other);
  const std::initializer_list<const OptTensor*> all{
      &x, &o, &weight, &bias, &scale, &shift, &residual, &multiplier, &input_bias};
  const bool graph = records_graph(all);
  if (!graph && !needs_composition(all, graph)) {
    static auto op = find_op<AddForwardFn>("fusednorm::add_group_norm_forward");
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(input, other, num_groups, weight, bias, eps, scale, shift, residual, activation, negative_slope,
        multiplier, input_bias);
  }
  const at::Tensor sum = add_operands(input, other, input_bias);
  auto [output, mean, rstd] = fused_group_norm_forward_autograd(sum, num_groups, weight, bias, eps, scale, shift,
      residual, activation, negative_slope, multiplier, c10::nullopt);
  return {output, sum, mean, rstd};
}

// replication_pad: the kernel op where the call records no graph and carries no tangent (the
// fusion backend's inference graphs); otherwise ATen's pad, which is what the op computes and
// which ATen differentiates in every mode, in the op's memory format (docs/design.md,
// "Replication pad").
at::Tensor replication_pad_autograd(const at::Tensor& input, at::IntArrayRef padding) {
  const OptTensor x(input);
  const bool graph = records_graph({&x});
  if (graph || needs_composition({&x}, graph)) {
    return at::pad(input, padding, "replicate").contiguous(input.suggest_memory_format());
  }
  static auto op = find_op<ReplicationPadFn>("fusednorm::replication_pad");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(input, padding);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusednorm, Autograd, m) {
  m.impl("group_norm_forward", &group_norm_forward_autograd);
  m.impl("fused_group_norm_forward", &fused_group_norm_forward_autograd);
  m.impl("add_group_norm_forward", &add_group_norm_forward_autograd);
  m.impl("replication_pad", &replication_pad_autograd);
}

}  // namespace fusednorm
