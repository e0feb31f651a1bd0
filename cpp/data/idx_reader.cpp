// cpp/data/idx_reader.cpp -- IDX parsing (raw through stdio, gzip through zlib's gz* API) and the
// Fashion-MNIST directory search. Every failure names the file, says what is wrong with it and
// what to do; nothing here prints or exits.
#include "data/idx_reader.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <sstream>
#include <system_error>
#include <utility>

#include "core/error.h"

namespace mgpu::data {
namespace {

namespace fs = std::filesystem;

constexpr uint8_t kTypeUByte = 0x08;

const char* const kHowToGet =
    "To get Fashion-MNIST, either:\n"
    "  1. `apt-get install dataset-fashion-mnist` (Debian's package: the files go to "
    "/usr/share/datasets/fashion-mnist, searched by default), or\n"
    "  2. put the four IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, "
    "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each raw or .gz) in a folder and set "
    "MGPU_DATA to it (or pass data_dir=, or use ~/.mgpu/data).";

using ::mgpu::detail::cat;  // message building shared with the engine (core/error.h)

std::string shape_str(const std::vector<int64_t>& dims) { return cat(dims); }

std::string hex_byte(unsigned v) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "0x%02X", v & 0xFFu);
  return buf;
}

const char* idx_type_name(uint8_t code) {
  switch (code) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return nullptr;
  }
}

[[noreturn]] void fail_invalid(const std::string& path, const std::string& what) {
  throw std::invalid_argument(cat("read_idx: '", path, "' ", what));
}

// One reader over a raw file (stdio) or a gzip file (zlib), so the parser has one code path while
// errors still say which of the two went wrong. Gzip is decided by the content's magic because
// people rename files; zlib's transparent mode would read a raw file too, but then a raw file's
// problems would be worded as gzip problems.
class ByteSource {
 public:
  explicit ByteSource(const std::string& path) : path_(path) {
    std::error_code ec;
    if (fs::is_directory(path, ec)) {
      fail_invalid(path, "is a directory, not an IDX file; pass the path of the file itself");
    }
    file_ = std::fopen(path.c_str(), "rb");
    if (!file_) {
      const int err = errno;
      if (err == ENOENT || err == ENOTDIR) {
        throw DataNotFoundError(cat("read_idx: '", path, "' does not exist; check the path"));
      }
      throw std::runtime_error(cat("read_idx: cannot open '", path, "': ", std::strerror(err),
                                   "; check its permissions"));
    }
    unsigned char magic[2] = {0, 0};
    const size_t got = std::fread(magic, 1, 2, file_);
    gzipped_ = got == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
    if (gzipped_) {
      std::fclose(file_);
      file_ = nullptr;
      gz_ = gzopen(path.c_str(), "rb");
      if (!gz_) {
        throw std::runtime_error(cat("read_idx: cannot open gzip file '", path, "': ",
                                     std::strerror(errno), "; check its permissions"));
      }
      // The default 8 KiB buffer makes the 26 MB training images noticeably slower to inflate.
      gzbuffer(gz_, 1u << 17);
    } else {
      std::rewind(file_);
      std::error_code size_ec;
      const auto size = fs::file_size(path, size_ec);
      raw_size_ = size_ec ? -1 : static_cast<int64_t>(size);
    }
  }

  ByteSource(const ByteSource&) = delete;
  ByteSource& operator=(const ByteSource&) = delete;

  ~ByteSource() {
    if (file_) std::fclose(file_);
    if (gz_) gzclose(gz_);
  }

  bool gzipped() const { return gzipped_; }

  // Size of a raw file, known before reading so a lying header cannot make us allocate; -1 for
  // gzip (or when the size cannot be queried).
  int64_t raw_size() const { return raw_size_; }

  // True once the gzip stream has ended before its end-of-stream marker: the .gz file was cut.
  bool stream_cut() const { return stream_cut_; }

