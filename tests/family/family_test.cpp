#include <catch2/catch.hpp>

#include "family/blueprint.hpp"
#include "family/catalog.hpp"
#include "family/family.hpp"
#include "hparams/hyperparams.hpp"
#include "support/temp_dir.hpp"
#include "util/error.hpp"

using namespace vramd;
using vramd::test::TempDir;

namespace {

std::string error_of(const std::function<void()>& run) {
  try {
    run();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A family of LLaMA's shape in a few lines, for the cases below.
constexpr const char* kSmall = R"(model_types = ["small"]
[hyperparameters]
hidden_size = "hidden_size"
num_layers = "num_hidden_layers"
num_heads = "num_attention_heads"
vocab_size = "vocab_size"
activation = { key = "hidden_act", default = "silu", map = { silu = "silu", gelu = "gelu_pytorch_tanh" } }
sliding_window = { key = "sliding_window", if = "use_sliding_window" }
[names]
embed_tokens = "embed"
layer = "layers.{i}"
q = "q"
k = "k"
v = "v"
o = "o"
gate = "gate"
up = "up"
down = "down"
[requires]
use_cache = [true, false]
)";

constexpr const char* kConfig =
    R"({"model_type": "small", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 10)";

family::Blueprint resolved(const std::string& extra_json, const std::string& family_text = kSmall) {
  const auto family = family::parse_family("small", family_text, "small.toml");
  return family::resolve(family, hparams::Hyperparams(std::string(kConfig) + extra_json + "}", "config.json"), {});
}

}  // namespace

TEST_CASE("a family file's mistakes are named with file, line and column, all at once") {
  const auto text = std::string(kSmall) + "[switches]\nnorm = \"rmsnorm\"\nlayer_count = 3\nhidden_size = 4\n";
  CHECK(error_of([&] { family::parse_family("small", text, "small.toml"); }) ==
        "small.toml:22:8: switches.norm = 'rmsnorm': the value: expected one of 'rms', 'layer', found \"rmsnorm\"\n"
        "small.toml:23:15: switches.layer_count = 3: no such switch of the engine (docs/architectures.md lists them)\n"
        "small.toml:24:15: switches.hidden_size = 4: set in both [hyperparameters] and [switches]");
  CHECK(error_of([&] { family::parse_family("x", "model_types = [\"x\"]\n[names]\nembed = \"e\"\n", "x.toml"); }) ==
        "x.toml: names.layer: missing (the module of layer {i}, e.g. \"model.layers.{i}\")\n"
        "x.toml:3:9: names.embed = 'e': no such slot (docs/architectures.md lists them)");
  CHECK(error_of([&] {
          family::parse_family("x", "model_types = [\"x\"]\n[hyperparameters]\nnum_heads = { key = \"h\", default = \"four\" }\n"
                                    "[names]\nlayer = \"l.{i}\"\n", "x.toml");
        }) == "x.toml:3:36: hyperparameters.num_heads.default = 'four': the default: expected an integer, found \"four\"");
}

TEST_CASE("a family resolves config values through keys, defaults, maps and conditions") {
  const auto b = resolved(R"(, "hidden_act": "gelu", "sliding_window": 4, "use_sliding_window": false)");
  CHECK((b.hidden == 8 && b.layers == 2 && b.heads == 2 && b.kv_heads == 2 && b.head_dim == 4 && b.intermediate == 32));
  CHECK(b.activation == "gelu_pytorch_tanh");
  CHECK(b.sliding_window == 0);  // use_sliding_window is false
  CHECK(resolved(R"(, "sliding_window": 4, "use_sliding_window": true)").sliding_window == 4);
  CHECK(b.blocks.size() == 2);
  CHECK(b.blocks[1].q == "layers.1.q");
  CHECK(b.blocks[1].attention_norm.empty());
}

TEST_CASE("config values a family cannot compute are refused naming the key") {
  CHECK(error_of([] { resolved(R"(, "hidden_act": "relu")"); }) ==
        "config.json: hyperparameter 'hidden_act' = \"relu\" is not one family 'small' computes ('gelu', 'silu')");
  CHECK(error_of([] { resolved(R"(, "use_cache": "yes")"); }) ==
        "config.json: hyperparameter 'use_cache' = \"yes\" is not supported by family 'small' (it computes true, false)");
  CHECK(error_of([] { resolved(R"(, "num_attention_heads": 3)"); }) ==
        "config.json: hidden_size (8) must be a multiple of num_attention_heads (3)");
  // Sizes no model has are refused before anything is built.
  CHECK(error_of([] { resolved(R"(, "num_hidden_layers": 1000000000)"); }) ==
        "config.json: num_hidden_layers (1000000000) must be in [0, 100000]");
  CHECK(error_of([] { resolved(R"(, "hidden_size": -8, "num_attention_heads": -2)"); }) ==
        "config.json: num_attention_heads (-2) must be a positive multiple of num_kv_heads (-2)");
  const std::string with_rope = std::string(kSmall).replace(std::string(kSmall).find("[names]"), 0, "rope = \"rope_parameters\"\n");
  CHECK(error_of([&] { resolved(R"(, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0})", with_rope); }) ==
        "config.json: hyperparameter 'rope_parameters.rope_type' = 'dynamic' is not supported (default, linear, llama3, "
        "yarn, longrope)");
  CHECK(error_of([&] { resolved(R"(, "rope_parameters": {"rope_type": "yarn"})", with_rope); }) ==
        "config.json: missing hyperparameter 'rope_parameters.factor' (a number, for rope type 'yarn'; set it in "
        "config.json or [arch])");
}

TEST_CASE("a family extends another and a user's folder adds and replaces families") {
  TempDir dir;
  dir.write("small.toml", kSmall);
  dir.write("smaller.toml", "extends = \"small\"\nmodel_types = [\"smaller\"]\n[switches]\nnorm = \"layer\"\n"
                            "[names]\ngate = \"\"\nup = \"fc\"\n[hyperparameters]\nmlp_gated = { key = \"gated\", default = false }\n");
  dir.write("llama.toml", "extends = \"small\"\nmodel_types = [\"llama\"]\n");
  dir.write("broken.toml", "model_types = [\"broken\"\n");
  const family::Catalog catalog({dir.path().string()});
  const auto smaller = catalog.named("smaller");
  CHECK(smaller->names.at("up").name == "fc");
  CHECK(!smaller->names.count("gate"));  // "" removed it
  CHECK(smaller->names.at("layer").name == "layers.{i}");
  CHECK(catalog.for_model_type("llama")->origin == dir / "llama.toml");  // the user's replaces the shipped one
  CHECK(catalog.for_model_type("mistral")->name == "mistral");
  const auto broken = error_of([&] { catalog.named("broken"); });
  CHECK(broken.starts_with(dir / "broken.toml:"));
  const auto unknown = error_of([&] { catalog.for_model_type("mamba"); });
  CHECK(unknown.starts_with("no family computes model_type 'mamba' (known: bert, "));
  CHECK(unknown.find("a family file that did not parse: " + dir / "broken.toml:") != std::string::npos);
  const auto b = family::resolve(*smaller, hparams::Hyperparams(std::string(kConfig) + "}", "config.json"), {});
  CHECK((b.norm == family::NormKind::Layer && !b.mlp_gated && b.blocks[0].up == "layers.0.fc" && b.blocks[0].gate.empty()));
}

TEST_CASE("every shipped family parses and computes the model types it declares") {
  const family::Catalog catalog;
  CHECK(catalog.names() ==
        "bert, clip_text, gemma, gemma2, gemma3, gpt2, llama, mistral, mixtral, olmo2, olmoe, phi3, qwen2, qwen2_moe, qwen3, "
        "qwen3_moe, roberta, t5_encoder");
  for (const char* type : {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "gpt2",
                           "bert", "roberta", "xlm-roberta", "clip_text_model", "t5", "mixtral", "qwen2_moe", "qwen3_moe",
                           "olmoe"})
    CHECK(!catalog.for_model_type(type)->names.empty());
}

TEST_CASE("a family's embedding order is its own, inherited, and checked") {
  CHECK(resolved("").embedding_order ==
        std::vector<std::string>{"embed_tokens", "embed_positions", "embed_types", "embed_norm"});
  const std::string ordered = "embedding_order = [\"embed_types\", \"embed_tokens\"]\n" + std::string(kSmall);
  CHECK(resolved("", ordered).embedding_order ==
        std::vector<std::string>{"embed_types", "embed_tokens", "embed_positions", "embed_norm"});
  const auto base = family::parse_family("small", ordered, "small.toml");
  const auto derived = family::parse_family("smaller", "extends = \"small\"\nmodel_types = [\"smaller\"]\n", "smaller.toml");
  CHECK(family::inherit(base, derived).embedding_order == std::vector<std::string>{"embed_types", "embed_tokens"});
  CHECK(error_of([&] {
          family::parse_family("x", "embedding_order = [\"embed_tokens\", \"lm_head\", \"embed_tokens\"]\n" + std::string(kSmall),
                               "x.toml");
        }) == "x.toml:1:19: embedding_order = [...]: 'lm_head' is not an embedding slot (embed_tokens, embed_positions, "
              "embed_types, embed_norm)\n"
              "x.toml:1:19: embedding_order = [...]: names 'embed_tokens' twice");
}

TEST_CASE("a mixture of experts resolves its sparse layers and names, and refuses what it cannot build") {
  // kSmall with a mixture: its switches before [names], its slots first in [names].
  std::string family_text = kSmall;
  family_text.insert(family_text.find("[names]\n") + 8,
                     "router = \"moe.gate\"\nexpert = \"moe.experts.{e}\"\nexpert_gate = \"w1\"\nexpert_up = \"w3\"\n"
                     "expert_down = \"w2\"\n");
  family_text.insert(family_text.find("[names]\n"),
                     "num_experts = \"num_experts\"\nexperts_per_token = \"num_experts_per_tok\"\n"
                     "expert_intermediate_size = \"moe_intermediate_size\"\nsparse_step = \"decoder_sparse_step\"\n"
                     "dense_layers = \"mlp_only_layers\"\n");
  std::string unnamed = family_text;  // routes, but names no experts
  unnamed.erase(unnamed.find("router = "), unnamed.find("expert_down = \"w2\"\n") + 19 - unnamed.find("router = "));
  const std::string config = R"(, "num_hidden_layers": 4, "num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 6)";
  const auto b = resolved(config + R"(, "decoder_sparse_step": 1, "mlp_only_layers": [2])", family_text);
  CHECK(b.sparse == std::vector<char>{1, 1, 0, 1});
  CHECK((b.experts == 3 && b.experts_per_token == 2 && b.expert_intermediate == 6 && !b.norm_topk_prob));
  CHECK(b.blocks[1].router == "layers.1.moe.gate");
  CHECK(b.blocks[1].experts.size() == 3);
  CHECK(b.blocks[1].experts[2].up == "layers.1.moe.experts.2.w3");
  CHECK((b.blocks[1].gate.empty() && b.blocks[2].gate == "layers.2.gate" && b.blocks[2].experts.empty()));
  CHECK(resolved(config + R"(, "decoder_sparse_step": 2)", family_text).sparse == std::vector<char>{0, 1, 0, 1});
  CHECK(error_of([&] { resolved(config + R"(, "num_experts_per_tok": 4)", family_text); }) ==
        "config.json: num_experts_per_tok (4) must be in [1, 3]");
  CHECK(error_of([&] { resolved(config + R"(, "mlp_only_layers": [1, "2"])", family_text); }) ==
        "config.json: hyperparameter 'mlp_only_layers': expected a list of integers, found [1,\"2\"]");
  // A family that routes but names no experts, and an expert name without {e}.
  CHECK(error_of([&] { resolved(config, unnamed); }) ==
        "small.toml: names: a mixture of experts (num_experts) needs router, expert, expert_gate, expert_up and "
        "expert_down");
  const std::string no_index = std::string(family_text).replace(family_text.find("{e}"), 3, "");
  CHECK(error_of([&] { family::parse_family("small", no_index, "small.toml"); }).find("names.expert = 'moe.experts.': must hold {e}") !=
        std::string::npos);
}
