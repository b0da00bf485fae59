#include "family/catalog.hpp"

#include <algorithm>
#include <filesystem>

#include "util/error.hpp"
#include "util/file.hpp"
#include "util/format.hpp"

namespace vramd::family {
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kMaxFamilyBytes = 1 << 20;

Family read_family_file(const std::string& path) {
  return parse_family(fs::path(path).stem().string(), read_regular_file(path, kMaxFamilyBytes), path);
}

}  // namespace

Catalog::Catalog(const std::vector<std::string>& folders) {
  std::vector<Family> shipped;
  for (const auto& [name, text] : builtin_family_files())
    shipped.push_back(parse_family(name, text, "the shipped family " + name));
  add(std::move(shipped));
  std::vector<Family> users;
  for (const auto& folder : folders) {
    std::error_code ec;
    std::vector<std::string> paths;
    for (const auto& entry : fs::directory_iterator(folder, ec))
      if (entry.path().extension() == ".toml") paths.push_back(entry.path().string());
    std::sort(paths.begin(), paths.end());
    for (const auto& path : paths) {
      try {
        users.push_back(read_family_file(path));
      } catch (const Error& e) {
        broken_.push_back(e.what());
      }
    }
  }
  add(std::move(users));
}

// Families extend each other in any order: each is completed once the one it extends is known
// (a user's family of a shipped one's name replaces it, for what follows too).
void Catalog::add(std::vector<Family> pending) {
  while (!pending.empty()) {
    const auto ready = std::find_if(pending.begin(), pending.end(), [&](const Family& family) {
      return family.extends.empty() || std::none_of(pending.begin(), pending.end(), [&](const Family& other) {
               return other.name == family.extends && &other != &family;
             });
    });
    if (ready == pending.end()) {  // a cycle: each waits for another
      for (const auto& family : pending)
        broken_.push_back(family.origin + ": extends " + quote(family.extends) + ", which extends it in turn");
      return;
    }
    try {
      auto family = std::make_shared<Family>(complete(*ready));
      std::erase_if(families_, [&](const auto& known) { return known->name == family->name; });
      families_.push_back(std::move(family));
    } catch (const Error& e) {
      broken_.push_back(e.what());
    }
    pending.erase(ready);
  }
}

std::shared_ptr<const Family> Catalog::named(const std::string& name) const {
  if (name.ends_with(".toml")) return std::make_shared<Family>(complete(read_family_file(name)));
  for (const auto& family : families_)
    if (family->name == name) return family;
  for (const auto& problem : broken_)
    if (problem.find("/" + name + ".toml") != std::string::npos) throw Error(problem);
  throw Error("unknown architecture " + quote(name) + " (known: " + names() + ", weights; or a family file, "
              "architecture = \"path/to/family.toml\")");
}

std::shared_ptr<const Family> Catalog::for_model_type(const std::string& model_type) const {
  for (const auto& family : families_)
    if (std::find(family->model_types.begin(), family->model_types.end(), model_type) != family->model_types.end())
      return family;
  std::string message = "no family computes model_type " + quote(model_type) + " (known: " + names() +
                        "); docs/architectures.md shows how to add one";
  for (const auto& problem : broken_) message += "; a family file that did not parse: " + problem;
  throw Error(message);
}

Family Catalog::complete(const Family& family) const {
  if (family.extends.empty()) return family;
  for (const auto& known : families_)
    if (known->name == family.extends) return inherit(*known, family);
  throw Error(family.origin + ": extends = " + quote(family.extends) + ", which is no family known before it (known: " +
              names() + ")");
}

std::string Catalog::names() const {
  std::vector<std::string> names;
  for (const auto& family : families_) names.push_back(family->name);
  std::sort(names.begin(), names.end());
  std::string text;
  for (const auto& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

}  // namespace vramd::family