  // Reads up to n bytes; fewer only at the end of the data (or where a cut gzip stream ends).
  size_t read(uint8_t* dst, size_t n) {
    if (!gzipped_) {
      const size_t got = std::fread(dst, 1, n, file_);
      if (got < n && std::ferror(file_)) {
        throw std::runtime_error(
            cat("read_idx: error reading '", path_, "': ", std::strerror(errno)));
      }
      return got;
    }
    size_t total = 0;
    while (total < n) {
      // gzread counts in unsigned int.
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - total, 1u << 30));
      const int got = gzread(gz_, dst + total, chunk);
      int errnum = Z_OK;
      const char* msg = gzerror(gz_, &errnum);
      if (errnum == Z_BUF_ERROR) {
        stream_cut_ = true;
        return total + static_cast<size_t>(std::max(got, 0));
      }
      if (got < 0 || (errnum != Z_OK && errnum != Z_STREAM_END)) {
        if (errnum == Z_ERRNO) {
          throw std::runtime_error(
              cat("read_idx: error reading '", path_, "': ", std::strerror(errno)));
        }
        // gzerror prefixes its text with the path, which our message already starts with.
        std::string detail = msg ? msg : "unknown error";
        if (detail.rfind(path_ + ": ", 0) == 0) detail.erase(0, path_.size() + 2);
        fail_invalid(path_, cat("is a corrupt gzip stream (zlib: ", detail,
                                "); download the file again"));
      }
      total += static_cast<size_t>(got);
      if (static_cast<unsigned>(got) < chunk) break;
    }
    return total;
  }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  gzFile gz_ = nullptr;
  bool gzipped_ = false;
  bool stream_cut_ = false;
  int64_t raw_size_ = -1;
};

bool file_exists(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// The raw file if present (no inflating), else the .gz one, else "".
std::string resolve_file(const std::string& dir, const char* base) {
  const fs::path raw = fs::path(dir) / base;
  if (file_exists(raw)) return raw.string();
  fs::path gz = raw;
  gz += ".gz";
  if (file_exists(gz)) return gz.string();
  return "";
}

// Why dir does not qualify, or "" if it does.
std::string why_not_qualified(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return "no such directory";
  std::string missing;
  for (const char* base : kFashionMnistFiles) {
    if (resolve_file(dir, base).empty()) missing += cat(missing.empty() ? "" : ", ", base, "[.gz]");
  }
  return missing.empty() ? "" : "missing " + missing;
}

}  // namespace

