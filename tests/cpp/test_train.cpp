// tests/cpp/test_train.cpp -- the fused step's parts: a model's slots, layout and buckets from its
// spec, the bucketed all-reduce across CPU devices, one replica's gradients against the op path.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "comm/barrier.h"
#include "comm/bucket_allreduce.h"
#include "core/queue.h"
#include "ops/elementwise.h"
#include "train/layers.h"
#include "train/lenet.h"
#include "train/model.h"
#include "train/shard_tree.h"

namespace mgpu {
namespace {

Device cpu(int i) { return Device{DeviceKind::CPU, i}; }

std::vector<float> values(const Tensor& t) {
  queue_of(t.device()).synchronize();
  return std::vector<float>(t.f32(), t.f32() + t.numel());
}

Tensor iota(Shape s, float start, float step, Device d) {
  Tensor t = Tensor::empty(s, DType::F32, d);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = start + step * static_cast<float>(i);
  return t;
}

const std::vector<Shape> kLeNetShapes = {{20, 1, 3, 3}, {20}, {50, 20, 5, 5}, {50},
                                         {800, 128},    {128}, {128, 10},     {10}};

TEST(Model, LeNetLaysOutGradientsInReverseLayerOrderAndCutsTheDenseBucketFirst) {
  std::vector<Tensor> p;
  for (const Shape& s : kLeNetShapes) p.push_back(Tensor::empty(s, DType::F32, cpu(0)));
  const train::Model& m = train::lenet_model(p);
  EXPECT_EQ(m.offset(6), 0);                 // W4 (the last layer's) first
  EXPECT_EQ(m.offset(7), 1280);
  EXPECT_EQ(m.offset(4), 1290);              // then W3, b3
  EXPECT_EQ(m.offset(2), 103818);            // then the conv layers'
  EXPECT_EQ(m.offset(1), 129048);
  EXPECT_EQ(m.flat_size(), 129068);
  ASSERT_EQ(m.buckets().size(), 2u);         // the dense layers' 415 KB pass the first bucket's cap
  EXPECT_EQ(m.buckets()[0].end, 103818);
  EXPECT_EQ(m.buckets()[0].last_layer, 3);
  EXPECT_EQ(m.buckets()[1].last_layer, 0);
  EXPECT_EQ(&train::lenet_model(p), &m);     // one model per set of shapes
}

train::LayerSpec layer(std::string kind, std::vector<int64_t> in = {},
                       std::map<std::string, double> o = {}) {
  return {std::move(kind), std::move(in), std::move(o), {}, {}};
}

TEST(Model, SlotsFanOutAndOnlyWhatBackwardReadsIsSaved) {
  // conv -> relu (slot 2) -> conv; slot 2 also feeds a 1x1 conv; add; flatten; linear.
  std::vector<train::LayerSpec> spec = {
      layer("conv2d", {}, {{"padding", 1}}), layer("relu"), layer("conv2d", {}, {{"padding", 1}}),
      layer("conv2d", {2}, {{"bias", 0}}),   layer("add", {3, 4}), layer("flatten"),
      layer("linear", {}, {{"transpose", 1}})};
  train::Model m(spec, {{2, 1, 3, 3}, {2}, {2, 2, 3, 3}, {2}, {2, 2, 1, 1}, {3, 8}, {3}}, {});
  EXPECT_FALSE(m.grad_needed(0));  // the input needs no gradient
  for (int s = 1; s < m.num_slots(); ++s) EXPECT_TRUE(m.grad_needed(s)) << s;
  EXPECT_TRUE(m.saved(0));   // conv 0's dw re-reads X
  EXPECT_FALSE(m.saved(1));  // relu's backward reads its output, not conv 0's
  EXPECT_TRUE(m.saved(2));   // both convs and relu itself re-read relu's output
  EXPECT_FALSE(m.saved(3));  // add re-reads neither operand
  EXPECT_FALSE(m.saved(4));
  EXPECT_EQ(m.layers()[3].params, (std::vector<int>{4}));
  EXPECT_EQ(m.offset(5), 0);
}

// Every kind's record is whole: a name, a forward and a backward; a kind owning parameters says
// how many and checks their shapes. The spec's kinds are those of MGPU_LAYER_KINDS a spec may
// name, found by their names.
TEST(LayerKinds, EveryRecordIsWholeAndTheSpecFindsItByName) {
  std::vector<const train::LayerDef*> all;
#define MGPU_TEST_ADD_KIND(name) all.push_back(&train::name##_layer);
  MGPU_LAYER_KINDS(MGPU_TEST_ADD_KIND)
#undef MGPU_TEST_ADD_KIND
  ASSERT_EQ(all.size(), 13u);
  int in_spec = 0;
  for (const train::LayerDef* d : all) {
    SCOPED_TRACE(d->name);
    EXPECT_FALSE(d->name.empty());
    EXPECT_NE(d->forward, nullptr);
    EXPECT_NE(d->backward, nullptr);
    EXPECT_EQ(d->owns == nullptr, d->check_shapes == nullptr);
    EXPECT_GE(d->inputs, 1);
    EXPECT_EQ(train::find_layer_kind(d->name), d->in_spec ? d : nullptr);
    in_spec += d->in_spec;
  }
  EXPECT_EQ(in_spec, 11);
  EXPECT_EQ(train::known_layer_kinds(),
            "add, avg_pool2d, batch_norm, conv2d, conv2d_relu_pool, dropout, flatten, "
            "global_avg_pool, linear, max_pool2d, relu");
  EXPECT_EQ(train::find_layer_kind("batch_norm_relu"), nullptr);  // made by the fusion only
  EXPECT_EQ(train::find_layer_kind("absorbed"), nullptr);
}

// Each layer of a built Model points at its kind's record; the fusion swaps batch_norm -> relu
// for batch_norm_relu and absorbs the batch norm.
TEST(LayerKinds, TheModelsLayersPointAtTheirRecords) {
  std::vector<train::LayerSpec> spec = {layer("conv2d"), layer("batch_norm"), layer("relu"),
                                        layer("flatten"), layer("linear")};
  const std::vector<Shape> ps = {{2, 1, 3, 3}, {2}, {2}, {2}, {8, 3}, {3}};
  const std::vector<Shape> bs = {{2}, {2}};
  train::Model fused(spec, ps, bs, ops::ConvAlgo::Auto, true);
  ASSERT_EQ(fused.layers().size(), 5u);
  EXPECT_EQ(fused.layers()[0].kind, &train::conv2d_layer);
  EXPECT_EQ(fused.layers()[1].kind, &train::absorbed_layer);
  EXPECT_EQ(fused.layers()[2].kind, &train::batch_norm_relu_layer);
  EXPECT_EQ(fused.layers()[3].kind, &train::flatten_layer);
  EXPECT_EQ(fused.layers()[4].kind, &train::linear_layer);
  train::Model plain(spec, ps, bs, ops::ConvAlgo::Auto, false);  // GPU replicas: no fusion
  EXPECT_EQ(plain.layers()[1].kind, &train::batch_norm_layer);
  EXPECT_EQ(plain.layers()[2].kind, &train::relu_layer);
  // Max pooling keeps nothing but its indices, so the relu before it keeps its own output (its
  // backward's mask), and the conv output before the relu is not kept.
  train::Model pooled({layer("conv2d"), layer("relu"), layer("max_pool2d", {}, {{"kernel", 2}}),
                       layer("flatten"), layer("linear")},
                      {{2, 1, 3, 3}, {2}, {8, 3}, {3}}, {});
  EXPECT_FALSE(pooled.saved(1));
  EXPECT_TRUE(pooled.saved(2));
  EXPECT_TRUE(pooled.saved(3));  // flatten re-reads its input for the shape
  EXPECT_EQ(plain.conv_algorithms(),
            (std::vector<std::pair<std::string, std::string>>{{"layer 0 (conv2d)", "auto"}}));
}

TEST(Model, BadSpecsNameTheLayer) {
  auto build = [](std::vector<train::LayerSpec> spec, std::vector<Shape> shapes) {
    train::Model m(spec, shapes, {});
  };
  EXPECT_THROW(build({layer("pool")}, {{1}}), ValueError);
  EXPECT_THROW(build({layer("relu", {1})}, {{1}}), ValueError);             // slot of itself
  EXPECT_THROW(build({layer("add", {0})}, {{1}}), ValueError);              // one operand
  EXPECT_THROW(build({layer("linear")}, {{3, 4}, {3}}), ValueError);        // bias of (in, out) W
  EXPECT_THROW(build({layer("linear")}, {{3, 4}}), ValueError);             // no bias given
  try {
    build({layer("relu"), layer("conv2d", {}, {{"stride", 1.5}})}, {{1, 1, 1, 1}, {1}});
    FAIL() << "a fractional stride was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1 (conv2d): option stride"), std::string::npos)
        << e.what();
  }
}

