#include "model/device_map.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "config/units.hpp"
#include "util/error.hpp"
#include "util/format.hpp"

namespace vramd::model {
namespace {

constexpr uint64_t kCpuRank = uint64_t{1} << 40, kDiskRank = kCpuRank + 1;

bool all_digits(std::string_view text) {
  return !text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string_view trimmed(std::string_view text) {
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!text.empty() && space(text.front())) text.remove_prefix(1);
  while (!text.empty() && space(text.back())) text.remove_suffix(1);
  return text;
}

// GPUs by index, then cpu, then disk; nullopt for a name that is none of them.
std::optional<uint64_t> device_rank(std::string_view device) {
  if (device == "cpu") return kCpuRank;
  if (device == "disk") return kDiskRank;
  if (!device.starts_with("cuda:")) return std::nullopt;
  const std::string_view index = device.substr(5);
  if (!all_digits(index) || index.size() > 9) return std::nullopt;
  uint64_t value = 0;
  std::from_chars(index.data(), index.data() + index.size(), value);
  return value;
}

std::string device_name(uint64_t rank) {
  return rank == kCpuRank ? "cpu" : rank == kDiskRank ? "disk" : "cuda:" + std::to_string(rank);
}

// The budgets checked, with canonical names, in planning order.
std::vector<DeviceBudget> ordered(std::span<const DeviceBudget> budgets, const std::string& where) {
  if (budgets.empty()) fail(where, "no device given; expected DEVICE=SIZE entries such as cuda:0=2GiB,cpu=8GiB");
  std::vector<std::pair<uint64_t, DeviceBudget>> ranked;
  for (const auto& budget : budgets) {
    const auto rank = device_rank(budget.device);
    if (!rank) fail(where, "unknown device " + quote(budget.device) + "; expected cuda:N, cpu or disk");
    const std::string name = device_name(*rank);
    for (const auto& [other_rank, other] : ranked)
      if (other_rank == *rank)
        fail(where, name + " is given twice" +
                        (other.device == budget.device ? "" : " (as " + quote(other.device) + " and " + quote(budget.device) + ")"));
    if (!budget.bytes && *rank != kDiskRank) fail(where, name + " has no size; only disk may go without a limit");
    ranked.push_back({*rank, {budget.device, budget.bytes}});
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](auto& a, auto& b) { return a.first < b.first; });
  std::vector<DeviceBudget> result;
  for (auto& [rank, budget] : ranked) result.push_back({device_name(rank), budget.bytes});
  return result;
}

// Whether `path` is `module` or inside it ("" holds everything).
bool within(std::string_view path, std::string_view module) {
  return module.empty() || path == module ||
         (path.size() > module.size() && path.starts_with(module) && path[module.size()] == '.');
}

// The module tree the layer paths spell: "model" holds "model.layers", which holds the block
// "model.layers.0", which holds its layers.
struct Node {
  std::string name;
  size_t parent = 0;
  uint64_t bytes = 0;  // of every layer inside
  std::vector<size_t> children;
  bool whole = false;  // a block or a layer: never divided
  int layer = -1;
  int device = -1;     // where it was placed as a whole
};

struct Tree {
  std::vector<Node> nodes;  // [0]: the model; every child after its parent
  std::unordered_map<std::string, size_t> index;
  std::vector<size_t> layer_nodes;
  std::vector<std::vector<size_t>> ties;  // groups of layers sharing parameters, each sorted by path
};

Tree build_tree(std::span<const PlanLayer> layers) {
  Tree tree;
  tree.nodes.push_back({});
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string& path = layers[i].path;
    if (path.empty() || path.front() == '.' || path.back() == '.' || path.find("..") != std::string::npos)
      throw Error("layer " + quote(path) + " has an empty path component");
    // An expert hangs beside its block (a child of the block's parent), so that the block
    // holds what every token runs through and each expert is placed on its own, after it.
    const std::string expert = layers[i].expert ? unit_of(path, true) : std::string();
    size_t node = 0, block = 0;
    for (size_t start = 0;;) {
      const size_t end = path.find('.', start);
      if (tree.nodes[node].layer >= 0)
        throw Error("layer " + quote(tree.nodes[node].name) + " holds layer " + quote(path) + "; layers are leaves");
      const std::string name = path.substr(0, end);
      const bool is_expert = name == expert && block != 0;
      const size_t parent = is_expert ? tree.nodes[block].parent : node;
      auto [it, added] = tree.index.try_emplace(name, tree.nodes.size());
      if (added) {
        Node child;
        child.name = name;
        child.parent = parent;
        tree.nodes.push_back(std::move(child));
        tree.nodes[parent].children.push_back(it->second);
      }
      node = it->second;
      if (is_expert) tree.nodes[node].whole = true;
      if (block == 0 && all_digits(std::string_view(path).substr(start, end - start))) {
        tree.nodes[node].whole = true;
        block = node;
      }
      if (end == std::string::npos) break;
      start = end + 1;
    }
    Node& leaf = tree.nodes[node];
    if (leaf.layer >= 0) throw Error("layer " + quote(path) + " is given twice");
    if (!leaf.children.empty())
      throw Error("layer " + quote(path) + " holds layer " + quote(tree.nodes[leaf.children[0]].name) + "; layers are leaves");
    leaf.layer = static_cast<int>(i);
    leaf.whole = true;
    leaf.bytes = layers[i].bytes;
    tree.layer_nodes.push_back(node);
  }
  for (size_t n = tree.nodes.size(); n-- > 1;) tree.nodes[tree.nodes[n].parent].bytes += tree.nodes[n].bytes;

