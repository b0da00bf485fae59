// Where a loaded model's weights come from: the checkpoint index and, for each parameter, the
// converter's expression that fills it. Kept after loading, so that weights released to disk
// can be read again. Shared by the loader and the weight manager only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "convert/expr.hpp"
#include "model/layer.hpp"
#include "storage/disk_map.hpp"

namespace vramd::model {

// Which expression fills which parameter.
struct Assignment {
  Parameter* parameter;
  convert::ExprPtr expr;
  uint64_t order;  // where its first source lies in the checkpoint, to read in file order
};

struct WeightSource {
  storage::DiskMap map;
  std::vector<Assignment> assignments;
  std::string where;  // the config, for errors

  // One parameter's value, read with positioned reads into fresh memory (or, when `views`, as
  // a view of the file mapping where dtype and alignment allow), in `dtype` on `device`.
  at::Tensor read(const Assignment& assignment, c10::Device device, c10::ScalarType dtype, bool views) const;
  // The same into `out` (contiguous, on the CPU, the parameter's shape, any dtype): a
  // positioned read straight into it when the checkpoint already holds that dtype.
  void read_into(const Assignment& assignment, at::Tensor& out) const;
};

// A state's dtype by name; "auto" or none: `otherwise`.
c10::ScalarType state_dtype(const std::string& name, c10::ScalarType otherwise);

}  // namespace vramd::model