TEST(ShardTree, SplitsAfterTheLargestPowerOfTwoSoLeftSubtreesAreComplete) {
  EXPECT_EQ(train::tree_split(0, 2), 1);
  EXPECT_EQ(train::tree_split(0, 8), 4);
  EXPECT_EQ(train::tree_split(0, 7), 4);
  EXPECT_EQ(train::tree_split(4, 7), 6);
  EXPECT_EQ(train::tree_split(0, 9), 8);
  EXPECT_EQ(train::tree_split(8, 12), 10);
}

TEST(ShardTree, MaximalNodesTileARangeWithTreeNodes) {
  using N = std::vector<train::ShardSpan>;
  EXPECT_EQ(train::maximal_nodes(8, 0, 8), (N{{0, 8}}));
  EXPECT_EQ(train::maximal_nodes(8, 0, 3), (N{{0, 2}, {2, 3}}));   // 3 devices: 3, 3, 2 shards
  EXPECT_EQ(train::maximal_nodes(8, 3, 6), (N{{3, 4}, {4, 6}}));
  EXPECT_EQ(train::maximal_nodes(8, 6, 8), (N{{6, 8}}));
  EXPECT_EQ(train::maximal_nodes(8, 5, 5), N{});
  EXPECT_EQ(train::maximal_nodes(7, 4, 7), (N{{4, 7}}));
  EXPECT_EQ(train::maximal_nodes(1, 0, 1), (N{{0, 1}}));
}

