#include <catch2/catch.hpp>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "config/daemon_config.hpp"
#include "config/model_config.hpp"
#include "support/temp_dir.hpp"
#include "util/error.hpp"

using namespace vramd::config;
using vramd::test::TempDir;

namespace {

std::string problems_of(const std::string& path, const DaemonConfig& daemon) {
  try {
    load_model_config(path, daemon);
  } catch (const vramd::Error& e) {
    return e.what();
  }
  return "(accepted)";
}

DaemonConfig daemon_with(std::map<std::string, uint64_t> budgets) {
  DaemonConfig daemon = default_daemon_config();
  daemon.path = "vramd.toml";
  daemon.budgets = std::move(budgets);
  return daemon;
}

}  // namespace

TEST_CASE("a full model config is read with paths resolved against its folder") {
  TempDir dir;
  std::filesystem::create_directories(dir.path() / "models");
  std::filesystem::create_directories(dir.path() / "scripts");
  dir.write("scripts/hf_llama.lua", "return {}");
  auto path = dir.write("models/tiny.toml", R"(
name = "tiny-llama"
architecture = "llama"
checkpoint = ["../weights/a.safetensors", "../weights/b.safetensors"]
prefix = "model."
converter = "hf_llama.lua"
dtype = "bfloat16"
strict = false

[vram]
offload     = { device = "disk", dtype = "bfloat16" }
onload      = { device = "cpu",  dtype = "bfloat16" }
preparing   = { device = "cuda", dtype = "float8_e4m3fn" }
computation = { device = "cuda:0", dtype = "bfloat16" }
limit = "6GiB"

[residency]
keep_alive = "-1"
pinned = true
preload = true

[arch]
rope_theta = 500000.0
num_key_value_heads = 8
)");
  auto daemon = daemon_with({{"cuda:0", 70ull << 30}});
  daemon.converters = {(dir.path() / "scripts").string()};
  auto config = load_model_config(path, daemon);
  CHECK(config.name == "tiny-llama");
  CHECK(config.architecture == "llama");
  CHECK(config.checkpoint == std::vector<std::string>{dir / "weights/a.safetensors", dir / "weights/b.safetensors"});
  CHECK(config.prefix == "model.");
  CHECK(config.converter == dir / "scripts/hf_llama.lua");
  CHECK_FALSE(config.strict);
  CHECK(config.vram.offload.device.str() == "disk");
  CHECK(config.vram.preparing.device.str() == "cuda:0");
  CHECK(dtype_str(config.vram.preparing.dtype) == "float8_e4m3fn");
  CHECK(config.vram.limit == 6ull << 30);
  CHECK(config.residency.keep_alive == std::nullopt);
  CHECK(config.residency.pinned);
  CHECK(config.residency.preload);
  auto arch = nlohmann::json::parse(config.arch_json);
  CHECK(arch["rope_theta"] == 500000.0);
  CHECK(arch["num_key_value_heads"] == 8);
}

TEST_CASE("a minimal model config takes its name from the file and fills every state from the next") {
  TempDir dir;
  auto path = dir.write("minilm.toml", "checkpoint = \"weights\"\n[vram]\ncomputation = { dtype = \"float16\" }\n");
  auto config = load_model_config(path, default_daemon_config());
  CHECK(config.name == "minilm");
  CHECK(dtype_str(config.dtype) == "auto");
  CHECK(config.strict);
  CHECK(config.arch_json == "{}");
  for (const auto* state : {&config.vram.offload, &config.vram.onload, &config.vram.preparing, &config.vram.computation}) {
    CHECK(state->device.str() == "cpu");
    CHECK(dtype_str(state->dtype) == "float16");
  }
  CHECK(config.residency.keep_alive == std::chrono::minutes(10));
}

