#include "load/names.hpp"

#include "util/format.hpp"

namespace vramd::load {

std::string joined_listed(const std::vector<std::string>& items, size_t limit) {
  std::string text;
  for (size_t i = 0; i < items.size() && i < limit; ++i) text += (i ? ", " : "") + items[i];
  if (items.size() > limit) text += ", and " + std::to_string(items.size() - limit) + " more";
  return text;
}

std::string listed(const std::vector<std::string>& names, size_t limit) {
  std::vector<std::string> quoted;
  for (const auto& name : names) quoted.push_back(quote(name));
  return joined_listed(quoted, limit);
}

std::string joined(const std::vector<std::string>& lines) {
  std::string text;
  for (const auto& line : lines) text += (text.empty() ? "" : ", ") + line;
  return text;
}

NameMatcher::NameMatcher(model::Model& model, const convert::ConversionPlan& plan) : prefix_(model.base_prefix()) {
  if (prefix_.empty()) return;
  bool model_has = false, checkpoint_has = false;
  for (const model::Parameter* parameter : model.parameters()) model_has |= parameter->name.starts_with(prefix_);
  for (const auto& tensor : plan.tensors) checkpoint_has |= tensor.target.starts_with(prefix_);
  add_ = model_has && !checkpoint_has;
  strip_ = !model_has && checkpoint_has;
}

std::string NameMatcher::canonical(const std::string& target) const {
  if (add_) return prefix_ + target;
  if (strip_ && target.starts_with(prefix_)) return target.substr(prefix_.size());
  return target;
}

}  // namespace vramd::load
