// Models derived from another's config with a converter a client sends (POST
// /v1/models/BASE/derive): vramd.manage sends the Lua that does transformers' own load-time
// conversion of a checkpoint (python/vramd/transformers_converter.py), so that a module whose
// names and layouts are not the checkpoint's can lease them converted. Over a base whose config
// names a converter (gguf.lua: a GGUF file's names made Hugging Face's), the sent one reads
// that converter's results (chained). The derived model is an
// entry of its own, loaded once and leased by every client that sends the same text; its
// converter runs in the sandbox every converter runs in (convert/lua_sandbox.hpp).
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "convert/chain.hpp"
#include "server/catalog.hpp"
#include "server/registry.hpp"
#include "server/status.hpp"
#include "util/error.hpp"
#include "util/file.hpp"
#include "util/format.hpp"
#include "util/log.hpp"
#include "weights/holdings.hpp"

namespace vramd::server {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A model's derived models at most: each is an entry with its own copy of the converted weights
// once loaded, so a client cannot make them without end.
constexpr size_t kMaxDerived = 16;

// FNV-1a of the base's config and the converter: a name, not a proof; two texts whose names
// collide are told apart by comparing the texts themselves.
std::string digest(const std::string& base_text, const std::string& converter) {
  uint64_t h = 0xcbf29ce484222325ull;
  const auto mix = [&](const std::string& s) {
    for (const unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
    h = (h ^ 0xff) * 0x100000001b3ull;  // a separator no text of UTF-8 holds
  };
  mix(base_text);
  mix(converter);
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
  return std::string(out, 12);
}

void write_new_file(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw Error(path + ": " + std::strerror(errno));
  try {
    write_all(fd, text.data(), text.size(), path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

// A derive whose model's name `same` has already: that model, when it is the one asked for (the
// same base and converter), else a refusal.
void answer_existing(const Entry& same, const std::string& base, const std::string& converter, const std::string& what,
                     const std::function<void(int, const json&)>& done) {
  if (same.derived_from == base && same.derived_converter == converter && !same.removed) {
    json body = entry_json(same);
    body["created"] = false;
    return done(200, body);
  }
  done(409, {{"error", what + "the model " + quote(same.name) + " is " +
                           (same.removed ? "being removed; ask again once it is gone" : "another model's name")}});
}

}  // namespace

std::string Registry::derived_folder() {
  if (!derived_folder_.empty()) return derived_folder_;
  // Beside the socket, in the folder the daemon owns (only its user may enter the default one),
  // named after the socket, which is this daemon's alone: what a daemon that crashed left there
  // goes first.
  const fs::path socket(config_.socket);
  const fs::path parent = socket.has_parent_path() ? socket.parent_path() : fs::temp_directory_path();
  const std::string prefix = socket.filename().string() + ".derived-";
  std::error_code ec;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename().string().starts_with(prefix)) fs::remove_all(it->path(), ec);
  std::string pattern = (parent / (prefix + "XXXXXX")).string();
  if (!::mkdtemp(pattern.data()))
    throw Error("cannot make a folder for derived models' converters in " + parent.string() + ": " + std::strerror(errno));
  return derived_folder_ = pattern;
}

void Registry::derive(Entry& base, std::string converter, std::function<void(int, const json&)> done) {
  const auto refuse = [&](int status, const std::string& message) { done(status, {{"error", message}}); };
  const std::string what = "derive " + quote(base.name) + ": ";
  if (shutting_down_) return refuse(503, "vramd is shutting down");
  if (!base.derived_from.empty())
    return refuse(400, what + "it is derived from " + quote(base.derived_from) + " already; derive from that model, "
                                 "whose checkpoint's own names the converter reads");
  if (base.removed) return refuse(404, what + "the model was removed");
  if (!base.config || !base.dry)
    return refuse(409, what + "its config is invalid: " + base.reason);
  if (base.config->converter == config::kTransformersConverter)
    return refuse(409, what + "its config names transformers' conversion (converter = \"transformers\") already, so "
                           "its names are the transformers module's: lease it as it is");
  if (converter.empty()) return refuse(400, what + "the converter is empty");
  if (converter.size() > kMaxScriptBytes)
    return refuse(413, what + "the converter is " + format_bytes(converter.size()) + ", over the " +
                           format_bytes(kMaxScriptBytes) + " a converter script may be");

  const std::string name = base.name + ".derived-" + digest(base.serving_text, converter);
  if (const Entry* same = find(name)) return answer_existing(*same, base.name, converter, what, done);
  size_t derived = 0;
  for (const auto& [n, e] : entries_) derived += e->derived_from == base.name && !e->removed;
  if (derived >= kMaxDerived)
    return refuse(409, what + "it has " + std::to_string(derived) + " derived models already, the most one model may "
                           "have; unload and change its config to let them go");

  std::string file;
  try {
    file = (fs::path(derived_folder()) / (std::to_string(++derivations_) + ".lua")).string();
  } catch (const Error& e) {
    return refuse(500, what + e.what());
  }
  // Checked on the validator's thread as a config is (server/catalog.hpp): the converter, the
  // names it gives, the weights' plan and the budgets.
  validator_.run([this, config = *base.config, name, file, converter, base_name = base.name, base_text = base.serving_text,
                  daemon = config_, done = std::move(done), what]() mutable {
    auto checked = std::make_shared<ConfigFile>();
    checked->file = file;
    try {
      const std::string text = config.converter.empty() ? converter
                               : convert::chained("the base's converter (" + config.converter + ")",
                                                  read_regular_file(config.converter, kMaxScriptBytes), converter);
      if (text.size() > kMaxScriptBytes)
        throw Error("the converter sent and the base's (" + config.converter + ") are " + format_bytes(text.size()) +
                    " together, over the " + format_bytes(kMaxScriptBytes) + " a converter script may be");
      write_new_file(file, text);
      config.name = name;
      config.converter = file;
      auto dry = load::dry_run(config);
      weights::check_budgets(config, dry, daemon);
      checked->dry = std::move(dry);
      checked->config = std::move(config);
    } catch (const std::exception& e) {
      // The file is the daemon's own and goes now: the client's text is "the converter sent".
      checked->error = e.what();
      for (size_t at; (at = checked->error.find(file)) != std::string::npos;)
        checked->error.replace(at, file.size(), "the converter sent");
      std::error_code ec;
      fs::remove(file, ec);
    }
    mailbox_.post([this, checked, name, converter, base_name, base_text, done = std::move(done), what] {
      if (!checked->config) return done(400, {{"error", what + checked->error}});
      const Entry* base = find(base_name);
      const bool changed = !base || base->removed || base->serving_text != base_text;
      const Entry* same = find(name);  // another client's request for the same text came first
      if (shutting_down_ || changed || same) {
        std::error_code ec;
        fs::remove(checked->file, ec);
      }
      if (shutting_down_) return done(503, {{"error", "vramd is shutting down"}});
      if (changed) return done(409, {{"error", what + "its config changed while the derived model was checked; ask again"}});
      if (same) return answer_existing(*same, base_name, converter, what, done);
      Entry& entry = add_entry(name);
      entry.derived_from = base_name;
      entry.derived_converter = converter;
      entry.text = entry.serving_text = base_text;
      entry.config = std::move(checked->config);
      entry.dry = std::move(checked->dry);
      entry.keep_alive = entry.config->residency.keep_alive;
      log::info("derived " + name + " from " + base_name + ": " + entry.dry->architecture + ", " + entry.dry->dtype + ", " +
                format_bytes(entry.dry->report.bytes) + ", " + std::to_string(entry.dry->report.tensors) + " tensors");
      json body = entry_json(entry);
      body["created"] = true;
      done(200, body);
    });
  });
}

void Registry::remove(Entry& entry, std::shared_ptr<Exchange> exchange) {
  Job asked(Job::Kind::Unload, exchange);
  if (entry.derived_from.empty())
    return answer(asked, 409, {{"error", "model " + quote(entry.name) + " is the config file " + entry.file +
                                             "'s: remove that file to remove the model (DELETE removes models made "
                                             "by POST /v1/models/NAME/derive)"}});
  entry.removal_watchers.push_back(std::move(exchange));
  if (entry.removed) return;  // going already: answered with the others
  log::info(entry.name + ": removing it, as DELETE asked");
  entry.removed = true;
  if (entry.busy || entry.runtime) submit(entry, Job(Job::Kind::Unload));
  else drop_entry(entry);
}

void Registry::retire_derived(const Entry& base) {
  std::vector<Entry*> derived;
  for (auto& [name, e] : entries_)
    if (e->derived_from == base.name && !e->removed) derived.push_back(e.get());
  for (Entry* e : derived) {
    log::info(e->name + ": the config of " + base.name + " changed; removing the model derived from it");
    e->removed = true;
    if (e->busy || e->runtime) submit(*e, Job(Job::Kind::Unload));
    else drop_entry(*e);
  }
}

}  // namespace vramd::server
