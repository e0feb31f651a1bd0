// cpp/data/batch_iterator.cpp -- the seeded shuffle (splitmix64 -> xoshiro256** -> Fisher-Yates,
// written out so every platform shuffles alike) and the prefetching iterator: one worker thread
// fills the next batch into recycled buffers while the consumer holds the current one.
#include "data/batch_iterator.h"

#include <algorithm>
#include <array>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "core/parallel.h"
#include "core/trace.h"
#include "core/error.h"

namespace mgpu::data {
namespace {

using ::mgpu::detail::cat;  // message building shared with the engine (core/error.h)

std::string shape_str(const std::vector<int64_t>& dims) { return cat(dims); }

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

class Xoshiro256 {
 public:
  // splitmix64 is a bijection on distinct successive states, so at most one of the four words
  // can be zero and the all-zero state xoshiro must avoid cannot occur.
  explicit Xoshiro256(uint64_t seed) {
    for (uint64_t& word : s_) word = splitmix64(seed);
  }

  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

  // Uniform in [0, bound), bound >= 1. Plain `next() % bound` favours small values; rejecting the
  // 2^64 mod bound lowest draws leaves a range that is an exact multiple of bound. Lemire's
  // multiply trick would be faster but needs a 128-bit product, not portable C++.
  uint64_t below(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      const uint64_t r = next();
      if (r >= threshold) return r % bound;
    }
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::array<uint64_t, 4> s_{};
};

// pixel / 255.0f for every byte, so batches hold exactly the value the chapter's ToTensor gives
// (multiplying by 1/255 would round differently for some pixels).
const std::array<float, 256>& pixel_scale() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int k = 0; k < 256; ++k) t[static_cast<size_t>(k)] = static_cast<float>(k) / 255.0f;
    return t;
  }();
  return table;
}

// A few recycled batch buffers. A buffer is handed out inside a shared_ptr whose deleter returns
// it here, so it is reused only after its last holder lets go: the consumer may keep any batch
// as long as it likes. The deleter keeps the pool alive, so batches may outlive the iterator.
template <typename T>
class BufferPool : public std::enable_shared_from_this<BufferPool<T>> {
 public:
  // One batch held by the consumer, one ready, one being filled, one spare.
  static constexpr size_t kKeep = 4;

  BufferPool() { free_.reserve(kKeep); }  // so give_back never allocates

  std::shared_ptr<std::vector<T>> acquire(size_t n) {
    std::unique_ptr<std::vector<T>> buf;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        buf = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!buf) buf = std::make_unique<std::vector<T>>();
    buf->resize(n);
    auto self = this->shared_from_this();
    // If this constructor throws it calls the deleter, so the buffer is not lost.
    return std::shared_ptr<std::vector<T>>(buf.release(),
                                           [self](std::vector<T>* p) { self->give_back(p); });
  }

 private:
  void give_back(std::vector<T>* p) noexcept {
    std::unique_ptr<std::vector<T>> buf(p);
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.size() < kKeep) free_.push_back(std::move(buf));
  }

  std::mutex mutex_;
  std::vector<std::unique_ptr<std::vector<T>>> free_;
};

}  // namespace

std::vector<int64_t> epoch_order(int64_t n, bool shuffle, uint64_t seed, int64_t epoch) {
  if (n < 0) throw std::invalid_argument(cat("epoch_order: n must be >= 0, got ", n));
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  if (!shuffle) return order;
  // Hash the seed before mixing in the epoch so nearby seeds and nearby epochs do not give
  // related streams.
  uint64_t state = seed;
  Xoshiro256 rng(splitmix64(state) ^ static_cast<uint64_t>(epoch));
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i) + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

struct BatchIterator::Impl {
  // Fixed at construction; the worker reads them without the lock.
  std::shared_ptr<const IdxArray> images, labels;
  int64_t n = 0, height = 0, width = 0;
  int64_t batch_size = 0;
  bool shuffle = false;
  uint64_t seed = 0;
  int64_t num_batches = 0;
  int64_t examples_per_epoch = 0;
  std::shared_ptr<BufferPool<float>> image_pool = std::make_shared<BufferPool<float>>();
  std::shared_ptr<BufferPool<int64_t>> label_pool = std::make_shared<BufferPool<int64_t>>();

