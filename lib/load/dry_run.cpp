#include "load/dry_run.hpp"

#include <set>

#include "convert/expr.hpp"
#include "load/prepare.hpp"
#include "weights/lease.hpp"
#include "weights/weights.hpp"

namespace vramd::load {

DryModel dry_run_model(const config::ModelConfig& config) {
  Prepared prepared = prepare(config);
  const auto source = weights::make_source(std::move(prepared.map), std::move(prepared.assignments), config);
  model::DryRun dry{.architecture = prepared.architecture,
                    .dtype = convert::dtype_torch_name(storage::dtype_of(prepared.model->dtype())),
                    .report = std::move(prepared.report),
                    .weights = weights::plan_weights(*prepared.model, *source, config),
                    .views = weights::planned_views(*prepared.model, *source, config),
                    .views_chosen = config.vram.direct_io.has_value(),
                    .checkpoint_bytes = source->map.total_bytes(),
                    .names = {},
                    .plan = std::nullopt};
  // The manifest's names (weights/lease_memory.cpp's describe): every parameter the checkpoint
  // fills, a tied one where the one it is tied to is filled.
  std::set<const model::Parameter*> filled;
  for (const auto& a : source->assignments) filled.insert(a.parameter);
  for (const auto* p : prepared.model->parameters())
    if (filled.contains(p) || (p->tied && filled.contains(p->tied))) dry.names.push_back(p->name);
  if (config::rests_for_clients(config)) dry.plan = weights::managed_plan(*prepared.model, *source, config);
  return {std::move(dry), std::move(prepared.model)};
}

model::DryRun dry_run(const config::ModelConfig& config) { return dry_run_model(config).dry; }

}  // namespace vramd::load
