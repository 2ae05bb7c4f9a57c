// Trains through fusednorm ops without Python: loads a TorchScript module saved from Python, runs
// its forward on an input that requires grad and its backward from a given output gradient (the
// ops' autograd is C++, csrc/autograd.cpp), and writes the gradients of the input and of one
// named parameter. Tensors travel as raw files (tensor_files.h).
#include <dlfcn.h>

#include <iostream>
#include <string>

#include <torch/script.h>

#include "tensor_files.h"

int main(int argc, char** argv) {
  if (argc != 8) {
    std::cerr << "usage: " << argv[0]
              << " <fusednorm library> <module.pt> <input.bin> <grad_output.bin> <grad_input.bin>"
                 " <parameter name> <grad_parameter.bin>\n";
    return 2;
  }
  if (dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::cerr << "cannot load " << argv[1] << ": " << dlerror() << "\n";
    return 1;
  }
  try {
    torch::jit::Module module = torch::jit::load(argv[2]);
    at::Tensor input = read_tensor(argv[3]).requires_grad_();
    at::Tensor output = module.forward({input}).toTensor();
    output.backward(read_tensor(argv[4]));
    write_tensor(argv[5], input.grad());
    for (const auto& p : module.named_parameters()) {
      if (p.name == argv[6]) {
        write_tensor(argv[7], p.value.grad());
        std::cout << "trained " << argv[2] << ": grad of input " << input.grad().sizes() << " and of "
                  << p.name << " " << p.value.grad().sizes() << "\n";
        return 0;
      }
    }
    std::cerr << "no parameter " << argv[6] << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
