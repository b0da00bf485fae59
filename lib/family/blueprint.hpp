// A family's switches resolved against one checkpoint's hyperparameters: everything the block
// engine (model/engine.cpp) needs to build the model on the meta device and run it, typed and
// checked. Every value a checkpoint cannot have (an unknown activation or rope type, a head
// count that does not divide) is an error naming the config.json key. Torch-free.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "family/family.hpp"

namespace vramd::hparams {
class Hyperparams;
}

namespace vramd::family {

// Rotary frequencies as transformers computes them for one rope type.
struct Rope {
  std::string type = "default";  // default, linear, llama3, yarn, longrope
  double theta = 10000;
  double factor = 1;
  bool factor_given = false;      // longrope: else max_positions / original_max_positions
  double partial = 1;             // the fraction of head_dim that rotates
  double low_freq_factor = 1, high_freq_factor = 4;  // llama3
  int64_t original_max_positions = 0;                // llama3, yarn, longrope
  double beta_fast = 32, beta_slow = 1;              // yarn
  bool truncate = true;                              // yarn
  std::optional<double> attention_factor;            // yarn, longrope; computed when absent
  std::optional<double> mscale, mscale_all_dim;      // yarn
  std::vector<double> short_factor, long_factor;     // longrope
};

enum class NormKind { Rms, Layer };
enum class Positions { Rope, Learned, Relative, None };

// The projections of one gated MLP: an expert, or a mixture's shared expert.
struct ExpertNames {
  std::string gate, up, down;
};

// Module names of one block, empty where the family has no such module.
struct BlockNames {
  std::string attention_norm, attention_post_norm, attention_residual_norm;
  std::string q, k, v, qkv, o, q_norm, k_norm;
  std::string mlp_norm, mlp_post_norm, mlp_residual_norm;
  std::string gate, up, gate_up, down;  // the dense MLP (empty in a sparse block)
  // A sparse block (a mixture of experts): its router, each expert, the shared expert and its
  // gate (empty where the family has none).
  std::string router, shared_expert_gate;
  std::vector<ExpertNames> experts;
  ExpertNames shared_expert;
};

struct Blueprint {
  std::string family;
  std::string origin;  // the hyperparameters' origin, for messages at run time
  std::string base_prefix;
  std::vector<std::string> ignored;

  int64_t hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0, vocabulary = 0;
  int64_t max_positions = 0;  // 0: no limit of the family's own
  std::string max_positions_key = "max_position_embeddings";  // the config.json key, for messages
  int64_t type_vocabulary = 2;

  NormKind norm = NormKind::Rms;
  double norm_eps = 1e-5, norm_offset = 0;
  bool norm_in_float = false, norm_bias = true;

  bool causal = true, qkv_bias = false, o_bias = false, full_qk_norm = false;
  bool conv1d = false;  // projections keep their weight as [in, out] (GPT-2's Conv1D)
  bool rotary_in_float = false;  // q and k rotate in float32, then back (OLMo 2)
  double attention_scale = 0;  // the product q k^T is scaled by; set from head_dim when 0
  bool scale_by_inverse_layer = false;
  double attention_softcap = 0;
  bool eager_attention = false;  // as transformers' eager path computes it (Gemma 2), not SDPA
  int64_t sliding_window = 0;
  std::vector<char> sliding;  // per layer: whether it attends within the window only

  Positions positions = Positions::Rope;
  Rope rope, local_rope;  // local_rope: the sliding layers' (Gemma 3); else rope
  bool padding_positions = false;  // RoBERTa: positions count from pad_token_id + 1 over tokens
  int64_t pad_token = 1;
  int64_t relative_buckets = 32, relative_max_distance = 128;

  bool embed_scale_sqrt_hidden = false;
  bool mlp_gated = true;
  std::string activation = "silu";
  bool mlp_bias = false;

  // Mixtures of experts: each sparse block routes every token to `experts_per_token` of
  // `experts` gated MLPs of `expert_intermediate` (0 experts: every block is dense).
  int64_t experts = 0, experts_per_token = 0, expert_intermediate = 0, shared_intermediate = 0;
  bool norm_topk_prob = false;           // the chosen experts' weights renormalised to sum to 1
  bool router_weights_in_float = false;  // and kept in float32 (Mixtral); else cast to the dtype
  std::vector<char> sparse;              // per layer: whether its MLP is a mixture
  double clip_qkv = 0;                   // q, k and v clamped to [-clip, clip] (OLMoE); 0: none

  bool tie_word_embeddings = false;  // and the checkpoint holds no head of its own
  int64_t projection_dim = 0;       // of the projection head (CLIP's text_projection)
  double final_softcap = 0;
  bool sentence_embedding = false;
  std::string pooling = "mean";
  bool normalize = false;
  bool pool_eos = false;
  int64_t eos_token = 2;

  // Global modules (empty: absent) and per-block ones.
  std::string embed_tokens, embed_positions, embed_types, embed_norm, relative_bias, final_norm, lm_head, pooler,
      projection;
  std::vector<std::string> embedding_order;  // the embedding slots, each once, in the family's module order
  std::vector<BlockNames> blocks;
};

// Resolves `family` for a checkpoint with these hyperparameters (a collecting view reports
// every missing key at once) whose tensors, as its converter names them, are `tensor_names`
// (an optional slot exists only when they hold its weight).
Blueprint resolve(const Family& family, const hparams::Hyperparams& hyperparams,
                  const std::vector<std::string>& tensor_names);

}  // namespace vramd::family