TEST_CASE("a float8 model dtype makes weights wait and rest in it and compute in bfloat16") {
  TempDir dir;
  auto path = dir.write("f8.toml", "checkpoint = \"w\"\ndtype = \"float8_e5m2\"\n[vram]\ncomputation = { device = \"cuda:1\" }\n");
  auto config = load_model_config(path, default_daemon_config());
  CHECK(config.vram.computation.device.str() == "cuda:1");
  CHECK(dtype_str(config.vram.computation.dtype) == "bfloat16");
  for (const auto* state : {&config.vram.offload, &config.vram.onload, &config.vram.preparing}) {
    CHECK(state->device.str() == "cuda:1");
    CHECK(dtype_str(state->dtype) == "float8_e5m2");
  }
}

TEST_CASE("packed is read per state and passed on as device and dtype are") {
  TempDir dir;
  auto path = dir.write("q.toml", "checkpoint = \"w\"\n[vram]\npreparing = { packed = true }\n"
                                  "offload = { device = \"cpu\", packed = false }\n");
  auto config = load_model_config(path, default_daemon_config());
  CHECK(config.vram.preparing.packed == true);
  CHECK(config.vram.onload.packed == true);
  CHECK(config.vram.offload.packed == false);
  CHECK(!config.vram.computation.packed);
  auto unset = load_model_config(dir.write("auto.toml", "checkpoint = \"w\"\n"), default_daemon_config());
  for (const auto* state : {&unset.vram.offload, &unset.vram.onload, &unset.vram.preparing}) CHECK(!state->packed);
}

TEST_CASE("packed where weights cannot be held packed is an error naming it") {
  TempDir dir;
  auto path = dir.write("q.toml", R"(checkpoint = "w"
[vram]
computation = { packed = true }
onload = { device = "disk", packed = true }
[partition]
world_size = 2
)");
  auto partitioned = dir.write("p.toml", "checkpoint = \"w\"\n[vram]\npreparing = { packed = true }\n"
                                         "[partition]\nworld_size = 2\n");
  CHECK(problems_of(path, default_daemon_config()) ==
        path + ":3:26: vram.computation.packed = true: ops compute on unpacked weights; GGUF blocks stay packed in offload, "
               "onload and preparing, and are unpacked into the computation dtype right before each op\n" +
        path + ":4:38: vram.onload.packed = true: onload is on disk, where weights are the checkpoint's own bytes; packed says "
               "how a state in memory holds them (preparing = { packed = true } streams GGUF blocks packed)");
  CHECK(problems_of(partitioned, default_daemon_config()) ==
        partitioned + ":5:14: partition.world_size = 2: each rank holds a slice of every weight, cut element by element, "
                      "which would cut GGUF blocks apart: remove packed = true from [vram] to partition the model");
}

TEST_CASE("preparing is on the computation device") {
  TempDir dir;
  auto path = dir.write("p.toml", "checkpoint = \"w\"\n[vram]\npreparing = { device = \"cuda:0\" }\n");
  CHECK(problems_of(path, default_daemon_config()) ==
        path + ":3:13: vram.preparing = {...}: preparing is where weights wait, ready, on the computation device (cpu), "
               "not on cuda:0; weights that rest elsewhere belong in onload");
}

