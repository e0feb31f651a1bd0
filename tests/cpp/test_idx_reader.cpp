// tests/cpp/test_idx_reader.cpp -- the IDX reader on its own: IDX files written here (raw and gzip)
// read back exactly, every broken-file case fails with the right exception naming the file, and
// the Fashion-MNIST search order. Uses the real dataset when it is installed.
#include <gtest/gtest.h>
#include <zlib.h>

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "data/idx_reader.h"
#include "data_test_util.h"

namespace mgpu::data {
namespace {

using namespace mgpu_test;  // data_test_util.h
namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// read_idx

TEST(ReadIdx, RawImagesExactValuesAndDims) {
  TempDir dir;
  const Bytes payload = iota_bytes(3 * 2 * 4, 200);  // wraps past 255
  write_raw(dir / "images", idx_bytes(0x08, {3, 2, 4}, payload));
  const IdxArray a = read_idx(dir / "images");
  EXPECT_EQ(a.dims, (std::vector<int64_t>{3, 2, 4}));
  EXPECT_EQ(a.data, payload);
  EXPECT_EQ(a.numel(), 24);
}

TEST(ReadIdx, RawLabels1d) {
  TempDir dir;
  const Bytes payload = {9, 0, 3, 7, 255};
  write_raw(dir / "labels", idx_bytes(0x08, {5}, payload));
  const IdxArray a = read_idx(dir / "labels");
  EXPECT_EQ(a.dims, (std::vector<int64_t>{5}));
  EXPECT_EQ(a.data, payload);
}

TEST(ReadIdx, LargeDimensionsAreBigEndian) {
  TempDir dir;
  const Bytes payload = iota_bytes(0x0102);
  write_raw(dir / "big", idx_bytes(0x08, {0x0102, 1}, payload));
  const IdxArray a = read_idx(dir / "big");
  EXPECT_EQ(a.dims, (std::vector<int64_t>{258, 1}));
  EXPECT_EQ(a.data, payload);
}

TEST(ReadIdx, EmptyArray) {
  TempDir dir;
  write_raw(dir / "empty", idx_bytes(0x08, {0, 28, 28}, {}));
  const IdxArray a = read_idx(dir / "empty");
  EXPECT_EQ(a.dims, (std::vector<int64_t>{0, 28, 28}));
  EXPECT_TRUE(a.data.empty());
}

TEST(ReadIdx, GzipDetectedByContentNotName) {
  TempDir dir;
  const Bytes payload = noise_bytes(5 * 7 * 3);
  const Bytes file = idx_bytes(0x08, {5, 7, 3}, payload);
  write_gz(dir / "no_suffix", file);    // gzip without .gz
  write_raw(dir / "fake.gz", file);     // raw despite .gz
  write_gz(dir / "real.gz", file);
  ASSERT_EQ(read_all(dir / "no_suffix")[0], 0x1f);
  for (const char* name : {"no_suffix", "fake.gz", "real.gz"}) {
    const IdxArray a = read_idx(dir / name);
    EXPECT_EQ(a.dims, (std::vector<int64_t>{5, 7, 3})) << name;
    EXPECT_EQ(a.data, payload) << name;
  }
}

TEST(ReadIdx, GzipLargerThanOneChunk) {
  TempDir dir;
  // Over 4 MiB, so the chunked read loop goes round more than once.
  const Bytes payload = noise_bytes(5'000'000);
  write_gz(dir / "big.gz", idx_bytes(0x08, {5'000'000}, payload));
  const IdxArray a = read_idx(dir / "big.gz");
  EXPECT_EQ(a.dims, (std::vector<int64_t>{5'000'000}));
  EXPECT_TRUE(a.data == payload);
}

TEST(ReadIdx, MissingFileIsDataNotFound) {
  TempDir dir;
  const std::string path = dir / "nothing-here-idx1-ubyte";
  const std::string msg = message_of<DataNotFoundError>([&] { read_idx(path); });
  EXPECT_CONTAINS(msg, path);
  EXPECT_CONTAINS(msg, "does not exist");
}

TEST(ReadIdx, DirectoryIsInvalid) {
  TempDir dir;
  const std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir.path()); });
  EXPECT_CONTAINS(msg, dir.path());
  EXPECT_CONTAINS(msg, "directory");
}

