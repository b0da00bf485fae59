// Sorting vectors of structs that are costly to swap (strings, vectors inside).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

namespace vramd {

// Sorts `items` by the string `key(item)`: the sort moves (key, position) pairs, which lie side
// by side in memory, and then each item moves once. Returns at once when they are sorted already.
template <typename T, typename Key>
void sort_by(std::vector<T>& items, Key key) {
  std::vector<std::pair<std::string_view, uint32_t>> order(items.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = {key(items[i]), i};
  if (std::is_sorted(order.begin(), order.end())) return;
  std::sort(order.begin(), order.end());
  std::vector<T> sorted;
  sorted.reserve(items.size());
  for (const auto& entry : order) sorted.push_back(std::move(items[entry.second]));
  items = std::move(sorted);
}

}  // namespace vramd
