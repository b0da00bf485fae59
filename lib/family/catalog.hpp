// The families a model may be: the shipped ones (configs/architectures/*.toml, built into the
// executables, so that they need no install path), then the files of the daemon config's
// `architectures` folders, whose families replace shipped ones of the same name; a model
// config may also name a family file by path. Torch-free.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "family/family.hpp"

namespace vramd::family {

class Catalog {
 public:
  // Reads every *.toml in `folders`. A file that does not parse is kept as its error, shown
  // when it is asked for by name and in a failed model_type search; the others still serve.
  explicit Catalog(const std::vector<std::string>& folders = {});

  // By name, or by path for a name ending in ".toml". Throws Error naming the known families.
  std::shared_ptr<const Family> named(const std::string& name) const;
  // The family that declares `model_type`; throws Error naming the families and what they
  // declare when none does.
  std::shared_ptr<const Family> for_model_type(const std::string& model_type) const;
  // "bert, clip_text, gemma, ...": for messages.
  std::string names() const;

 private:
  void add(std::vector<Family> pending);
  // `family` merged over the one it extends.
  Family complete(const Family& family) const;

  std::vector<std::shared_ptr<const Family>> families_;
  std::vector<std::string> broken_;  // one line each: the error of a family file that did not parse
};

// The text of each shipped family file, by name (generated from configs/architectures/).
const std::vector<std::pair<std::string, std::string>>& builtin_family_files();

}  // namespace vramd::family