IdxArray read_idx(const std::string& path) {
  ByteSource src(path);
  const char* const redownload = src.gzipped() ? "; download the file again"
                                               : "; download the file again (raw or .gz)";

  uint8_t head[4] = {0, 0, 0, 0};
  const size_t head_got = src.read(head, 4);
  if (head_got < 4) {
    fail_invalid(path, cat("is too short to be an IDX file: it holds ", head_got,
                           " bytes, but the IDX header alone needs at least 4", redownload));
  }
  if (head[0] != 0 || head[1] != 0) {
    fail_invalid(path, cat("is not an IDX file: it starts with ", hex_byte(head[0]), ' ',
                           hex_byte(head[1]), ' ', hex_byte(head[2]), ' ', hex_byte(head[3]),
                           ", but an IDX file starts with 0x00 0x00 <type> <ndims>; pass one of "
                           "the *-idx?-ubyte files (raw or gzip)"));
  }
  if (head[2] != kTypeUByte) {
    const char* name = idx_type_name(head[2]);
    fail_invalid(path, name ? cat("holds IDX type ", hex_byte(head[2]), " (", name,
                                  "), which is not supported: mgpu reads only type 0x08 "
                                  "(unsigned byte), which Fashion-MNIST uses")
                            : cat("has IDX type code ", hex_byte(head[2]),
                                  ", which is not a valid IDX type (valid: 0x08, 0x09, 0x0B-0x0E; "
                                  "mgpu reads 0x08); the file is corrupt or not IDX"));
  }
  const int ndims = head[3];
  if (ndims == 0) fail_invalid(path, "declares 0 dimensions; an IDX array needs at least 1");

  std::vector<uint8_t> dim_bytes(static_cast<size_t>(4 * ndims));
  const size_t dims_got = src.read(dim_bytes.data(), dim_bytes.size());
  if (dims_got < dim_bytes.size()) {
    fail_invalid(path, cat("is truncated inside its header: ", ndims, " dimensions need ",
                           dim_bytes.size(), " size bytes, found ", dims_got, redownload));
  }

  IdxArray out;
  out.dims.resize(static_cast<size_t>(ndims));
  // 2^48 bytes is far beyond any real IDX file; the cap keeps the product from overflowing.
  constexpr int64_t kMaxBytes = int64_t{1} << 48;
  int64_t expected = 1;
  for (int i = 0; i < ndims; ++i) {
    const uint8_t* b = &dim_bytes[static_cast<size_t>(4 * i)];
    const uint32_t d = (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) |
                       uint32_t{b[3]};
    out.dims[static_cast<size_t>(i)] = d;
    if (d != 0 && expected > kMaxBytes / d) {
      fail_invalid(path, cat("declares dims whose product exceeds 2^48 bytes; the header is "
                             "corrupt", redownload));
    }
    expected *= d;
  }
  const int64_t header_bytes = 4 + 4 * int64_t{ndims};
  const std::string promise = cat(expected, " data bytes for shape ", shape_str(out.dims));

  if (src.raw_size() >= 0) {
    // Raw file: its size settles truncation before we allocate what the header claims.
    const int64_t found = src.raw_size() - header_bytes;
    if (found < expected) {
      fail_invalid(path, cat("is truncated: its header promises ", promise, ", found ", found,
                             redownload));
    }
    if (found > expected) {
      fail_invalid(path, cat("has ", found - expected, " bytes after the ", promise,
                             " its header promises; the file is corrupt or not what its "
                             "header says", redownload));
    }
  }

  // A gzip stream's size is unknown until inflated, so grow in chunks rather than trusting the
  // header with one allocation; reserving up to 64 MiB covers Fashion-MNIST in one go.
  constexpr int64_t kChunk = int64_t{1} << 22;
  out.data.reserve(static_cast<size_t>(std::min<int64_t>(expected, int64_t{1} << 26)));
  int64_t have = 0;
  while (have < expected) {
    const int64_t want = std::min(kChunk, expected - have);
    out.data.resize(static_cast<size_t>(have + want));
    const size_t got = src.read(out.data.data() + have, static_cast<size_t>(want));
    have += static_cast<int64_t>(got);
    if (static_cast<int64_t>(got) < want) break;
  }
  if (have < expected) {
    out.data.clear();
    out.data.shrink_to_fit();
    if (src.stream_cut()) {
      fail_invalid(path, cat("is truncated: the gzip stream ends early (the .gz file is cut "
                             "short); its header promises ", promise, ", found ", have,
                             redownload));
    }
    fail_invalid(path, cat("is truncated: its header promises ", promise, ", found ", have,
                           redownload));
  }

  // Reading past the data also makes zlib check the gzip trailer (CRC and length), which it
  // only does at the end of the stream.
  uint8_t extra[1];
  if (src.read(extra, 1) != 0) {
    fail_invalid(path, cat("decompresses to more than the ", promise,
                           " its header promises; the file is corrupt or not what its header "
                           "says", redownload));
  }
  if (src.stream_cut()) {
    fail_invalid(path, cat("is truncated: the gzip stream ends before its trailer (the .gz file "
                           "is cut short), so its checksum cannot be verified", redownload));
  }
  return out;
}

std::vector<std::string> fashion_mnist_search_dirs(const std::string& explicit_dir) {
  if (!explicit_dir.empty()) return {explicit_dir};
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("MGPU_DATA"); env && *env) dirs.emplace_back(env);
  if (const char* home = std::getenv("HOME"); home && *home) {
    dirs.push_back((fs::path(home) / ".mgpu" / "data").string());
  }
  dirs.emplace_back(kSystemFashionMnistDir);
  return dirs;
}

