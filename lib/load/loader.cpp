#include "load/loader.hpp"

#include <chrono>

#include "load/lora.hpp"
#include "load/prepare.hpp"
#include "util/clock.hpp"
#include "weights/weights.hpp"

namespace vramd::load {

using Clock = std::chrono::steady_clock;

weights::LoadedModel load_model(const config::ModelConfig& config, const model::LoadOptions& options) {
  model::settle_vector_math();
  auto [map, architecture, model, assignments, report] = prepare(config);
  auto source = weights::make_source(std::move(map), std::move(assignments), config);
  const auto load_start = Clock::now();
  auto weights = weights::make_weights(*model, source, config, options, report);
  model->set_device(weights::torch_device(config.vram.computation.device));
  place_loras(*model);
  report.load_seconds = seconds_since(load_start);
  return {std::move(model), std::move(report), std::move(source), std::move(weights)};
}

model::Transition offload(weights::LoadedModel& loaded) {
  const auto start = Clock::now();
  const uint64_t bytes = loaded.weights->sleep();
  return {bytes, seconds_since(start)};
}

model::Transition onload(weights::LoadedModel& loaded) {
  const auto start = Clock::now();
  const uint64_t bytes = loaded.weights->wake();
  return {bytes, seconds_since(start)};
}

}  // namespace vramd::load