TEST(ReadIdx, BadMagic) {
  TempDir dir;
  write_raw(dir / "notes.txt", {'h', 'e', 'l', 'l', 'o', '\n'});
  const std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir / "notes.txt"); });
  EXPECT_CONTAINS(msg, "notes.txt");
  EXPECT_CONTAINS(msg, "not an IDX file");
  EXPECT_CONTAINS(msg, "0x68 0x65");
}

TEST(ReadIdx, BadMagicInsideGzip) {
  TempDir dir;
  write_gz(dir / "notes.gz", {'h', 'e', 'l', 'l', 'o', '\n'});
  const std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir / "notes.gz"); });
  EXPECT_CONTAINS(msg, "notes.gz");
  EXPECT_CONTAINS(msg, "not an IDX file");
}

TEST(ReadIdx, UnsupportedTypeCode) {
  TempDir dir;
  write_raw(dir / "floats", idx_bytes(0x0D, {2}, Bytes(8, 0)));
  std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir / "floats"); });
  EXPECT_CONTAINS(msg, "floats");
  EXPECT_CONTAINS(msg, "0x0D");
  EXPECT_CONTAINS(msg, "float32");
  EXPECT_CONTAINS(msg, "0x08");

  write_raw(dir / "weird", idx_bytes(0x42, {2}, Bytes(2, 0)));
  msg = message_of<std::invalid_argument>([&] { read_idx(dir / "weird"); });
  EXPECT_CONTAINS(msg, "weird");
  EXPECT_CONTAINS(msg, "0x42");
  EXPECT_CONTAINS(msg, "not a valid IDX type");
}

TEST(ReadIdx, TooShortForHeader) {
  TempDir dir;
  write_raw(dir / "empty", {});
  write_raw(dir / "two", {0, 0});
  write_raw(dir / "dims_cut", {0, 0, 0x08, 3, 0, 0, 0, 1, 0});
  for (const char* name : {"empty", "two", "dims_cut"}) {
    const std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir / name); });
    EXPECT_CONTAINS(msg, dir / name);
  }
  EXPECT_CONTAINS(message_of<std::invalid_argument>([&] { read_idx(dir / "dims_cut"); }),
                  "truncated inside its header");
}

TEST(ReadIdx, ZeroDimensions) {
  TempDir dir;
  write_raw(dir / "scalar", {0, 0, 0x08, 0, 42});
  const std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir / "scalar"); });
  EXPECT_CONTAINS(msg, "scalar");
  EXPECT_CONTAINS(msg, "0 dimensions");
}

TEST(ReadIdx, TruncatedRawSaysExpectedAndFound) {
  TempDir dir;
  write_raw(dir / "short", idx_bytes(0x08, {2, 3, 3}, iota_bytes(10)));
  const std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir / "short"); });
  EXPECT_CONTAINS(msg, dir / "short");
  EXPECT_CONTAINS(msg, "truncated");
  EXPECT_CONTAINS(msg, "promises 18 data bytes for shape (2, 3, 3)");
  EXPECT_CONTAINS(msg, "found 10");
}

TEST(ReadIdx, HugeHeaderOnTinyRawFileDoesNotAllocate) {
  TempDir dir;
  write_raw(dir / "liar", idx_bytes(0x08, {0xFFFFFFFFu, 0xFFFF}, iota_bytes(3)));
  const std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir / "liar"); });
  EXPECT_CONTAINS(msg, "truncated");
  EXPECT_CONTAINS(msg, "found 3");
}

TEST(ReadIdx, DimsProductOverflowRejected) {
  TempDir dir;
  write_raw(dir / "overflow", idx_bytes(0x08, {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}, {}));
  const std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir / "overflow"); });
  EXPECT_CONTAINS(msg, "overflow");
  EXPECT_CONTAINS(msg, "2^48");
}