TEST_CASE("every mistake in a model config is reported with its line and column") {
  TempDir dir;
  auto path = dir.write("bad.toml", R"(name = "bad model"
checkpoint = 42
dtype = "bfloat17"
[vram]
ofload = { device = "disk" }
preparing = { device = "disk" }
computation = { device = "cuda:0", dtype = "float8_e4m3fn" }
limit = "6GB?"
[residency]
keep_alive = "10 minutes"
pined = true
)");
  const std::string expected =
      path + ":1:8: name = 'bad model': a name is 1-128 ASCII letters, digits, '-', '_' or '.', starting with a letter or digit\n" +
      path + ":2:14: checkpoint = 42: expected a string or an array of strings, found an integer\n" +
      path + ":3:9: dtype = 'bfloat17': expected auto, float32, bfloat16, float16, float8_e4m3fn or float8_e5m2\n" +
      path + ":5:1: unknown key 'ofload' in [vram]; did you mean 'offload'?\n" +
      path + ":6:24: vram.preparing.device = 'disk': only offload and onload can be on disk; preparing needs \"cpu\", \"cuda\" or \"cuda:N\"\n" +
      path + ":7:15: vram.computation = {...}: weights can rest in float8 (offload, onload, preparing) but are computed in float32, bfloat16 or float16\n" +
      path + ":8:9: vram.limit = '6GB?': '6GB?' is not a size; expected a number and a unit such as \"512MiB\", \"2GiB\" or \"1.5GB\"\n" +
      path + ":10:14: residency.keep_alive = '10 minutes': '10 minutes' is not a duration; expected e.g. \"30s\", \"10m\", \"1h30m\", \"250ms\", \"0\", or \"-1\" for forever\n" +
      path + ":11:1: unknown key 'pined' in [residency]; did you mean 'pinned'?";
  CHECK(problems_of(path, daemon_with({{"cpu", 1ull << 30}})) == expected);
}

TEST_CASE("a limit needs a budget for the computation device and must fit in it") {
  TempDir dir;
  auto path = dir.write("m.toml", "checkpoint = \"w\"\n[vram]\ncomputation = { device = \"cuda\" }\nlimit = \"6GiB\"\n");
  CHECK(problems_of(path, daemon_with({{"cpu", 8ull << 30}})) ==
        path + ":4:9: vram.limit = '6GiB': a limit on cuda:0, for which vramd.toml sets no budget (budgets: cpu 8.00 GiB)");
  CHECK(problems_of(path, daemon_with({{"cuda:0", 4ull << 30}})) ==
        path + ":4:9: vram.limit = '6GiB': more than the daemon's whole budget for cuda:0 (4.00 GiB)");
  CHECK(problems_of(path, daemon_with({{"cuda:0", 8ull << 30}})) == "(accepted)");
}

TEST_CASE("a missing checkpoint or converter and a syntax error are reported") {
  TempDir dir;
  auto no_checkpoint = dir.write("a.toml", "name = \"a\"\n");
  CHECK(problems_of(no_checkpoint, default_daemon_config()) ==
        no_checkpoint + ":1:1: missing key 'checkpoint' (a file, folder, index.json, glob or list of them)");
  auto no_script = dir.write("b.toml", "checkpoint = \"w\"\nconverter = \"gone.lua\"\n");
  CHECK(problems_of(no_script, default_daemon_config()) ==
        no_script + ":2:13: converter = 'gone.lua': no such script (looked for " + dir / "gone.lua" + ")");
  auto odd_script = dir.write("b2.toml", "checkpoint = \"w\"\nconverter = \"gone\\n.lua\"\n");
  CHECK(problems_of(odd_script, default_daemon_config()) ==
        odd_script + ":2:13: converter = 'gone\\x0a.lua': no such script (looked for " + dir / "gone\\x0a.lua" + ")");
  // "transformers" is no script: the daemon's Python writes it (load/conversion.hpp).
  auto daemon = default_daemon_config();
  daemon.python = "/opt/venv/bin/python";
  const auto transformers = load_model_config(dir.write("t.toml", "checkpoint = \"w\"\nconverter = \"transformers\"\n"), daemon);
  CHECK(transformers.converter == kTransformersConverter);
  CHECK(transformers.python == "/opt/venv/bin/python");
  CHECK(transformers.converter_first.empty());
  // A GGUF file's names are made Hugging Face's by gguf.lua first, where the converter folders
  // hold it.
  auto gguf = dir.write("t2.toml", "checkpoint = \"m.gguf\"\nconverter = \"transformers\"\n");
  CHECK(problems_of(gguf, daemon) ==
        gguf + ":2:13: converter = 'transformers': transformers' rules read Hugging Face's names, which the shipped "
               "converter gguf.lua makes of a GGUF file's, and none of the daemon's converter folders holds it (looked "
               "for " + dir / "gguf.lua" + ")");
  std::filesystem::create_directories(dir / "scripts");
  dir.write("scripts/gguf.lua", "return {}\n");
  daemon.converters = {dir / "scripts"};
  const auto chained = load_model_config(gguf, daemon);
  CHECK(chained.converter == kTransformersConverter);
  CHECK(chained.converter_first == dir / "scripts/gguf.lua");
  auto syntax = dir.write("c.toml", "name = \"unterminated\n");
  CHECK_THAT(problems_of(syntax, default_daemon_config()), Catch::StartsWith(syntax + ":1:"));
  // The parser quotes what it saw, which may hold a newline or any control character: one line.
  auto quoted = dir.write("d.toml", std::string("checkpoint = \"w\"\nstrict = f\n\0\0\0\n", 28));
  CHECK(problems_of(quoted, default_daemon_config()) ==
        quoted + ":2:11: Error while parsing boolean: expected 'false', saw 'f\\x0a'");
  // A value that holds a newline or a backslash is quoted on one line too, however long.
  auto name = dir.write("e.toml", "checkpoint = \"w\"\nname = \"" + std::string(60, '\\') + "\\n=big\"\n");
  CHECK(problems_of(name, default_daemon_config()) ==
        name + ":2:8: name = '" + std::string(60, '\\') + "\\x0a=big': a name is 1-128 ASCII letters, digits, '-', '_' "
                              "or '.', starting with a letter or digit");
}

