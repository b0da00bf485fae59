// Everything a load does up to reading data, which a dry run does too: the checkpoint's index, the
// converter's plan, the model built on the meta device, and which expression fills which
// parameter, every name matched and every problem named at once.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "config/model_config.hpp"
#include "model/load_report.hpp"
#include "model/model.hpp"
#include "storage/disk_map.hpp"
#include "weights/source.hpp"

namespace vramd::load {

// Everything up to reading data: the index, the converter's plan, the model on the meta
// device, and which expression fills which parameter.
struct Prepared {
  storage::DiskMap map;
  std::string architecture;
  std::unique_ptr<model::Model> model;
  std::vector<weights::Assignment> assignments;
  model::LoadReport report;
};

// Throws Error naming the config and every missing, unexpected or mismatched key at once;
// model::NoArchitecture where neither the config nor a config.json names one.
Prepared prepare(const config::ModelConfig& config);

}  // namespace vramd::load
