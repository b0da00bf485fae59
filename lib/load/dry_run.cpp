#include "load/dry_run.hpp"

#include "convert/expr.hpp"
#include "load/prepare.hpp"
#include "weights/weights.hpp"

namespace vramd::load {

DryModel dry_run_model(const config::ModelConfig& config) {
  Prepared prepared = prepare(config);
  const auto source = weights::make_source(std::move(prepared.map), std::move(prepared.assignments), config);
  model::DryRun dry{prepared.architecture, convert::dtype_torch_name(storage::dtype_of(prepared.model->dtype())),
             std::move(prepared.report), weights::plan_weights(*prepared.model, *source, config)};
  return {std::move(dry), std::move(prepared.model)};
}

model::DryRun dry_run(const config::ModelConfig& config) { return dry_run_model(config).dry; }

}  // namespace vramd::load
