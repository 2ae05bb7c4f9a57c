// Runs an AOTInductor package whose graph calls fusednorm ops, without Python: the fusednorm
// library is loaded first so that its ops are in the dispatcher when the package looks them up.
// Tensors travel as raw files (tensor_files.h).
#include <dlfcn.h>

#include <iostream>
#include <vector>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include "tensor_files.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: " << argv[0] << " <fusednorm library> <package.pt2> <input.bin> <output.bin>\n";
    return 2;
  }
  if (dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::cerr << "cannot load " << argv[1] << ": " << dlerror() << "\n";
    return 1;
  }
  try {
    torch::inductor::AOTIModelPackageLoader loader(argv[2]);
    std::vector<at::Tensor> outputs = loader.run({read_tensor(argv[3])});
    write_tensor(argv[4], outputs.at(0));
    std::cout << "ran " << argv[2] << ": output " << outputs.at(0).sizes() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
