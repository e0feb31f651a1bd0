// cpp/train/layer_kind.cpp -- the table of the layer kinds a spec may name (from MGPU_LAYER_KINDS),
// and the option readers their records share.
#include "train/layer_kind.h"

#include <algorithm>

namespace mgpu::train {

const std::vector<const LayerDef*>& spec_layer_kinds() {
  static const std::vector<const LayerDef*> table = [] {
    std::vector<const LayerDef*> all;
#define MGPU_ADD_LAYER_KIND(name) all.push_back(&name##_layer);
    MGPU_LAYER_KINDS(MGPU_ADD_LAYER_KIND)
#undef MGPU_ADD_LAYER_KIND
    std::vector<const LayerDef*> named;
    for (const LayerDef* d : all)
      if (d->in_spec) named.push_back(d);
    return named;
  }();
  return table;
}

const LayerDef absorbed_layer = [] {
  LayerDef d;
  d.name = "absorbed";
  d.in_spec = false;
  d.keeps = Keeps::Nothing;
  return d;
}();

const LayerDef* find_layer_kind(const std::string& spec_name) {
  for (const LayerDef* d : spec_layer_kinds())
    if (d->name == spec_name) return d;
  return nullptr;
}

std::string known_layer_kinds() {
  std::vector<std::string> names;
  for (const LayerDef* d : spec_layer_kinds()) names.push_back(d->name);
  std::sort(names.begin(), names.end());
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

int64_t int_option(const Layer& l, const Options& o, const std::string& key, int64_t fallback,
                   int64_t min) {
  auto it = o.find(key);
  if (it == o.end()) return fallback;
  const double v = it->second;
  MGPU_CHECK_VALUE(v == static_cast<double>(static_cast<int64_t>(v)) && v >= min, l.name,
                   ": option ", key, " must be an integer >= ", min, ", got ", v);
  return static_cast<int64_t>(v);
}

bool flag_option(const Options& o, const std::string& key, bool fallback) {
  auto it = o.find(key);
  return it == o.end() ? fallback : it->second != 0.0;
}

double number_option(const Options& o, const std::string& key, double fallback) {
  auto it = o.find(key);
  return it == o.end() ? fallback : it->second;
}

void check_vector_shape(const Layer& l, const Shape& s, int64_t n, const char* what) {
  MGPU_CHECK_VALUE(s.size() == 1 && s[0] == n, l.name, ": ", what, " must have shape (", n,
                   ",), got ", s);
}

}  // namespace mgpu::train