TEST_CASE("the daemon config reads budgets and defaults and refuses unknown devices and keys") {
  TempDir dir;
  std::filesystem::create_directory(dir / "scripts");
  auto good = dir.write("vramd.toml", R"(socket = "run/vramd.sock"
models = "models"
converters = ["scripts", "/usr"]
log_level = "debug"
[budgets]
cpu = "16GiB"
cuda = "70GiB"
"cuda:1" = 1073741824
[defaults]
keep_alive = "30s"
)");
  auto daemon = load_daemon_config(good);
  CHECK(daemon.socket == dir / "run/vramd.sock");
  CHECK(daemon.models == dir / "models");
  CHECK(daemon.converters == std::vector<std::string>{dir / "scripts", "/usr"});
  CHECK(daemon.log_level == "debug");
  CHECK(daemon.budgets == std::map<std::string, uint64_t>{{"cpu", 16ull << 30}, {"cuda:0", 70ull << 30}, {"cuda:1", 1ull << 30}});
  CHECK(daemon.keep_alive == std::chrono::seconds(30));
  CHECK(daemon.python == "python3");  // converter = "transformers"'s, looked up on PATH

  // A python with a slash is a path beside the file; a bare name is looked up on PATH.
  CHECK(load_daemon_config(dir.write("venv.toml", "python = \"../venv/bin/python\"\n")).python ==
        (dir.path().parent_path() / "venv/bin/python").string());
  CHECK(load_daemon_config(dir.write("named.toml", "python = \"python3.11\"\n")).python == "python3.11");
  CHECK_THROWS_WITH(load_daemon_config(dir.write("none.toml", "python = \"\"\n")), Catch::Contains("python = '': names no program"));

  // A folder to look in that is not there is a typo, named with where it was looked for.
  auto typo = dir.write("typo.toml", "architectures = [\"famlies\"]\n");
  CHECK_THROWS_WITH(load_daemon_config(typo), typo + ":1:17: architectures = [...]: 'famlies' is not a folder ('" +
                                                  dir / "famlies" + "')");

  auto bad = dir.write("bad.toml", "log_level = \"loud\"\nsokcet = \"x\"\n[budgets]\ngpu = \"1GiB\"\n");
  CHECK_THROWS_WITH(load_daemon_config(bad),
                    bad + ":1:13: log_level = 'loud': expected one of error, warn, info, debug\n" +
                    bad + ":2:1: unknown key 'sokcet'; did you mean 'socket'?\n" +
                    bad + ":4:7: budgets.gpu = '1GiB': not a device; expected \"cpu\", \"cuda\" or \"cuda:N\"");
  // A key of the user's own is escaped as a value is: one line, no control byte.
  auto odd = dir.write("odd.toml", "[budgets]\n\"gpu\\n\\u001b[2J\" = \"1GiB\"\n");
  CHECK_THROWS_WITH(load_daemon_config(odd),
                    odd + ":2:20: budgets.gpu\\x0a\\x1b[2J = '1GiB': not a device; expected \"cpu\", \"cuda\" or \"cuda:N\"");
}