TEST(ReadIdx, ExtraBytesAfterData) {
  TempDir dir;
  write_raw(dir / "long", idx_bytes(0x08, {4}, iota_bytes(6)));
  std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir / "long"); });
  EXPECT_CONTAINS(msg, dir / "long");
  EXPECT_CONTAINS(msg, "2 bytes after");

  write_gz(dir / "long.gz", idx_bytes(0x08, {4}, iota_bytes(6)));
  msg = message_of<std::invalid_argument>([&] { read_idx(dir / "long.gz"); });
  EXPECT_CONTAINS(msg, dir / "long.gz");
  EXPECT_CONTAINS(msg, "more than the 4 data bytes");
}

TEST(ReadIdx, TruncatedGzipContent) {
  // A well-formed gzip stream around an IDX file that is itself short.
  TempDir dir;
  write_gz(dir / "short.gz", idx_bytes(0x08, {2, 3, 3}, iota_bytes(10)));
  const std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir / "short.gz"); });
  EXPECT_CONTAINS(msg, dir / "short.gz");
  EXPECT_CONTAINS(msg, "promises 18 data bytes");
  EXPECT_CONTAINS(msg, "found 10");
}

TEST(ReadIdx, TruncatedGzipStream) {
  // The .gz file itself cut short, as an interrupted download leaves it.
  TempDir dir;
  const Bytes payload = noise_bytes(100'000);
  write_gz(dir / "full.gz", idx_bytes(0x08, {100, 1000}, payload));
  const Bytes gz = read_all(dir / "full.gz");

  write_raw(dir / "cut.gz", Bytes(gz.begin(), gz.begin() + static_cast<long>(gz.size() / 2)));
  std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir / "cut.gz"); });
  EXPECT_CONTAINS(msg, dir / "cut.gz");
  EXPECT_CONTAINS(msg, "gzip stream ends early");
  EXPECT_CONTAINS(msg, "promises 100000 data bytes");
  EXPECT_CONTAINS(msg, "found ");

  // All the data is there but the 8-byte trailer (CRC, length) is missing.
  write_raw(dir / "no_trailer.gz", Bytes(gz.begin(), gz.end() - 8));
  msg = message_of<std::invalid_argument>([&] { read_idx(dir / "no_trailer.gz"); });
  EXPECT_CONTAINS(msg, dir / "no_trailer.gz");
  EXPECT_CONTAINS(msg, "truncated");
}

