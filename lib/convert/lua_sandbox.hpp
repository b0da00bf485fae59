// The one way into Lua: a LuaJIT state with only the safe libraries, a memory cap, a
// wall-clock limit that fires in any loop, and every call made under pcall.
//
// Opened: base (without dofile, loadfile, load, loadstring, getfenv, setfenv, newproxy,
// collectgarbage, and without coroutine: a coroutine would run without the clock's hook),
// string (without dump), table, math, bit. Absent: io, os, package/require, ffi, jit, debug. Reading or assigning an unknown global is an error. The JIT is
// off in these states so that the instruction-count hook always runs.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

struct lua_State;

namespace vramd::convert {

struct SandboxLimits {
  std::chrono::milliseconds timeout{5000};
  size_t memory = 256u << 20;  // bytes the Lua heap may hold
};

class LuaSandbox {
 public:
  explicit LuaSandbox(SandboxLimits limits = {});
  ~LuaSandbox();
  LuaSandbox(const LuaSandbox&) = delete;
  LuaSandbox& operator=(const LuaSandbox&) = delete;

  lua_State* state() const;

  // Loads `code` as the chunk `name` (source text only, never bytecode) and calls it with the
  // `arguments` already pushed, leaving `results` values on the stack. The clock starts here.
  // Throws Error with Lua's message ("name:line: ...") and, for limits, what was exceeded.
  void run(const std::string& code, const std::string& name, int arguments, int results);

  // Calls the function below `arguments` values on the stack under the same limits.
  void call(int arguments, int results);

  // Text the script passed to print(), one entry per call.
  const std::vector<std::string>& printed() const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace vramd::convert