  std::mutex mutex;
  std::condition_variable cv;
  // Guarded by mutex.
  bool stop = false;
  int64_t epoch = -1;
  // Bumped by every start_epoch, so a batch the worker was building for an abandoned epoch is
  // recognised and dropped when it comes back.
  uint64_t generation = 0;
  int64_t produced = 0;  // batches of this epoch put into `ready`
  int64_t consumed = 0;  // batches of this epoch taken by next()
  std::optional<Batch> ready;
  std::exception_ptr error;
  int64_t fail_at = -1;

  std::thread worker;

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    cv.notify_all();
    if (worker.joinable()) worker.join();
  }

  void start_locked(int64_t e, int64_t first_batch = 0) {
    ++generation;
    epoch = e;
    produced = first_batch;
    consumed = first_batch;
    ready.reset();
    error = nullptr;
    cv.notify_all();
  }

  Batch make_batch(const std::vector<int64_t>& order, int64_t index, int64_t e) const {
    const int64_t begin = index * batch_size;
    const int64_t count = std::min(batch_size, n - begin);
    const int64_t hw = height * width;
    Batch out;
    out.size = count;
    out.height = height;
    out.width = width;
    out.index = index;
    out.epoch = e;
    out.images = image_pool->acquire(static_cast<size_t>(count * hw));
    out.labels = label_pool->acquire(static_cast<size_t>(count));
    const std::array<float, 256>& scale = pixel_scale();
    const uint8_t* pixels = images->data.data();
    const uint8_t* classes = labels->data.data();
    float* dst = out.images->data();
    int64_t* label_dst = out.labels->data();
    for (int64_t j = 0; j < count; ++j) {
      const int64_t example = order[static_cast<size_t>(begin + j)];
      const uint8_t* src = pixels + example * hw;
      float* row = dst + j * hw;
      for (int64_t k = 0; k < hw; ++k) row[k] = scale[src[k]];
      label_dst[j] = classes[example];
    }
    return out;
  }

  void run() {
    block_async_signals();
    trace::set_thread_track("data loader");
    std::vector<int64_t> order;
    uint64_t order_generation = 0;  // generations start at 1, so the first epoch computes it
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      cv.wait(lock, [this] {
        return stop || (epoch >= 0 && !ready && !error && produced < num_batches);
      });
      if (stop) return;
      const uint64_t gen = generation;
      const int64_t e = epoch;
      const int64_t index = produced;
      const bool inject = index == fail_at;
      lock.unlock();

      std::optional<Batch> batch;
      std::exception_ptr failure;
      try {
        if (inject) {
          throw std::runtime_error(
              cat("BatchIterator: failure injected at batch ", index, " for testing"));
        }
        if (order_generation != gen) {
          order = epoch_order(n, shuffle, seed, e);
          order_generation = gen;
        }
        trace::Span span("load batch");
        batch = make_batch(order, index, e);
      } catch (...) {
        failure = std::current_exception();
      }

      lock.lock();
      if (gen != generation) continue;  // the epoch was restarted meanwhile
      if (failure) {
        error = failure;
      } else {
        ready = std::move(batch);
        ++produced;
      }
      cv.notify_all();
    }
  }
};

