// How a checkpoint's names meet a model's parameters, for a load and an update alike, and how
// their messages list names.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "convert/converter.hpp"
#include "model/model.hpp"

namespace vramd::load {

inline constexpr size_t kListed = 12;  // names a message lists, before "and N more"

// The first `limit` of `items`, as they are, and how many more.
std::string joined_listed(const std::vector<std::string>& items, size_t limit = kListed);
// The first `limit` of `names`, quoted, and how many more.
std::string listed(const std::vector<std::string>& names, size_t limit = kListed);
std::string joined(const std::vector<std::string>& lines);

// A checkpoint of the bare base model lacks the head model's prefix ("model."), and a
// checkpoint with a head has one the bare model lacks: names are matched either way.
class NameMatcher {
 public:
  NameMatcher(model::Model& model, const convert::ConversionPlan& plan);
  // The parameter's name for a checkpoint's (or an update's) tensor name.
  std::string canonical(const std::string& target) const;

 private:
  std::string prefix_;
  bool add_ = false, strip_ = false;
};

}  // namespace vramd::load