TEST(BucketAllReduce, SumsEveryBucketOnEveryDeviceWhateverOrderDevicesJoinIn) {
  const std::vector<Device> devs = {cpu(0), cpu(1), cpu(2)};
  std::vector<Tensor> flat;
  for (int d = 0; d < 3; ++d) flat.push_back(iota({10}, static_cast<float>(d), 1.0f, devs[d]));
  comm::BucketAllReduce reduce(devs, {4, 6}, 0);
  reduce.ready(0, 2, flat[2].slice_rows(0, 4));
  reduce.ready(0, 0, flat[0].slice_rows(0, 4));
  reduce.ready(1, 0, flat[0].slice_rows(4, 10));
  reduce.ready(0, 1, flat[1].slice_rows(0, 4));
  reduce.ready(1, 2, flat[2].slice_rows(4, 10));
  reduce.ready(1, 1, flat[1].slice_rows(4, 10));
  for (int d = 0; d < 3; ++d) {
    std::vector<float> v = values(flat[d]);
    for (int i = 0; i < 10; ++i) EXPECT_EQ(v[i], 3.0f * static_cast<float>(i) + 3.0f) << d << i;
  }
}

TEST(Barrier, APartThatNeverArrivesEndsEveryWaitAtTheDeadlineWithItsReason) {
  comm::Barrier b(3);
  b.set_deadline(0.2, "allreduce: gpu(2) never joined");
  const auto t0 = std::chrono::steady_clock::now();
  std::string early;
  std::thread other([&] {
    try {
      b.arrive_and_wait();
    } catch (const DeviceError& e) {
      early = e.what();
    }
  });
  try {
    b.arrive_and_wait();
    ADD_FAILURE() << "the barrier passed with 2 of 3 parts";
  } catch (const DeviceError& e) {
    EXPECT_STREQ(e.what(), "allreduce: gpu(2) never joined");
  }
  other.join();
  const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(waited.count(), 0.2);
  EXPECT_LT(waited.count(), 10.0);
  // The other waiter is released too, and so is a part arriving late, each with the reason.
  EXPECT_EQ(early, "allreduce: gpu(2) never joined");
  try {
    b.arrive_and_wait();
    ADD_FAILURE() << "a late part passed an expired barrier";
  } catch (const DeviceError& e) {
    EXPECT_STREQ(e.what(), "allreduce: gpu(2) never joined");
  }
}

TEST(ModelLossAndGrads, LeNetBucketsAreAnnouncedAfterTheirGradientsAndInOrder) {
  std::vector<Tensor> p;
  float scale = 0.01f;
  for (const Shape& s : kLeNetShapes) p.push_back(iota(s, -0.5f * scale, scale / 997, cpu(0)));
  const train::Model& m = train::lenet_model(p);
  Tensor X = iota({2, 1, 28, 28}, 0.0f, 1.0f / 1568, cpu(0));
  Tensor y = Tensor::empty({2}, DType::I64, cpu(0));
  y.data<int64_t>()[0] = 3;
  y.data<int64_t>()[1] = 7;
  Tensor grads = Tensor::empty({m.flat_size()}, DType::F32, cpu(0));
  ops::fill(grads, 12345.0);
  std::vector<size_t> order;
  std::vector<std::vector<float>> at_announce;
  train::model_loss_and_grads(m, X, y, {p, {}}, grads, [&](size_t b) {
    order.push_back(b);
    // Everything enqueued so far has run: the bucket must hold no stale value.
    Tensor part = grads.slice_rows(m.buckets()[b].begin, m.buckets()[b].end);
    at_announce.push_back(values(part));
  });
  EXPECT_EQ(order, (std::vector<size_t>{0, 1}));
  for (const auto& v : at_announce)
    for (float g : v) ASSERT_NE(g, 12345.0f);
}

}  // namespace
}  // namespace mgpu
