// Tensors between the Python tests and the C++ programs, as raw files: int64 rank,
// int64 sizes[rank], then float32 data (contiguous).
#pragma once

#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>

inline at::Tensor read_tensor(const char* path) {
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

inline void write_tensor(const char* path, const at::Tensor& tensor) {
  const at::Tensor t = tensor.to(at::kCPU, at::kFloat).contiguous();
  std::ofstream out(path, std::ios::binary);
  const int64_t rank = t.dim();
  out.write(reinterpret_cast<const char*>(&rank), sizeof(rank));
  out.write(reinterpret_cast<const char*>(t.sizes().data()), rank * sizeof(int64_t));
  out.write(reinterpret_cast<const char*>(t.data_ptr<float>()), t.numel() * sizeof(float));
}
