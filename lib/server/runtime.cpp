#include "server/runtime.hpp"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <cstring>

#include "convert/expr.hpp"
#include "model/loader.hpp"
#include "model/vram.hpp"
#include "storage/safetensors_header.hpp"
#include "storage/tensor_io.hpp"
#include "util/format.hpp"

namespace vramd::server {

struct Runtime::Impl {
  config::ModelConfig config;
  model::LoadedModel loaded;
  std::string dtype;
  bool offloaded = false;
};

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Runtime::~Runtime() = default;

std::unique_ptr<Runtime> Runtime::load(const config::ModelConfig& config,
                                       const std::function<bool(const LoadProgress&)>& progress) {
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  model::LoadOptions options;
  if (progress)
    options.progress = [&](const model::Progress& p) {
      return progress({p.bytes_done, p.bytes_total, p.tensors_done, p.tensors_total});
    };
  impl->loaded = model::load_model(config, options);
  impl->dtype = convert::dtype_torch_name(storage::dtype_of(impl->loaded.model->dtype()));
  return std::unique_ptr<Runtime>(new Runtime(std::move(impl)));
}

namespace {

storage::NamedTensors parse_inputs(std::string_view body) {
  const auto* bytes = reinterpret_cast<const std::byte*>(body.data());
  storage::SafetensorsHeader header;
  try {
    header = storage::parse_safetensors_file({bytes, body.size()});
  } catch (const Error& e) {
    throw BadInput(std::string("request body is not a safetensors file: ") + e.what());
  }
  storage::NamedTensors inputs;
  for (const auto& record : header.tensors) {
    c10::ScalarType type;
    try {
      type = storage::scalar_type(record.dtype);
    } catch (const Error& e) {
      throw BadInput("input " + quote(record.name) + ": " + e.what());
    }
    at::Tensor tensor = at::empty(record.shape, at::TensorOptions().dtype(type));
    std::memcpy(tensor.data_ptr(), bytes + header.data_offset + record.begin, record.end - record.begin);
    inputs.emplace_back(record.name, std::move(tensor));
  }
  return inputs;
}

}  // namespace

std::string Runtime::forward(std::string_view safetensors) {
  const auto inputs = parse_inputs(safetensors);
  if (impl_->offloaded) onload();
  storage::NamedTensors outputs;
  try {
    c10::InferenceMode inference;
    outputs = impl_->loaded.model->forward(inputs);
  } catch (const c10::Error& e) {
    throw Error(std::string("forward failed: ") + e.what_without_backtrace());
  } catch (const Error& e) {
    throw BadInput(e.what());  // the model's checks of its inputs
  }
  return storage::serialize_tensors(outputs, {{"model", impl_->config.name}, {"produced_by", "vramd"}});
}

Moved Runtime::offload() {
  if (impl_->offloaded) return {};
  const auto moved = model::offload(impl_->loaded);
  impl_->offloaded = true;
  return {moved.bytes, moved.seconds};
}

Moved Runtime::onload() {
  if (!impl_->offloaded) return {};
  const auto moved = model::onload(impl_->loaded);
  impl_->offloaded = false;
  return {moved.bytes, moved.seconds};
}

bool Runtime::offloaded() const { return impl_->offloaded; }

std::map<std::string, uint64_t> Runtime::bytes_by_device() const {
  std::map<std::string, uint64_t> bytes;
  if (const auto& vram = impl_->loaded.vram) {  // streamed: what the manager holds, prefetched layers too
    if (const uint64_t held = vram->stats().held) bytes[impl_->loaded.model->device().str()] = held;
    return bytes;
  }
  for (const auto* parameter : impl_->loaded.model->parameters()) {
    const at::Tensor& value = parameter->value;
    if (parameter->tied || !value.defined() || value.is_meta()) continue;
    bytes[value.device().str()] += value.nbytes();
  }
  return bytes;
}

std::optional<model::VramStats> Runtime::vram() const {
  if (!impl_->loaded.vram) return std::nullopt;
  return impl_->loaded.vram->stats();
}

const model::LoadReport& Runtime::report() const { return impl_->loaded.report; }
const std::string& Runtime::dtype() const { return impl_->dtype; }

}  // namespace vramd::server
