// cpp/data/idx_reader.h -- the IDX format Fashion-MNIST ships in (raw or gzip), and where to find
// the four Fashion-MNIST files: the data behind the chapter's load_data_fashion_mnist. Images are
// (N, H, W) uint8, labels (N,) uint8. Depends only on the C++ standard library and zlib, so the
// data layer builds and tests without the rest of the engine.
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mgpu::data {

// A file or data directory that is not there. The binding maps it to FileNotFoundError; a file
// that is there but wrong (bad magic, truncated, corrupt gzip) is a std::invalid_argument
// (ValueError). Other I/O failures (permission denied, read errors) are std::runtime_error.
class DataNotFoundError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An IDX array of unsigned bytes, row-major: data.size() == product of dims.
struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;

  int64_t numel() const { return static_cast<int64_t>(data.size()); }
};

// Reads an IDX file of type 0x08 (unsigned byte). Gzip is recognised by its 0x1f 0x8b magic, not
// by the file name. The file must hold exactly the bytes its header promises: a short file is
// truncated, a long one is not what its header says, and either way the data cannot be trusted.
IdxArray read_idx(const std::string& path);

// The four files, as Zalando and Debian name them; each may also carry a ".gz" suffix.
inline constexpr std::array<const char*, 4> kFashionMnistFiles = {
    "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};

// Where Debian's dataset-fashion-mnist package puts the files.
inline constexpr const char* kSystemFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// The directories find_fashion_mnist tries, in order: explicit_dir alone if it is non-empty;
// otherwise $MGPU_DATA (if set and non-empty), ~/.mgpu/data (if $HOME is set), then
// kSystemFashionMnistDir.
std::vector<std::string> fashion_mnist_search_dirs(const std::string& explicit_dir);

// The first directory of fashion_mnist_search_dirs(explicit_dir) holding all four files (each
// raw or .gz). Throws DataNotFoundError listing every directory tried, why each failed, and how
// to get the data.
std::string find_fashion_mnist(const std::string& explicit_dir);

struct FashionMnist {
  IdxArray train_images, train_labels;  // (60000, 28, 28), (60000,) for the real data
  IdxArray test_images, test_labels;    // (10000, 28, 28), (10000,)
};

// Reads the four files from dir (raw preferred over .gz when both exist) and checks they fit
// together: images (N, H, W), labels (N,) with the same N, and train and test images the same
// H x W. Label values are not checked, so other IDX image sets (any number of classes) load too.
FashionMnist load_fashion_mnist(const std::string& dir);

}  // namespace mgpu::data