  std::vector<size_t> group(layers.size());
  std::iota(group.begin(), group.end(), 0);
  const auto root = [&](size_t i) {
    while (group[i] != i) i = group[i] = group[group[i]];
    return i;
  };
  for (size_t i = 0; i < layers.size(); ++i)
    for (const auto& other : layers[i].tied) {
      const auto it = tree.index.find(other);
      if (it == tree.index.end() || tree.nodes[it->second].layer < 0)
        throw Error("layer " + quote(layers[i].path) + " is tied to " + quote(other) + ", which is not a layer");
      group[root(i)] = root(static_cast<size_t>(tree.nodes[it->second].layer));
    }
  std::unordered_map<size_t, std::vector<size_t>> members;
  for (size_t i = 0; i < layers.size(); ++i) members[root(i)].push_back(i);
  for (size_t i = 0; i < layers.size(); ++i) {
    auto& tied = members[i];
    if (tied.size() < 2) continue;
    std::sort(tied.begin(), tied.end(), [&](size_t a, size_t b) { return layers[a].path < layers[b].path; });
    tree.ties.push_back(std::move(tied));
  }
  return tree;
}

// The largest whole module (block or layer) within the queue's modules, and every one of that
// size: accelerate's get_max_layer_size.
struct Largest {
  uint64_t bytes = 0;
  std::vector<size_t> nodes;
};

Largest largest_unit(const Tree& tree, const std::vector<size_t>& queue) {
  Largest largest;
  std::vector<size_t> pending(queue.rbegin(), queue.rend());  // the next one last
  while (!pending.empty()) {
    const Node& node = tree.nodes[pending.back()];
    const size_t n = pending.back();
    pending.pop_back();
    if (node.whole) {
      if (node.bytes > largest.bytes) largest = {node.bytes, {n}};
      else if (node.bytes == largest.bytes) largest.nodes.push_back(n);
    } else {
      pending.insert(pending.end(), node.children.rbegin(), node.children.rend());
    }
  }
  return largest;
}

struct Device {
  std::string name;
  std::optional<int64_t> budget;
  bool main = false;  // keeps room for the largest unit still to place
  int64_t used = 0;
  uint64_t reserved = 0;
};

int64_t clamp(uint64_t bytes) { return static_cast<int64_t>(std::min<uint64_t>(bytes, std::numeric_limits<int64_t>::max())); }

}  // namespace

std::vector<DeviceBudget> parse_max_memory(std::string_view text, std::string_view option) {
  const std::string where(option);
  std::vector<DeviceBudget> budgets;
  if (!trimmed(text).empty()) {
    for (size_t start = 0, end = 0; end != std::string_view::npos; start = end + 1) {
      end = text.find(',', start);
      const std::string_view entry = trimmed(text.substr(start, end - start));
      if (entry.empty()) fail(where, "an empty entry in " + quote(text) + "; expected DEVICE=SIZE entries separated by commas");
      const size_t equals = entry.find('=');
      if (equals == std::string_view::npos) fail(where, quote(entry) + " is not DEVICE=SIZE (such as cuda:0=2GiB)");
      const std::string_view device = trimmed(entry.substr(0, equals));
      if (!device_rank(device)) fail(where, "unknown device " + quote(device) + "; expected cuda:N, cpu or disk");
      try {
        budgets.push_back({std::string(device), config::parse_size(entry.substr(equals + 1))});
      } catch (const Error& e) {
        fail(where, std::string(device) + ": " + e.what());
      }
    }
  }
  return ordered(budgets, where);
}

std::string unit_of(std::string_view path, bool expert) {
  std::string_view unit = path;
  for (size_t start = 0; start <= path.size();) {
    const size_t end = std::min(path.find('.', start), path.size());
    if (all_digits(path.substr(start, end - start))) {
      unit = path.substr(0, end);
      if (!expert) break;
    }
    start = end + 1;
  }
  return std::string(unit);
}

