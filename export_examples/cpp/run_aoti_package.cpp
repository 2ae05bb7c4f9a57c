// Runs an AOTInductor package whose graph calls fusednorm ops, without Python: the fusednorm
// library is loaded first so that its ops are in the dispatcher when the package looks them up.
//
// Tensors travel as raw files: int64 rank, int64 sizes[rank], then float32 data (contiguous).
#include <dlfcn.h>

#include <fstream>
#include <iostream>
#include <stdexcept>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

namespace {

at::Tensor read_tensor(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(std::string("cannot open ") + path);
  int64_t rank = 0;
  in.read(reinterpret_cast<char*>(&rank), sizeof(rank));
  std::vector<int64_t> sizes(rank);
  in.read(reinterpret_cast<char*>(sizes.data()), rank * sizeof(int64_t));
  at::Tensor t = at::empty(sizes, at::kFloat);
  in.read(reinterpret_cast<char*>(t.data_ptr<float>()), t.numel() * sizeof(float));
  if (!in) throw std::runtime_error(std::string("short file ") + path);
  return t;
}

void write_tensor(const char* path, const at::Tensor& tensor) {
  const at::Tensor t = tensor.to(at::kCPU, at::kFloat).contiguous();
  std::ofstream out(path, std::ios::binary);
  const int64_t rank = t.dim();
  out.write(reinterpret_cast<const char*>(&rank), sizeof(rank));
  out.write(reinterpret_cast<const char*>(t.sizes().data()), rank * sizeof(int64_t));
  out.write(reinterpret_cast<const char*>(t.data_ptr<float>()), t.numel() * sizeof(float));
}

}  // namespace

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
