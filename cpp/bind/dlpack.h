// cpp/bind/dlpack.h -- the DLPack ABI (v0.8 "dltensor" capsules): the structs a producer hands
// to a consumer so tensors cross libraries (NumPy, PyTorch, JAX, CuPy) without a copy.
// Declared from the published ABI; only the fields and codes mgpu uses are named.
#pragma once

#include <cstdint>

namespace mgpu::dlpack {

enum DeviceType : int32_t { kCPU = 1, kCUDA = 2 };
enum TypeCode : uint8_t { kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4 };

struct Device {
  int32_t device_type;
  int32_t device_id;
};
struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // null means compact row-major
  uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

}  // namespace mgpu::dlpack
