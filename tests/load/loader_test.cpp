// ATen first: c10's logging defines a CHECK macro that Catch's must replace.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "config/model_config.hpp"
#include "load/dry_run.hpp"
#include "load/loader.hpp"
#include "load/update.hpp"
#include "model/registry.hpp"
#include "storage/tensor_io.hpp"
#include "support/temp_dir.hpp"

using namespace vramd;
using vramd::test::TempDir;

namespace {

model::LoadOptions options_with(std::function<bool(const model::Progress&)> progress, bool zero_copy = true) {
  model::LoadOptions options;
  options.progress = std::move(progress);
  options.zero_copy = zero_copy;
  return options;
}

constexpr const char* kGpt2Config =
    R"({"model_type": "gpt2", "vocab_size": 300, "n_positions": 32, "n_embd": 64, "n_layer": 2, "n_head": 4})";

// A GPT-2 checkpoint with random weights, as save_pretrained names them (no lm_head: tied).
void write_gpt2(const TempDir& dir, at::ScalarType dtype) {
  dir.write("config.json", kGpt2Config);
  auto model = model::build_model("gpt2", hparams::Hyperparams(kGpt2Config, "test"), dtype);
  storage::NamedTensors tensors;
  at::manual_seed(0);
  for (const auto* parameter : model->parameters())
    if (!parameter->tied) tensors.emplace_back(parameter->name, at::randn(parameter->shape).to(dtype));
  storage::save_tensors(dir / "model.safetensors", tensors);
}

config::ModelConfig config_for(const TempDir& dir, const std::string& extra = "") {
  return config::load_model_config(dir.write("model.toml", "checkpoint = \"model.safetensors\"\n" + extra),
                                   config::default_daemon_config());
}

// Counts the bytes LibTorch holds in CPU memory, while installed.
class CountingAllocator final : public c10::Allocator {
 public:
  CountingAllocator() : previous_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, 255); }
  ~CountingAllocator() override { c10::SetCPUAllocator(previous_, 255); }

  c10::DataPtr allocate(size_t bytes) override {
    auto* block = static_cast<size_t*>(std::aligned_alloc(64, 64 + ((bytes + 63) / 64) * 64));
    block[0] = bytes;
    const int64_t now = live_ += static_cast<int64_t>(bytes);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {reinterpret_cast<char*>(block) + 64, block, &release, c10::Device(c10::kCPU)};
  }
  void copy_data(void* dest, const void* src, size_t count) const override { std::memcpy(dest, src, count); }

  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  void reset_peak() { peak_ = live_.load(); }

 private:
  static void release(void* block) {
    live_ -= static_cast<int64_t>(static_cast<size_t*>(block)[0]);
    std::free(block);
  }
  c10::Allocator* previous_;
  static inline std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

}  // namespace

TEST_CASE("tied parameters share one storage and are loaded once") {
  TempDir dir;
  write_gpt2(dir, at::kFloat);
  auto loaded = load::load_model(config_for(dir));
  auto& model = loaded.model;
  auto& report = loaded.report;
  const auto* head = model->find("lm_head.weight");
  const auto* wte = model->find("transformer.wte.weight");
  REQUIRE(head->tied == wte);
  CHECK(head->value.is_meta());
  uint64_t untied = 0;
  for (const auto* parameter : model->parameters())
    if (!parameter->tied) untied += parameter->elements() * 4;
  CHECK(report.bytes == untied);
  at::InferenceMode guard;
  auto outputs = model->forward({{"input_ids", at::arange(6).view({1, 6})}});
  // The head's logits are the hidden states times the embedding matrix.
  const auto expected = at::matmul(outputs[1].second, wte->value.t());
  CHECK(at::allclose(outputs[0].second, expected, 1e-5, 1e-5));
}