BatchIterator::BatchIterator(std::shared_ptr<const IdxArray> images,
                             std::shared_ptr<const IdxArray> labels, int64_t batch_size,
                             bool shuffle, uint64_t seed, bool drop_last, int64_t limit_batches)
    : impl_(std::make_unique<Impl>()) {
  if (!images || !labels) {
    throw std::invalid_argument("BatchIterator: images and labels must not be null");
  }
  if (images->dims.size() != 3) {
    throw std::invalid_argument(cat("BatchIterator: images must have shape (N, H, W), got ",
                                    shape_str(images->dims),
                                    "; pass an images file such as train-images-idx3-ubyte"));
  }
  if (labels->dims.size() != 1) {
    throw std::invalid_argument(cat("BatchIterator: labels must have shape (N,), got ",
                                    shape_str(labels->dims),
                                    "; pass a labels file such as train-labels-idx1-ubyte"));
  }
  auto product = [](const std::vector<int64_t>& dims) {
    int64_t p = 1;
    for (int64_t d : dims) {
      if (d < 0) return int64_t{-1};
      p *= d;
    }
    return p;
  };
  if (images->numel() != product(images->dims) || labels->numel() != product(labels->dims)) {
    throw std::invalid_argument(
        "BatchIterator: an IdxArray's dims are negative or do not match its data size");
  }
  if (images->dims[0] != labels->dims[0]) {
    throw std::invalid_argument(cat("BatchIterator: ", images->dims[0], " images but ",
                                    labels->dims[0], " labels; they must come from the same set"));
  }
  if (batch_size < 1) {
    throw std::invalid_argument(cat("BatchIterator: batch_size must be >= 1, got ", batch_size));
  }
  if (limit_batches < 0) {
    throw std::invalid_argument(
        cat("BatchIterator: limit_batches must be >= 0 (0 means all), got ", limit_batches));
  }

  Impl& s = *impl_;
  s.images = std::move(images);
  s.labels = std::move(labels);
  s.n = s.images->dims[0];
  s.height = s.images->dims[1];
  s.width = s.images->dims[2];
  s.batch_size = batch_size;
  s.shuffle = shuffle;
  s.seed = seed;
  // Written without n + batch_size - 1, which overflows for huge batch sizes.
  const int64_t full = s.n / batch_size + (!drop_last && s.n % batch_size != 0 ? 1 : 0);
  s.num_batches = limit_batches > 0 ? std::min(limit_batches, full) : full;
  s.examples_per_epoch =
      (s.num_batches == full && !drop_last) ? s.n : s.num_batches * batch_size;
  s.worker = std::thread([impl = impl_.get()] { impl->run(); });
}

BatchIterator::~BatchIterator() = default;

void BatchIterator::start_epoch() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->start_locked(impl_->epoch + 1);
}

void BatchIterator::start_epoch(int64_t epoch) {
  if (epoch < 0) {
    throw std::invalid_argument(cat("BatchIterator.start_epoch: epoch must be >= 0, got ", epoch));
  }
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->start_locked(epoch);
}

void BatchIterator::start_epoch(int64_t epoch, int64_t first_batch) {
  if (epoch < 0) {
    throw std::invalid_argument(cat("BatchIterator.start_epoch: epoch must be >= 0, got ", epoch));
  }
  if (first_batch < 0 || first_batch > impl_->num_batches) {
    throw std::invalid_argument(cat("BatchIterator.start_epoch: first_batch must be in [0, ",
                                    impl_->num_batches, "] (batches per epoch), got ",
                                    first_batch));
  }
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->start_locked(epoch, first_batch);
}

bool BatchIterator::next(Batch& out) {
  Impl& s = *impl_;
  std::unique_lock<std::mutex> lock(s.mutex);
  if (s.epoch < 0) s.start_locked(0);
  if (s.error) std::rethrow_exception(s.error);
  if (s.consumed >= s.num_batches) return false;
  {
    trace::Span waiting("wait for data loader");
    s.cv.wait(lock, [&s] { return s.ready.has_value() || s.error; });
  }
  if (s.error) std::rethrow_exception(s.error);
  out = std::move(*s.ready);
  s.ready.reset();
  ++s.consumed;
  lock.unlock();
  s.cv.notify_all();
  return true;
}

int64_t BatchIterator::num_batches() const { return impl_->num_batches; }
int64_t BatchIterator::num_examples() const { return impl_->n; }
int64_t BatchIterator::examples_per_epoch() const { return impl_->examples_per_epoch; }
int64_t BatchIterator::batch_size() const { return impl_->batch_size; }
int64_t BatchIterator::height() const { return impl_->height; }
int64_t BatchIterator::width() const { return impl_->width; }
bool BatchIterator::shuffle() const { return impl_->shuffle; }
uint64_t BatchIterator::seed() const { return impl_->seed; }

int64_t BatchIterator::epoch() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->epoch;
}

void BatchIterator::fail_at_batch_for_testing(int64_t index) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->fail_at = index;
}

}  // namespace mgpu::data
