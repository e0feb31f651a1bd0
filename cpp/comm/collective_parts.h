// cpp/comm/collective_parts.h -- an in-process collective's parts put on the devices' queues:
// part d runs on devices[d], every queue gets its part in the same host order (under
// collective_submission_mutex, so the barriers inside cannot deadlock against another host
// thread's collective), and a part that throws aborts the collective's barrier, releasing the
// devices waiting for it.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "core/queue.h"
#include "core/tensor.h"

namespace mgpu::comm {

// Collective has run(int part) and a Barrier `barrier`; keep[d] stays alive until part d has run.
template <class Collective>
void enqueue_parts(const std::shared_ptr<Collective>& c, const std::vector<Device>& devices,
                   const std::vector<std::vector<Tensor>>& keep, const char* name) {
  std::lock_guard<std::recursive_mutex> order(collective_submission_mutex());
  for (size_t d = 0; d < devices.size(); ++d) {
    enqueue_on(devices[d], name, [c, me = static_cast<int>(d)] {
      try {
        c->run(me);
      } catch (...) {
        c->barrier.abort();  // release the devices waiting for this one
        throw;
      }
    }, keep[d]);
  }
}

}  // namespace mgpu::comm