TEST_CASE("the daemon config reads access and limits and refuses what it cannot honour") {
  TempDir dir;
  auto good = dir.write("vramd.toml", R"(tcp = "127.0.0.1:11500"
[access]
uids = [1001, 1002]
group = "root"
[limits]
max_header_size = "16KiB"
max_body_size = "1GiB"
max_connections = 32
idle_timeout = "5s"
request_timeout = "2s"
queue_length = 4
shutdown_grace = "1m"
)");
  auto daemon = load_daemon_config(good);
  CHECK(daemon.tcp == "127.0.0.1:11500");
  CHECK(daemon.access.uids == std::vector<uint32_t>{1001, 1002});
  CHECK(daemon.access.group == "root");
  CHECK(daemon.access.gid == 0);
  CHECK(daemon.limits.max_header_bytes == 16u << 10);
  CHECK(daemon.limits.max_body_bytes == 1ull << 30);
  CHECK(daemon.limits.max_connections == 32);
  CHECK(daemon.limits.idle_timeout == std::chrono::seconds(5));
  CHECK(daemon.limits.request_timeout == std::chrono::seconds(2));
  CHECK(daemon.limits.queue_length == 4);
  CHECK(daemon.limits.shutdown_grace == std::chrono::minutes(1));

  auto bad = dir.write("bad.toml", R"(tcp = "0.0.0.0:80"
[access]
uids = [-1]
group = "no-such-group-here"
[limits]
max_header_size = "1MiB"
max_connections = 0
request_timeout = "-1"
)");
  CHECK_THROWS_WITH(load_daemon_config(bad),
                    bad + ":1:7: tcp = '0.0.0.0:80': only a loopback address (127.x.x.x) may be used: TCP clients cannot be identified\n" +
                    bad + ":3:8: access.uids = [...]: expected an array of integers from 0 to 4294967295\n" +
                    bad + ":4:9: access.group = 'no-such-group-here': no such group on this machine\n" +
                    bad + ":6:19: limits.max_header_size = '1MiB': expected from 1KiB to 80KiB\n" +
                    bad + ":7:19: limits.max_connections = 0: expected an integer from 1 to 65536\n" +
                    bad + ":8:19: limits.request_timeout = '-1': expected a positive duration such as \"30s\"");
}

TEST_CASE("a partition table is read and its mistakes are reported") {
  TempDir dir;
  auto good = dir.write("p.toml", R"(checkpoint = "w"
[partition]
world_size = 4
replicate = ["*norm*", "lm_head.bias"]
timeout = "2m"
)");
  auto config = load_model_config(good, default_daemon_config());
  CHECK(config.partition.world_size == 4);
  CHECK(config.partition.replicate == std::vector<std::string>{"*norm*", "lm_head.bias"});
  CHECK(config.partition.timeout == std::chrono::minutes(2));

  auto bad = dir.write("bad.toml", R"(checkpoint = "w"
[partition]
world_size = 0
replicate = "norm"
timeout = "-1"
ranks = 2
)");
  CHECK(problems_of(bad, default_daemon_config()) ==
        bad + ":3:14: partition.world_size = 0: expected an integer from 1 to 4096\n" +
        bad + ":5:11: partition.timeout = '-1': ranks that never answer must fail the load: give a duration such as \"60s\"\n" +
        bad + ":6:1: unknown key 'ranks' in [partition]");
  auto missing = dir.write("missing.toml", "checkpoint = \"w\"\n[partition]\nreplicate = []\n");
  CHECK(problems_of(missing, default_daemon_config()) ==
        missing + ":2:1: missing key 'world_size' in [partition] (the number of ranks)");
}