std::vector<DeviceBudget> balanced_memory(std::span<const PlanLayer> layers, std::span<const DeviceBudget> max_memory,
                                          bool low_zero, std::string_view option) {
  std::vector<DeviceBudget> budgets = ordered(max_memory, std::string(option));
  std::vector<DeviceBudget*> gpus;
  for (auto& budget : budgets)
    if (budget.device.starts_with("cuda:") && budget.bytes && *budget.bytes > 0) gpus.push_back(&budget);
  if (gpus.empty()) return budgets;
  if (gpus.size() == 1) low_zero = false;

  uint64_t total = 0;
  for (const auto& layer : layers) total += layer.bytes;
  uint64_t per_gpu = total / (low_zero ? gpus.size() - 1 : gpus.size());
  // The first block, its experts with it (the no_split module), and the final modules: the
  // layers holding weights of their own, a block's experts together.
  uint64_t block = 0;
  std::string first_block;
  std::vector<std::pair<std::string, uint64_t>> finals;  // in order, by module
  for (const auto& layer : layers) {
    if (const std::string unit = unit_of(layer.path); unit != layer.path && (first_block.empty() || unit == first_block)) {
      first_block = unit;
      block += layer.bytes;
    }
    if (layer.bytes == 0) continue;  // its weights are another layer's (a tied head): no module of its own
    const std::string expert = layer.expert ? unit_of(layer.path, true) : std::string();
    const std::string module = expert.empty() ? layer.path : expert.substr(0, expert.rfind('.'));
    if (finals.empty() || finals.back().first != module) finals.push_back({module, 0});
    finals.back().second += layer.bytes;
  }
  uint64_t finals_bytes = 0;
  for (const auto& [module, bytes] : finals) finals_bytes += bytes;
  const uint64_t mean = finals.empty() ? 0 : finals_bytes / finals.size();
  per_gpu += static_cast<uint64_t>(1.25 * static_cast<double>(std::max(block, mean)));

  // The last GPU keeps its whole budget, in case the room added is not enough.
  for (size_t i = 0; i + 1 < gpus.size(); ++i)
    if (!(low_zero && i == 0)) gpus[i]->bytes = std::min(per_gpu, *gpus[i]->bytes);
  if (low_zero) {
    uint64_t others = 0;
    for (size_t i = 1; i < gpus.size(); ++i) others += *gpus[i]->bytes;
    gpus[0]->bytes = std::min(total - std::min(total, others), *gpus[0]->bytes);
  }
  return budgets;
}

const std::string& DeviceMap::device_of(std::string_view layer) const {
  const PlacedUnit* innermost = nullptr;
  for (const auto& placed : units)
    if (within(layer, placed.name) && (!innermost || placed.name.size() > innermost->name.size())) innermost = &placed;
  if (!innermost) throw Error("no layer " + quote(layer) + " in the device map");
  return innermost->device;
}