TEST(ReadIdx, CorruptGzipStream) {
  TempDir dir;
  const Bytes payload = noise_bytes(50'000);
  write_gz(dir / "good.gz", idx_bytes(0x08, {50'000}, payload));
  Bytes gz = read_all(dir / "good.gz");

  // Incompressible data is stored verbatim, so this flip changes one data byte and only the
  // CRC check at the end of the stream can notice.
  Bytes flipped = gz;
  flipped[gz.size() / 2] ^= 0x5A;
  write_raw(dir / "flipped.gz", flipped);
  std::string msg = message_of<std::invalid_argument>([&] { read_idx(dir / "flipped.gz"); });
  EXPECT_CONTAINS(msg, dir / "flipped.gz");
  EXPECT_CONTAINS(msg, "corrupt gzip stream");

  // A gzip magic followed by garbage.
  Bytes garbage = {0x1f, 0x8b, 0x99, 0x99, 0x99, 0x99, 0x99, 0x99, 0x99, 0x99, 0x99, 0x99};
  write_raw(dir / "garbage.gz", garbage);
  msg = message_of<std::invalid_argument>([&] { read_idx(dir / "garbage.gz"); });
  EXPECT_CONTAINS(msg, dir / "garbage.gz");
  EXPECT_CONTAINS(msg, "corrupt gzip stream");
}

// ---------------------------------------------------------------------------------------------
// Fashion-MNIST files

struct FakeSet {
  Bytes train_images, train_labels, test_images, test_labels;
};

// Writes the four files into dir; gz_mask bit i makes file i gzip with a .gz suffix.
FakeSet write_fashion(const std::string& dir, uint32_t n_train, uint32_t n_test, uint32_t h = 4,
                      uint32_t w = 3, unsigned gz_mask = 0) {
  fs::create_directories(dir);
  FakeSet s;
  s.train_images = iota_bytes(size_t{n_train} * h * w, 1);
  s.train_labels = iota_bytes(n_train, 0);
  s.test_images = iota_bytes(size_t{n_test} * h * w, 100);
  s.test_labels = iota_bytes(n_test, 5);
  const Bytes files[4] = {idx_bytes(0x08, {n_train, h, w}, s.train_images),
                          idx_bytes(0x08, {n_train}, s.train_labels),
                          idx_bytes(0x08, {n_test, h, w}, s.test_images),
                          idx_bytes(0x08, {n_test}, s.test_labels)};
  for (size_t i = 0; i < 4; ++i) {
    const std::string base = (fs::path(dir) / kFashionMnistFiles[i]).string();
    if (gz_mask & (1u << i)) {
      write_gz(base + ".gz", files[i]);
    } else {
      write_raw(base, files[i]);
    }
  }
  return s;
}

TEST(FashionMnistFiles, SearchDirsOrder) {
  TempDir home;
  EnvVar h("HOME", home.path());
  {
    EnvVar d("MGPU_DATA", "/somewhere/data");
    EXPECT_EQ(fashion_mnist_search_dirs(""),
              (std::vector<std::string>{"/somewhere/data", home / ".mgpu/data",
                                        "/usr/share/datasets/fashion-mnist"}));
    EXPECT_EQ(fashion_mnist_search_dirs("/explicit"), (std::vector<std::string>{"/explicit"}));
  }
  {
    EnvVar d("MGPU_DATA", "");
    EXPECT_EQ(fashion_mnist_search_dirs(""),
              (std::vector<std::string>{home / ".mgpu/data", "/usr/share/datasets/fashion-mnist"}));
  }
  {
    EnvVar d("MGPU_DATA", std::nullopt);
    EnvVar no_home("HOME", std::nullopt);
    EXPECT_EQ(fashion_mnist_search_dirs(""),
              (std::vector<std::string>{"/usr/share/datasets/fashion-mnist"}));
  }
}

TEST(FashionMnistFiles, ExplicitDirWins) {
  TempDir tmp;
  write_fashion(tmp / "explicit", 2, 1);
  write_fashion(tmp / "env", 2, 1);
  write_fashion(tmp / "home/.mgpu/data", 2, 1);
  EnvVar h("HOME", tmp / "home");
  EnvVar d("MGPU_DATA", tmp / "env");
  EXPECT_EQ(find_fashion_mnist(tmp / "explicit"), tmp / "explicit");
}

TEST(FashionMnistFiles, ExplicitDirIsTheOnlyOneSearched) {
  TempDir tmp;
  fs::create_directories(tmp / "explicit");
  write_raw(tmp / "explicit/train-images-idx3-ubyte", idx_bytes(0x08, {1, 1, 1}, {0}));
  write_fashion(tmp / "env", 2, 1);
  EnvVar d("MGPU_DATA", tmp / "env");
  const std::string msg =
      message_of<DataNotFoundError>([&] { find_fashion_mnist(tmp / "explicit"); });
  EXPECT_CONTAINS(msg, tmp / "explicit");
  EXPECT_CONTAINS(msg, "missing train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], "
                       "t10k-labels-idx1-ubyte[.gz]");
  EXPECT_EQ(msg.find(tmp / "env"), std::string::npos) << msg;
  EXPECT_CONTAINS(msg, "apt-get install dataset-fashion-mnist");
  EXPECT_CONTAINS(msg, "/usr/share/datasets/fashion-mnist");
  EXPECT_CONTAINS(msg, "data_dir=");
  EXPECT_CONTAINS(msg, "MGPU_DATA");

  const std::string none = tmp / "does-not-exist";
  EXPECT_CONTAINS(message_of<DataNotFoundError>([&] { find_fashion_mnist(none); }),
                  none + "  (data_dir: no such directory)");
}

TEST(FashionMnistFiles, MgpuDataBeforeHome) {
  TempDir tmp;
  write_fashion(tmp / "env", 2, 1);
  write_fashion(tmp / "home/.mgpu/data", 2, 1);
  EnvVar h("HOME", tmp / "home");
  EnvVar d("MGPU_DATA", tmp / "env");
  EXPECT_EQ(find_fashion_mnist(""), tmp / "env");
}

TEST(FashionMnistFiles, HomeWhenMgpuDataUnsetOrIncomplete) {
  TempDir tmp;
  write_fashion(tmp / "home/.mgpu/data", 2, 1);
  EnvVar h("HOME", tmp / "home");
  {
    EnvVar d("MGPU_DATA", std::nullopt);
    EXPECT_EQ(find_fashion_mnist(""), tmp / "home/.mgpu/data");
  }
  {
    fs::create_directories(tmp / "env");  // exists but empty: skipped
    EnvVar d("MGPU_DATA", tmp / "env");
    EXPECT_EQ(find_fashion_mnist(""), tmp / "home/.mgpu/data");
  }
}

TEST(FashionMnistFiles, FallsBackToSystemDir) {
  if (!system_dir_has_data()) GTEST_SKIP() << kSystemFashionMnistDir << " is not installed";
  TempDir tmp;
  EnvVar h("HOME", tmp / "home");
  EnvVar d("MGPU_DATA", tmp / "env");
  EXPECT_EQ(find_fashion_mnist(""), kSystemFashionMnistDir);
}

TEST(FashionMnistFiles, NotFoundAnywhereListsEveryDir) {
  if (system_dir_has_data()) {
    GTEST_SKIP() << kSystemFashionMnistDir << " holds the data, so the search cannot fail";
  }
  TempDir tmp;
  EnvVar h("HOME", tmp / "home");
  EnvVar d("MGPU_DATA", tmp / "env");
  const std::string msg = message_of<DataNotFoundError>([&] { find_fashion_mnist(""); });
  EXPECT_CONTAINS(msg, tmp / "env" + "  (MGPU_DATA: no such directory)");
  EXPECT_CONTAINS(msg, tmp / "home/.mgpu/data" + "  (~/.mgpu/data: no such directory)");
  EXPECT_CONTAINS(msg, std::string(kSystemFashionMnistDir) + "  (Debian's dataset-fashion-mnist: ");
  EXPECT_CONTAINS(msg, "1. `apt-get install dataset-fashion-mnist`");
  EXPECT_CONTAINS(msg, "2. put the four IDX files");
}

TEST(FashionMnistFiles, LoadMixedRawAndGzip) {
  TempDir tmp;
  // Both a raw and a .gz train-labels: the raw one is read.
  const FakeSet s = write_fashion(tmp / "d", 5, 3, 4, 3, /*gz_mask=*/0b0101);
  write_gz(tmp / "d/train-labels-idx1-ubyte.gz", idx_bytes(0x08, {1}, {77}));
  ASSERT_EQ(find_fashion_mnist(tmp / "d"), tmp / "d");
  const FashionMnist fm = load_fashion_mnist(tmp / "d");
  EXPECT_EQ(fm.train_images.dims, (std::vector<int64_t>{5, 4, 3}));
  EXPECT_EQ(fm.train_labels.dims, (std::vector<int64_t>{5}));
  EXPECT_EQ(fm.test_images.dims, (std::vector<int64_t>{3, 4, 3}));
  EXPECT_EQ(fm.test_labels.dims, (std::vector<int64_t>{3}));
  EXPECT_EQ(fm.train_images.data, s.train_images);
  EXPECT_EQ(fm.train_labels.data, s.train_labels);
  EXPECT_EQ(fm.test_images.data, s.test_images);
  EXPECT_EQ(fm.test_labels.data, s.test_labels);
}

TEST(FashionMnistFiles, LoadMissingFileIsDataNotFound) {
  TempDir tmp;
  write_fashion(tmp / "d", 2, 1);
  fs::remove(tmp / "d/t10k-labels-idx1-ubyte");
  const std::string msg = message_of<DataNotFoundError>([&] { load_fashion_mnist(tmp / "d"); });
  EXPECT_CONTAINS(msg, "t10k-labels-idx1-ubyte.gz");
  EXPECT_CONTAINS(msg, tmp / "d");
  EXPECT_CONTAINS(message_of<DataNotFoundError>([&] { load_fashion_mnist(tmp / "nope"); }),
                  tmp / "nope");
}

TEST(FashionMnistFiles, LoadRejectsMismatchedCounts) {
  TempDir tmp;
  write_fashion(tmp / "d", 4, 2);
  write_raw(tmp / "d/train-labels-idx1-ubyte", idx_bytes(0x08, {3}, {1, 2, 3}));
  const std::string msg =
      message_of<std::invalid_argument>([&] { load_fashion_mnist(tmp / "d"); });
  EXPECT_CONTAINS(msg, "train-images-idx3-ubyte");
  EXPECT_CONTAINS(msg, "train-labels-idx1-ubyte");
  EXPECT_CONTAINS(msg, "4 images");
  EXPECT_CONTAINS(msg, "3 labels");
}

TEST(FashionMnistFiles, LoadRejectsWrongRanks) {
  TempDir tmp;
  write_fashion(tmp / "d", 4, 2);
  write_raw(tmp / "d/t10k-labels-idx1-ubyte", idx_bytes(0x08, {2, 1}, {1, 2}));
  std::string msg = message_of<std::invalid_argument>([&] { load_fashion_mnist(tmp / "d"); });
  EXPECT_CONTAINS(msg, "t10k-labels-idx1-ubyte");
  EXPECT_CONTAINS(msg, "(N,), got (2, 1)");

  write_fashion(tmp / "e", 4, 2);
  write_raw(tmp / "e/train-images-idx3-ubyte", idx_bytes(0x08, {4, 12}, iota_bytes(48)));
  msg = message_of<std::invalid_argument>([&] { load_fashion_mnist(tmp / "e"); });
  EXPECT_CONTAINS(msg, "train-images-idx3-ubyte");
  EXPECT_CONTAINS(msg, "(N, H, W), got (4, 12)");
}

TEST(FashionMnistFiles, LoadRejectsDifferentImageSizes) {
  TempDir tmp;
  write_fashion(tmp / "d", 4, 2, 4, 3);
  write_raw(tmp / "d/t10k-images-idx3-ubyte", idx_bytes(0x08, {2, 3, 4}, iota_bytes(24)));
  const std::string msg =
      message_of<std::invalid_argument>([&] { load_fashion_mnist(tmp / "d"); });
  EXPECT_CONTAINS(msg, "4x3");
  EXPECT_CONTAINS(msg, "3x4");
}

TEST(FashionMnistFiles, LoadPropagatesBrokenFile) {
  TempDir tmp;
  write_fashion(tmp / "d", 4, 2);
  write_raw(tmp / "d/t10k-images-idx3-ubyte", idx_bytes(0x08, {2, 4, 3}, iota_bytes(5)));
  const std::string msg =
      message_of<std::invalid_argument>([&] { load_fashion_mnist(tmp / "d"); });
  EXPECT_CONTAINS(msg, tmp / "d/t10k-images-idx3-ubyte");
  EXPECT_CONTAINS(msg, "truncated");
}

TEST(FashionMnistFiles, RealDataset) {
  if (!system_dir_has_data()) GTEST_SKIP() << kSystemFashionMnistDir << " is not installed";
  const FashionMnist fm = load_fashion_mnist(kSystemFashionMnistDir);
  EXPECT_EQ(fm.train_images.dims, (std::vector<int64_t>{60000, 28, 28}));
  EXPECT_EQ(fm.train_labels.dims, (std::vector<int64_t>{60000}));
  EXPECT_EQ(fm.test_images.dims, (std::vector<int64_t>{10000, 28, 28}));
  EXPECT_EQ(fm.test_labels.dims, (std::vector<int64_t>{10000}));
  for (const IdxArray* labels : {&fm.train_labels, &fm.test_labels}) {
    std::vector<int64_t> counts(256, 0);
    for (uint8_t v : labels->data) ++counts[v];
    for (int c = 0; c < 10; ++c) EXPECT_GT(counts[static_cast<size_t>(c)], 0) << "class " << c;
    EXPECT_EQ(std::count(counts.begin() + 10, counts.end(), 0), 246) << "labels beyond 9";
  }
  // Fashion-MNIST is balanced: 6000 and 1000 per class.
  std::vector<int64_t> train_counts(10, 0);
  for (uint8_t v : fm.train_labels.data) ++train_counts[v];
  EXPECT_EQ(train_counts, std::vector<int64_t>(10, 6000));
}

}  // namespace
}  // namespace mgpu::data