TEST_CASE("the daemon config's group table is read and its mistakes are reported") {
  TempDir dir;
  auto good = dir.write("vramd.toml", "[group]\nworld_size = 2\ninterface = \"lo\"\n");
  CHECK(load_daemon_config(good).world_size == 2);
  CHECK(load_daemon_config(good).interface == "lo");
  CHECK(default_daemon_config().world_size == 1);
  CHECK(default_daemon_config().interface.empty());
  auto unknown = dir.write("unknown.toml", "[group]\ninterface = \"no-such-if0\"\n");
  CHECK_THROWS_WITH(load_daemon_config(unknown),
                    Catch::StartsWith(unknown + ":2:13: group.interface = 'no-such-if0': no such network interface on this "
                                                "machine (it has ") &&
                        Catch::Contains("lo"));
  auto bad = dir.write("bad.toml", "[group]\nworld_size = 1000\nword_size = 2\n");
  CHECK_THROWS_WITH(load_daemon_config(bad), bad + ":2:14: group.world_size = 1000: expected an integer from 1 to 256\n" +
                                                 bad + ":3:1: unknown key 'word_size' in [group]; did you mean 'world_size'?");
}

TEST_CASE("direct reads are on, off or chosen at load, the default") {
  TempDir dir;
  auto on = dir.write("on.toml", "checkpoint = \"w\"\n[vram]\ndirect_io = true\n");
  CHECK(load_model_config(on, default_daemon_config()).vram.direct_io == true);
  auto off = dir.write("off.toml", "checkpoint = \"w\"\n[vram]\ndirect_io = false\n");
  CHECK(load_model_config(off, default_daemon_config()).vram.direct_io == false);
  auto unset = dir.write("unset.toml", "checkpoint = \"w\"\n[vram]\nlimit = \"1GiB\"\n");
  CHECK_FALSE(load_model_config(unset, daemon_with({{"cpu", 8ull << 30}})).vram.direct_io.has_value());
  auto automatic = dir.write("auto.toml", "checkpoint = \"w\"\n[vram]\ndirect_io = \"auto\"\n");
  CHECK_FALSE(load_model_config(automatic, default_daemon_config()).vram.direct_io.has_value());
  auto bad = dir.write("bad.toml", "checkpoint = \"w\"\n[vram]\ndirect_io = \"yes\"\n");
  CHECK(problems_of(bad, default_daemon_config()) == bad + ":3:13: vram.direct_io = 'yes': expected true, false or \"auto\"");
}

