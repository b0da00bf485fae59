#include "model/vram_stats.hpp"

#include <nlohmann/json.hpp>

namespace vramd::model {

void to_json(nlohmann::json& out, const VramStats& v) {
  out = {{"plan", v.plan},
         {"limit", v.limit ? nlohmann::json(v.limit) : nlohmann::json(nullptr)},
         {"total", v.total},
         {"resident", v.resident},
         {"streaming_room", v.streaming},
         {"layers", v.slots},
         {"resident_layers", v.resident_slots},
         {"onload", v.onload},
         {"disk_layers", v.disk_slots},
         {"packed", v.packed},
         {"held", v.held},
         {"staging", v.staging},
         {"peak", v.peak},
         {"host_staging", v.host_staging},
         {"loads", v.loads},
         {"prefetched", v.prefetched},
         {"bytes_streamed", v.bytes_streamed},
         {"bytes_mapped", v.bytes_mapped},
         {"bytes_packed", v.bytes_packed},
         {"bytes_moved", v.bytes_moved},
         {"wait_seconds", v.wait_seconds},
         {"read_seconds", v.read_seconds},
         {"order_learned", v.order_learned}};
  if (v.expert_slots)
    out["experts"] = {{"layers", v.expert_slots},     {"resident_layers", v.resident_expert_slots},
                      {"hits", v.expert_hits},        {"misses", v.expert_misses},
                      {"bytes_streamed", v.expert_bytes_streamed}, {"swaps", v.expert_swaps},
                      {"cpu_layers", v.host_expert_slots}, {"cpu_bytes", v.host_experts},
                      {"cpu_ops", v.expert_cpu_ops}};
}

}  // namespace vramd::model