TEST_CASE("weights in the stored dtype are views of the checkpoint mapping unless asked not to be") {
  TempDir dir;
  write_gpt2(dir, at::kFloat);
  auto viewed = load::load_model(config_for(dir));
  CHECK(viewed.report.zero_copy == viewed.report.tensors);
  auto copied = load::load_model(config_for(dir), options_with({}, false));
  CHECK(copied.report.zero_copy == 0);
  for (size_t i = 0; i < viewed.model->parameters().size(); ++i) {
    const auto* a = viewed.model->parameters()[i];
    const auto* b = copied.model->parameters()[i];
    if (!a->tied) CHECK(at::equal(a->value, b->value));
  }
  // A dtype conversion cannot be a view.
  auto converted = load::load_model(config_for(dir, "dtype = \"bfloat16\"\n"));
  CHECK(converted.report.zero_copy == 0);
  CHECK(converted.model->find("transformer.h.0.attn.c_attn.weight")->value.scalar_type() == at::kBFloat16);
}

TEST_CASE("progress reports every tensor and its bytes in order") {
  TempDir dir;
  write_gpt2(dir, at::kFloat);
  std::vector<model::Progress> seen;
  auto loaded = load::load_model(config_for(dir), options_with([&](const model::Progress& p) {
                                    seen.push_back(p);
                                    return true;
                                  }));
  REQUIRE(seen.size() == loaded.report.tensors);
  for (size_t i = 1; i < seen.size(); ++i) CHECK(seen[i].bytes_done > seen[i - 1].bytes_done);
  CHECK(seen.back().bytes_done == seen.back().bytes_total);
  CHECK(seen.back().bytes_total == loaded.report.bytes);
  CHECK(seen.back().tensors_done == seen.back().tensors_total);
}

TEST_CASE("a cancelled load throws and leaves nothing allocated") {
  TempDir dir;
  write_gpt2(dir, at::kFloat);
  const auto config = config_for(dir, "dtype = \"bfloat16\"\n");  // conversion: every weight is allocated
  CountingAllocator counter;
  const int64_t before = counter.live();
  counter.reset_peak();
  size_t calls = 0;
  CHECK_THROWS_AS(load::load_model(config, options_with([&](const model::Progress&) { return ++calls < 10; })),
                  model::Cancelled);
  CHECK(calls == 10);
  CHECK(counter.peak() > before);  // the counter saw the weights come...
  CHECK(counter.live() == before);  // ...and go
}

TEST_CASE("memory while loading stays within the final size plus the largest tensor") {
  TempDir dir;
  write_gpt2(dir, at::kFloat);
  for (const char* extra : {"", "dtype = \"bfloat16\"\n"}) {
    const auto config = config_for(dir, extra);
    CountingAllocator counter;
    const int64_t before = counter.live();
    counter.reset_peak();
    auto loaded = load::load_model(config, options_with({}, false));
    const int64_t final_bytes = counter.live() - before;
    CHECK(final_bytes == static_cast<int64_t>(loaded.report.bytes));
    const int64_t largest_stored = 300 * 64 * 4;  // wte in float32, the largest tensor in the file
    CHECK(counter.peak() - before <= final_bytes + largest_stored);
  }
}

TEST_CASE("an architecture names every missing hyperparameter at once") {
  const hparams::Hyperparams none(R"({"model_type": "llama"})", "cfg.json");
  CHECK_THROWS_WITH(model::build_model("llama", none, at::kFloat),
                    "cfg.json: 5 missing hyperparameters: 'hidden_size' (an integer), 'num_hidden_layers' (an "
                    "integer), 'num_attention_heads' (an integer), 'vocab_size' (an integer), 'intermediate_size' (an "
                    "integer); set them in config.json or [arch]");
  // In a nested object, with its path.
  const hparams::Hyperparams linear(
      R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100,
          "intermediate_size": 128, "num_hidden_layers": 1, "rope_parameters": {"rope_type": "linear"}})",
      "cfg.json");
  CHECK_THROWS_WITH(model::build_model("llama", linear, at::kFloat),
                    "cfg.json: missing hyperparameter 'rope_parameters.factor' (a number, for rope type 'linear'; set "
                    "it in config.json or [arch])");
  // Rules between values still hold once nothing is missing, and a zero divides nothing.
  const hparams::Hyperparams zero(
      R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 0, "vocab_size": 100,
          "intermediate_size": 128, "num_hidden_layers": 1})",
      "cfg.json");
  CHECK_THROWS_WITH(model::build_model("llama", zero, at::kFloat),
                    "cfg.json: num_attention_heads (0) must be a positive multiple of num_key_value_heads (0)");
}