DeviceMap plan_device_map(std::span<const PlanLayer> layers, std::span<const DeviceBudget> max_memory, std::string_view option) {
  const std::string where(option);
  std::vector<Device> devices;
  for (const auto& budget : ordered(max_memory, where))
    devices.push_back({budget.device, budget.bytes ? std::optional(clamp(*budget.bytes)) : std::nullopt});
  if (devices.back().name != "disk") devices.push_back({"disk", std::nullopt});
  // accelerate's main devices: the first GPU and cpu.
  if (devices.front().name.starts_with("cuda:")) devices.front().main = true;
  for (auto& device : devices) device.main |= device.name == "cpu";

  Tree tree = build_tree(layers);
  const auto splittable = [&](size_t n) { return !tree.nodes[n].whole; };
  const auto children = [&](size_t n) -> const std::vector<size_t>& { return tree.nodes[n].children; };
  const auto path = [&](size_t layer) -> const std::string& { return layers[layer].path; };

  // accelerate's loop: take the next module; put it (with the modules holding layers tied to
  // it) on the current device if it fits beside the reserve; else divide it (or what it is tied
  // to) and try again; else move on to the next device.
  std::vector<size_t> queue = children(0);
  Largest largest = largest_unit(tree, queue);
  size_t current = 0;
  while (!queue.empty()) {
    const size_t module = queue.front();
    queue.erase(queue.begin());
    const std::string& name = tree.nodes[module].name;
    std::erase_if(largest.nodes, [&](size_t n) { return within(tree.nodes[n].name, name); });
    if (largest.nodes.empty()) largest = largest_unit(tree, queue);

    // Layers tied to one inside this module but outside it themselves, and the queued modules
    // that hold them. (accelerate would also subtract a tied parameter's bytes when it belongs
    // to the layer outside; here that layer's bytes always hold it, so it counts once.)
    bool tied = false;
    std::vector<size_t> tied_modules;
    const int64_t size = clamp(tree.nodes[module].bytes);
    int64_t size_with_ties = size;
    for (const auto& group : tree.ties) {
      const auto inside = std::count_if(group.begin(), group.end(), [&](size_t l) { return within(path(l), name); });
      if (inside == 0 || inside == static_cast<std::ptrdiff_t>(group.size())) continue;
      for (size_t layer : group) {
        if (within(path(layer), name)) continue;
        tied = true;
        const auto holder = std::find_if(queue.begin(), queue.end(), [&](size_t n) { return within(path(layer), tree.nodes[n].name); });
        if (holder == queue.end()) continue;  // placed already
        tied_modules.push_back(*holder);
        size_with_ties += clamp(tree.nodes[*holder].bytes);
      }
    }

    Device& device = devices[current];
    std::optional<int64_t> room = device.budget;
    uint64_t reserve = 0;
    if (device.main) {
      reserve = largest.bytes;
      *room -= clamp(reserve);
    }
    if (!room || device.used + size_with_ties <= *room) {
      device.used += size_with_ties;
      tree.nodes[module].device = static_cast<int>(current);
      for (size_t holder : tied_modules) {
        std::erase(queue, holder);
        tree.nodes[holder].device = static_cast<int>(current);
      }
      continue;
    }
    if (tied && device.used + size <= *room) {
      // It fits without what it is tied to: divide the first of those that can be divided.
      const auto divisible = std::find_if(tied_modules.begin(), tied_modules.end(), splittable);
      if (divisible != tied_modules.end()) {
        const std::vector<size_t>& parts = children(*divisible);
        const auto at = queue.erase(std::find(queue.begin(), queue.end(), *divisible));
        queue.insert(at, parts.begin(), parts.end());
        queue.insert(queue.begin(), module);
        largest = largest_unit(tree, queue);
        continue;
      }
    }
    if (device.used + size >= *room && splittable(module)) {
      queue.insert(queue.begin(), children(module).begin(), children(module).end());
      largest = largest_unit(tree, queue);
      continue;
    }
    device.reserved = reserve;
    if (++current == devices.size())
      fail(where, "the model does not fit: " + quote(name) + " (" + format_bytes(tree.nodes[module].bytes) +
                      ") and what follows find no room on disk (" + format_bytes(static_cast<uint64_t>(device.used)) + " of " +
                      format_bytes(static_cast<uint64_t>(*device.budget)) +
                      " used) nor on the devices before it; give more room, or leave disk out for no limit on it");
    queue.insert(queue.begin(), module);
  }

  DeviceMap map;
  std::unordered_map<std::string, size_t> unit_index;
  for (size_t i = 0; i < layers.size(); ++i) {
    std::string unit = unit_of(path(i), layers[i].expert);
    size_t n = tree.layer_nodes[i];
    while (tree.nodes[n].device < 0 && n != 0) n = tree.nodes[n].parent;
    const std::string& device = devices.at(static_cast<size_t>(tree.nodes[n].device)).name;
    auto [it, added] = unit_index.try_emplace(unit, map.units.size());
    if (added) map.units.push_back({std::move(unit), device, 0});
    map.units[it->second].bytes += layers[i].bytes;
  }
  for (const auto& device : devices) {
    DeviceUse use{device.name, device.budget ? std::optional<uint64_t>(*device.budget) : std::nullopt, 0, device.reserved};
    for (const auto& unit : map.units)
      if (unit.device == device.name) use.bytes += unit.bytes;
    map.reserved = std::max(map.reserved, use.reserved);
    map.devices.push_back(std::move(use));
  }
  return map;
}

std::vector<UnitRange> collapse_units(std::span<const PlacedUnit> units) {
  std::vector<UnitRange> rows;
  std::string run_prefix;  // "model.layers" of the last row when it is a run of blocks
  uint64_t first = 0, last = 0;
  bool in_run = false;
  for (const auto& unit : units) {
    const size_t dot = unit.name.rfind('.');
    const std::string_view prefix = dot == std::string::npos ? std::string_view() : std::string_view(unit.name).substr(0, dot);
    const std::string_view number = dot == std::string::npos ? std::string_view(unit.name) : std::string_view(unit.name).substr(dot + 1);
    uint64_t index = 0;
    const bool block = all_digits(number) && std::from_chars(number.data(), number.data() + number.size(), index).ec == std::errc();
    if (block && in_run && !rows.empty() && rows.back().device == unit.device && prefix == run_prefix && index == last + 1) {
      UnitRange& row = rows.back();
      last = index;
      row.name = (prefix.empty() ? "" : std::string(prefix) + ".") + std::to_string(first) + "-" + std::to_string(last);
      row.bytes += unit.bytes;
      row.units++;
      continue;
    }
    rows.push_back({unit.name, unit.device, unit.bytes, 1});
    in_run = block;
    run_prefix = prefix;
    first = last = index;
  }
  return rows;
}

}  // namespace vramd::model