std::string find_fashion_mnist(const std::string& explicit_dir) {
  std::string tried;
  const char* home = std::getenv("HOME");
  const char* env = std::getenv("MGPU_DATA");
  const std::vector<std::string> dirs = fashion_mnist_search_dirs(explicit_dir);
  for (size_t i = 0; i < dirs.size(); ++i) {
    const std::string& dir = dirs[i];
    const std::string why = why_not_qualified(dir);
    if (why.empty()) return dir;
    // Say where ~/.mgpu/data would have been tried (just before the system directory, which is
    // always last), so the list reads in search order.
    if (explicit_dir.empty() && i + 1 == dirs.size() && (!home || !*home)) {
      tried += "\n  ~/.mgpu/data  (skipped: HOME is not set)";
    }
    // Which setting named the directory: the explicit one, $MGPU_DATA (first when set), the
    // home folder (before the last), or Debian's (always last).
    const char* source = !explicit_dir.empty()            ? "data_dir"
                         : i == 0 && env && *env          ? "MGPU_DATA"
                         : i + 1 == dirs.size()           ? "Debian's dataset-fashion-mnist"
                                                          : "~/.mgpu/data";
    tried += cat("\n  ", dir, "  (", source, ": ", why, ")");
  }
  if (explicit_dir.empty() && !(env && *env)) tried = "\n  MGPU_DATA  (not set)" + tried;
  throw DataNotFoundError(cat("find_fashion_mnist: Fashion-MNIST not found. Searched:", tried,
                              "\n", kHowToGet));
}

FashionMnist load_fashion_mnist(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw DataNotFoundError(
        cat("load_fashion_mnist: '", dir, "' is not a directory. ", kHowToGet));
  }
  std::array<std::string, 4> paths;
  for (size_t i = 0; i < paths.size(); ++i) {
    paths[i] = resolve_file(dir, kFashionMnistFiles[i]);
    if (paths[i].empty()) {
      throw DataNotFoundError(cat("load_fashion_mnist: '", dir, "' has neither ",
                                  kFashionMnistFiles[i], " nor ", kFashionMnistFiles[i], ".gz. ",
                                  kHowToGet));
    }
  }

  // Inflating the training images dominates; reading the four files at once overlaps it with
  // the rest. get() in file order rethrows the first file's error.
  std::array<std::future<IdxArray>, 4> pending;
  for (size_t i = 0; i < paths.size(); ++i) {
    pending[i] = std::async(std::launch::async, read_idx, paths[i]);
  }
  FashionMnist fm;
  IdxArray* slots[4] = {&fm.train_images, &fm.train_labels, &fm.test_images, &fm.test_labels};
  for (size_t i = 0; i < paths.size(); ++i) *slots[i] = pending[i].get();

  auto check_pair = [](const IdxArray& images, const std::string& images_path,
                       const IdxArray& labels, const std::string& labels_path) {
    if (images.dims.size() != 3) {
      throw std::invalid_argument(
          cat("load_fashion_mnist: '", images_path, "' must hold images of shape (N, H, W), got ",
              shape_str(images.dims), "; it is not an images file"));
    }
    if (labels.dims.size() != 1) {
      throw std::invalid_argument(
          cat("load_fashion_mnist: '", labels_path, "' must hold labels of shape (N,), got ",
              shape_str(labels.dims), "; it is not a labels file"));
    }
    if (images.dims[0] != labels.dims[0]) {
      throw std::invalid_argument(cat("load_fashion_mnist: '", images_path, "' holds ",
                                      images.dims[0], " images but '", labels_path, "' holds ",
                                      labels.dims[0],
                                      " labels; the two files come from different sets"));
    }
  };
  check_pair(fm.train_images, paths[0], fm.train_labels, paths[1]);
  check_pair(fm.test_images, paths[2], fm.test_labels, paths[3]);
  if (fm.train_images.dims[1] != fm.test_images.dims[1] ||
      fm.train_images.dims[2] != fm.test_images.dims[2]) {
    throw std::invalid_argument(cat(
        "load_fashion_mnist: '", paths[0], "' holds ", fm.train_images.dims[1], "x",
        fm.train_images.dims[2], " images but '", paths[2], "' holds ", fm.test_images.dims[1],
        "x", fm.test_images.dims[2], " images; the two files come from different sets"));
  }
  return fm;
}

}  // namespace mgpu::data