TEST_CASE("an onload limit needs an onload device and room in its budget") {
  TempDir dir;
  auto on_disk = dir.write("a.toml", "checkpoint = \"w\"\n[vram]\nonload = { device = \"disk\" }\nlimit = \"1GiB\"\nonload_limit = \"2GiB\"\n");
  CHECK(problems_of(on_disk, daemon_with({{"cpu", 8ull << 30}})) ==
        on_disk + ":5:16: vram.onload_limit = '2GiB': it caps the weights resting on the onload device, and onload is "
                  "\"disk\"; give onload a device such as \"cpu\"");
  auto both_cpu = dir.write("b.toml", "checkpoint = \"w\"\n[vram]\nonload = { device = \"cpu\" }\nlimit = \"3GiB\"\nonload_limit = \"6GiB\"\n");
  CHECK(problems_of(both_cpu, daemon_with({{"cpu", 8ull << 30}})) ==
        both_cpu + ":5:16: vram.onload_limit = '6GiB': with vram.limit (3.00 GiB) on the same device, more than the "
                   "daemon's whole budget for cpu (8.00 GiB)");
  CHECK(load_model_config(both_cpu, daemon_with({{"cpu", 9ull << 30}})).vram.onload_limit == 6ull << 30);
  // The two limits' sum must not wrap around to fit: 2^64 - 2 KiB (the largest size below 2^64)
  // and 1 GiB add up to 1 GiB - 2 KiB in 64 bits.
  auto wraps = dir.write("w.toml", "checkpoint = \"w\"\n[vram]\nonload = { device = \"cpu\" }\nlimit = \"1GiB\"\n"
                                   "onload_limit = \"18446744073709549568B\"\n");
  CHECK(problems_of(wraps, daemon_with({{"cpu", 8ull << 30}})) ==
        wraps + ":5:16: vram.onload_limit = '18446744073709549568B': with vram.limit (1.00 GiB) on the same device, "
                "more than the daemon's whole budget for cpu (8.00 GiB)");
  auto no_budget = dir.write("c.toml", "checkpoint = \"w\"\n[vram]\ncomputation = { device = \"cuda\" }\nonload = { device = \"cpu\" }\nonload_limit = \"6GiB\"\n");
  CHECK(problems_of(no_budget, daemon_with({{"cuda:0", 8ull << 30}})) ==
        no_budget + ":5:16: vram.onload_limit = '6GiB': a limit on cpu, for which vramd.toml sets no budget (budgets: "
                    "cuda:0 8.00 GiB)");
}

TEST_CASE("devices are parsed once into disk, cpu or cuda:N") {
  CHECK(Device::named("cuda").str() == "cuda:0");
  CHECK(Device::named("cuda:12").index == 12);
  CHECK(Device::named("cuda:12").kind == Device::Kind::Cuda);
  CHECK(Device::named("disk").is_disk());
  CHECK(Device::named("cpu").is_cpu());
  CHECK(Device::named("cuda") == Device::named("cuda:0"));
  CHECK_FALSE(Device::named("cuda:1") == Device::named("cuda:0"));
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:99999", "CPU", ""})
    CHECK_FALSE(Device::parse(bad));
  CHECK_THROWS_WITH(Device::named("gpu"), "unknown device 'gpu' (disk, cpu, cuda, cuda:N)");
}

TEST_CASE("[[lora]] tables are read in order with paths resolved, and bad ones are named at their line") {
  TempDir dir;
  auto path = dir.write("l.toml", "checkpoint = \"w\"\nfuse_lora = false\n[[lora]]\npath = \"a/\"\n[[lora]]\npath = \"/x/b.safetensors\"\nscale = -0.5\n");
  auto config = load_model_config(path, default_daemon_config());
  CHECK_FALSE(config.fuse_lora);
  CHECK(load_model_config(dir.write("d.toml", "checkpoint = \"w\"\n"), default_daemon_config()).fuse_lora);
  REQUIRE(config.lora.size() == 2);
  CHECK(config.lora[0] == LoraConfig{(std::filesystem::path(path).parent_path() / "a/").string(), 1.0});
  CHECK(config.lora[1] == LoraConfig{"/x/b.safetensors", -0.5});

  auto bad = dir.write("b.toml", "checkpoint = \"w\"\n[[lora]]\nscale = \"big\"\npaths = \"a\"\n");
  const std::string problems = problems_of(bad, default_daemon_config());
  CHECK_THAT(problems, Catch::Contains(bad + ":2:1: missing key 'path' in [[lora]]"));
  CHECK_THAT(problems, Catch::Contains(bad + ":3:9: lora[1].scale = 'big': expected a number from"));
  CHECK_THAT(problems, Catch::Contains("paths"));
  auto table = dir.write("t.toml", "checkpoint = \"w\"\nlora = \"a\"\n");
  CHECK_THAT(problems_of(table, default_daemon_config()), Catch::Contains("lora = 'a': expected tables ([[lora]] headers)"));
}
