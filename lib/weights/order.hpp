// The order a model's ops ask for their layers' weights in, learned from the first forward: it
// is fixed when the second forward begins (the first layer asked for again). The kinds of
// weights that stream or gather use it to bring in the next layers while one computes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace vramd::weights {

// Item: anything with a `size_t position`, kept equal to its place in the order.
template <class Item>
class LearnedOrder {
 public:
  // `guess`: the order until one is learned.
  explicit LearnedOrder(std::vector<Item*> guess = {}) : order_(std::move(guess)) { number(); }

  // An op asks for `item`. Returns true when this ends the learning: the first forward's order
  // is then the order, followed by the items of the guess it never asked for.
  bool asked(Item* item) {
    if (learned_) return false;
    if (!contains(asked_, item)) {
      asked_.push_back(item);
      return false;
    }
    for (Item* unused : order_)
      if (!contains(asked_, unused)) asked_.push_back(unused);
    order_ = std::move(asked_);
    number();
    learned_ = true;
    return true;
  }

  bool learned() const { return learned_; }
  size_t size() const { return order_.size(); }
  Item* operator[](size_t i) const { return order_[i]; }
  auto begin() const { return order_.begin(); }
  auto end() const { return order_.end(); }
  auto rbegin() const { return order_.rbegin(); }
  auto rend() const { return order_.rend(); }

 private:
  static bool contains(const std::vector<Item*>& items, Item* item) {
    return std::find(items.begin(), items.end(), item) != items.end();
  }
  void number() {
    for (size_t i = 0; i < order_.size(); ++i) order_[i]->position = i;
  }

  std::vector<Item*> order_, asked_;
  bool learned_ = false;
};

}  // namespace vramd::weights
