// Sorting vectors of structs that are costly to swap (strings, vectors inside).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace vramd {

// Sorts `items` by `key(item)` through a permutation: each item moves once, not at every swap.
// Returns at once when they are sorted already.
template <typename T, typename Key>
void sort_by(std::vector<T>& items, Key key) {
  auto less = [&](const T& a, const T& b) { return key(a) < key(b); };
  if (std::is_sorted(items.begin(), items.end(), less)) return;
  std::vector<uint32_t> order(items.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return less(items[a], items[b]); });
  std::vector<T> sorted;
  sorted.reserve(items.size());
  for (uint32_t i : order) sorted.push_back(std::move(items[i]));
  items = std::move(sorted);
}

}  // namespace vramd
