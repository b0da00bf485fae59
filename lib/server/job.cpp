#include "server/job.hpp"

#include "dist/group.hpp"
#include "model/progress.hpp"
#include "storage/file.hpp"
#include "util/clock.hpp"

namespace vramd::server {

const char* Job::name() const {
  switch (kind) {
    case Kind::Load: return "load";
    case Kind::Forward: return "forward";
    case Kind::Offload: return "offload";
    case Kind::Onload: return "onload";
    case Kind::Unload: return "unload";
    case Kind::Replace: return "replace";
    case Kind::Lease: return "lease";
    case Kind::Update: return "update";
  }
  return "?";
}

namespace {

void load(Outcome& outcome, const config::ModelConfig& config, const std::function<bool(const LoadProgress&)>& progress) {
  const auto start = std::chrono::steady_clock::now();
  try {
    outcome.runtime = Runtime::load(config, progress);
    outcome.loaded = true;
    outcome.load_seconds = seconds_since(start);
  } catch (const model::Cancelled& error) {
    outcome.cancelled = true;
    outcome.load_error = error.what();
  } catch (const std::exception& error) {
    outcome.load_error = error.what();
  }
}

// The job itself, on a loaded model; errors that are the request's own go in the outcome.
void act(Job& job, Outcome& outcome) {
  Runtime& runtime = *outcome.runtime;
  switch (job.kind) {
    case Job::Kind::Forward: {
      const auto start = std::chrono::steady_clock::now();
      try {
        outcome.output = runtime.forward(job.input, job.stop.get());
      } catch (const BadInput& error) {
        outcome.status = 400;
        outcome.error = error.what();
      } catch (const model::Cancelled& error) {
        outcome.cancelled = true;  // the registry says why
        outcome.status = 499;
        outcome.error = error.what();
      }
      outcome.seconds = seconds_since(start);
      break;
    }
    case Job::Kind::Offload: outcome.moved = runtime.offload(); break;
    case Job::Kind::Onload: outcome.moved = runtime.onload(); break;
    case Job::Kind::Unload:
    case Job::Kind::Replace: outcome.runtime.reset(); break;
    case Job::Kind::Load:
      if (runtime.offloaded()) outcome.moved = runtime.onload();  // a load wakes a sleeping model
      break;
    case Job::Kind::Lease:
      try {
        outcome.manifest = std::make_shared<weights::Manifest>(runtime.lease(job.device, job.adapters || job.refresh));
      } catch (const BadInput& error) {
        outcome.status = 400;
        outcome.error = error.what();
      } catch (const weights::NotLeasable& error) {
        outcome.status = 409;
        outcome.error = error.what();
      }
      break;
    case Job::Kind::Update:
      try {
        outcome.updated = job.loras ? runtime.set_loras(*job.loras, job.reserve, job.in_place)
                                    : runtime.update(job.input, job.path, job.memfd, job.reserve, job.in_place, job.kept.get());
        outcome.replaced = runtime.take_replaced(outcome.replaced_bytes);
      } catch (const BadInput& error) {
        outcome.status = 400;
        outcome.error = error.what();
      } catch (const NeedsRoom& error) {
        outcome.needs_room = error.room;  // the registry reserves it and runs the job again, once
        outcome.status = 507;
        outcome.error = "the update's new values need room beside the old ones, more than was reserved for them";
      } catch (const Conflict& error) {
        outcome.status = 409;
        outcome.error = error.what();
      }
      break;
  }
}

}  // namespace

Outcome run_job(Job& job, std::shared_ptr<Runtime> runtime, const config::ModelConfig& config,
                const std::function<bool(const LoadProgress&)>& progress) {
  Outcome outcome;
  outcome.runtime = std::move(runtime);
  try {
    if (!outcome.runtime && job.loads()) load(outcome, config, progress);
    if (outcome.load_error.empty() && outcome.runtime) act(job, outcome);
    if (outcome.runtime) {
      outcome.bytes = outcome.runtime->bytes_by_device();
      outcome.vram = outcome.runtime->vram();
      outcome.views = outcome.runtime->views();
      outcome.version = outcome.runtime->version();
    }
  } catch (const std::exception& error) {
    outcome.status = 500;
    outcome.error = error.what();
    outcome.weights_lost =
        dynamic_cast<const dist::RankFailure*>(&error) || dynamic_cast<const storage::MappingLost*>(&error);
  }
  return outcome;
}

}  // namespace vramd::server
