// Resident weights: every weight in its computation state (device and dtype) while the model is
// awake, each op using its layer's own values. On the CPU, weights whose checkpoint bytes
// already have the right dtype and alignment are views of the file's mapping, not copies, and
// the copies (cast, converted) are shared with every config of the checkpoint that holds that
// weight alike and is loaded in the daemon meanwhile (weights/copy_key.hpp). A model
// that rests for its clients (config::rests_for_clients) holds them in its onload state's dtype
// on the host instead (GGUF blocks packed, as the state's `packed` says), for the leases its
// clients manage.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "weights/copy_key.hpp"
#include "weights/weights.hpp"

namespace vramd::weights {

struct Assignment;

class ResidentWeights final : public Weights {
 public:
  // Reads every weight, in checkpoint order, into the computation state, counting the views of
  // the mapping in `zero_copy`. Throws model::Cancelled (leaving nothing allocated) when
  // options.progress cancels.
  ResidentWeights(model::Model& model, std::shared_ptr<Source> source, const config::ModelConfig& config,
                  const model::LoadOptions& options, size_t& zero_copy);
  ~ResidentWeights() override;
  // The checkpoint's bytes the constructor would read as views (weights::planned_views).
  static model::FileSpans planned_views(const model::Model& model, const Source& source,
                                        const config::ModelConfig& config);
  ResidentWeights(const ResidentWeights&) = delete;
  ResidentWeights& operator=(const ResidentWeights&) = delete;

  std::vector<at::Tensor> acquire(const model::Layer& layer) override;
  void release(const model::Layer& layer) override;
  uint64_t sleep() override;
  uint64_t wake() override;
  std::optional<model::VramStats> stats() const override;
  std::map<std::string, uint64_t> bytes_by_device() const override;
  model::FileSpans views() const override;
  void check_leasable(const std::string& model, const std::string& device) const override;
  void update(const std::string& model, const WeightUpdate& update) override;
  std::shared_ptr<void> take_replaced(std::map<std::string, uint64_t>& bytes) override;

 private:
  uint64_t read_all(c10::Device device, c10::ScalarType dtype, bool packed, const model::LoadOptions* options,
                    size_t* zero_copy);
  uint64_t move_to(const config::DeviceState& state, bool packed);
  // Takes the checkpoint's pages that were read to be copied (cast, converted) out of the
  // daemon's mapping, once no weight views them (storage::DiskMap::unmap_pages_except).
  void unmap_copied() const;

  model::Model& model_;
  std::shared_ptr<Source> source_;
  config::VramConfig states_;
  config::DeviceState awake_;  // where the weights are while the model is awake
  bool zero_copy_;
  // GGUF blocks held as their packed bytes awake and asleep: only by a model that rests for its
  // clients, who unpack them (a model the daemon computes streams packed weights instead).
  bool packed_awake_, packed_offload_;
  // Parameters an update gave values no checkpoint holds: asleep on disk, they stay on the host.
  std::set<const model::Parameter*> updated_;
  std::vector<at::Tensor> replaced_;  // the values before an update, until take_replaced
  // The weights read_all read into copies that configs of the checkpoint share (CopyKeys), and
  // the spans views() names them by where they still hold that copy.
  struct Copy {
    const Assignment* assignment;
    std::string key;
    std::string span = copy_span(key);
  };
  std::vector<Copy> copies_;
};

}  // namespace vramd::weights
