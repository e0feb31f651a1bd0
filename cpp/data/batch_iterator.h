// cpp/data/batch_iterator.h -- the chapter's training/test iterators: minibatches of images
// (B, 1, H, W) float32 in [0, 1] and labels (B,) int64, in a seeded per-epoch shuffle order, with
// the next batch prepared on a background thread while the caller trains on the current one.
// Depends only on idx_reader.h and the standard library.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "data/idx_reader.h"

namespace mgpu::data {

// One minibatch. The buffers belong to the batch: holding a Batch keeps them intact however far
// the iterator moves on, and dropping it returns them to the iterator's small pool for reuse.
struct Batch {
  std::shared_ptr<std::vector<float>> images;    // (size, 1, height, width), pixel / 255.0f
  std::shared_ptr<std::vector<int64_t>> labels;  // (size,)
  int64_t size = 0;
  int64_t height = 0;
  int64_t width = 0;
  int64_t index = 0;  // position within its epoch: 0 .. num_batches() - 1
  int64_t epoch = 0;

  std::vector<int64_t> image_shape() const { return {size, 1, height, width}; }
};

// The order in which an epoch visits examples 0..n-1: the identity without shuffle, else a
// Fisher-Yates shuffle driven by xoshiro256** seeded (through splitmix64) from (seed, epoch)
// alone, so it is the same on every platform and build. Exposed for tests and for callers that
// want to reproduce an epoch.
std::vector<int64_t> epoch_order(int64_t n, bool shuffle, uint64_t seed, int64_t epoch);

// Iterates minibatches over (images (N, H, W), labels (N,)). Epoch e visits epoch_order(N,
// shuffle, seed, e) in slices of batch_size; the last batch is smaller when batch_size does not
// divide N, unless drop_last. limit_batches > 0 stops each epoch after that many batches.
//
// One consumer thread calls start_epoch/next; a background thread stays one batch ahead of it.
// Errors raised while preparing a batch are rethrown by next(). Destruction stops the worker
// and joins it, also mid-epoch.
class BatchIterator {
 public:
  // Throws std::invalid_argument if the shapes do not fit or batch_size < 1 or limit_batches < 0.
  BatchIterator(std::shared_ptr<const IdxArray> images, std::shared_ptr<const IdxArray> labels,
                int64_t batch_size, bool shuffle, uint64_t seed, bool drop_last = false,
                int64_t limit_batches = 0);
  ~BatchIterator();
  BatchIterator(const BatchIterator&) = delete;
  BatchIterator& operator=(const BatchIterator&) = delete;

  // Starts the next epoch (0 first, then 1, 2, ...) and begins prefetching its first batch.
  // Calling it mid-epoch abandons the rest of the current epoch.
  void start_epoch();
  // Starts epoch e, e.g. to resume a run; later start_epoch() calls continue from e + 1.
  void start_epoch(int64_t epoch);
  // Starts epoch e at batch first_batch (0 <= first_batch <= num_batches()), the batches before
  // it skipped without being prepared: a checkpointed run resumes mid-epoch with the very
  // batches it would have seen. first_batch == num_batches() gives an epoch with no batches left.
  void start_epoch(int64_t epoch, int64_t first_batch);

  // Moves the next batch of the current epoch into out and returns true, or returns false when
  // the epoch is over (until the next start_epoch). The first call ever starts epoch 0 if
  // start_epoch was not called. Blocks only if the background thread is still preparing the
  // batch. Rethrows an error from the background thread, and again on every call until the
  // next start_epoch.
  bool next(Batch& out);

  int64_t num_batches() const;         // batches per epoch, after drop_last and limit_batches
  int64_t num_examples() const;        // N, the size of the dataset
  int64_t examples_per_epoch() const;  // sum of batch sizes in one epoch
  int64_t batch_size() const;
  int64_t height() const;
  int64_t width() const;
  bool shuffle() const;
  uint64_t seed() const;
  int64_t epoch() const;  // the current epoch, -1 before the first one starts

  // Makes preparing batch `index` (of any epoch) throw std::runtime_error, so tests can check
  // that background errors reach next(). -1 (the default) turns it off.
  void fail_at_batch_for_testing(int64_t index);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mgpu::data
