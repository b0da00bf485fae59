#include <catch2/catch.hpp>

#include <lua.hpp>

#include "convert/lua_sandbox.hpp"
#include "util/error.hpp"

using namespace vramd::convert;
using namespace std::chrono_literals;

namespace {

std::string error_of(const std::string& code, SandboxLimits limits = {}) {
  LuaSandbox sandbox(limits);
  try {
    sandbox.run(code, "escape.lua", 0, 0);
  } catch (const vramd::Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("a sandboxed script computes with the safe libraries and prints to a log") {
  LuaSandbox sandbox;
  sandbox.run("local s = string.format('%d-%s', math.floor(7.9), ('ab'):upper())\n"
              "print(s, bit.band(6, 3), table.concat({1, 2}, ','))\nreturn #s",
              "ok.lua", 0, 1);
  CHECK(lua_tonumber(sandbox.state(), -1) == 4);
  REQUIRE(sandbox.printed().size() == 1);
  CHECK(sandbox.printed()[0] == "7-AB\t2\t1,2");
  // What a script prints goes to a terminal or the daemon's log: control bytes are escaped, but
  // not the tabs between arguments.
  sandbox.run("print('a\\tb\\n\\27[2J\\255', 'c\\\\d')", "escaped.lua", 0, 0);
  REQUIRE(sandbox.printed().size() == 2);
  CHECK(sandbox.printed()[1] == "a\\x09b\\x0a\\x1b[2J\\xff\tc\\\\d");
}

TEST_CASE("every way out of the sandbox is refused with its own error") {
  CHECK(error_of("io.open('/etc/passwd')") == "escape.lua:1: unknown global 'io'");
  CHECK(error_of("os.execute('true')") == "escape.lua:1: unknown global 'os'");
  CHECK(error_of("require('ffi')") == "escape.lua:1: unknown global 'require'");
  CHECK(error_of("local x = package") == "escape.lua:1: unknown global 'package'");
  CHECK(error_of("jit.on()") == "escape.lua:1: unknown global 'jit'");
  CHECK(error_of("error('\\27[2J\\255')") == "escape.lua:1: \\x1b[2J\\xff");  // what the script says, printable
  CHECK(error_of("local x = _G['\\27]0;t\\7']") == "escape.lua:1: unknown global '\\x1b]0;t\\x07'");
  CHECK(error_of("debug.getregistry()") == "escape.lua:1: unknown global 'debug'");
  CHECK(error_of("dofile('/etc/passwd')") == "escape.lua:1: unknown global 'dofile'");
  CHECK(error_of("loadfile('/etc/passwd')") == "escape.lua:1: unknown global 'loadfile'");
  CHECK(error_of("load('return 1')") == "escape.lua:1: unknown global 'load'");
  CHECK(error_of("loadstring('return 1')") == "escape.lua:1: unknown global 'loadstring'");
  CHECK(error_of("getfenv(1)") == "escape.lua:1: unknown global 'getfenv'");
  CHECK(error_of("setfenv(1, {})") == "escape.lua:1: unknown global 'setfenv'");
  CHECK(error_of("newproxy(true)") == "escape.lua:1: unknown global 'newproxy'");
  CHECK(error_of("collectgarbage('stop')") == "escape.lua:1: unknown global 'collectgarbage'");
  CHECK(error_of("coroutine.create(print)") == "escape.lua:1: unknown global 'coroutine'");
  CHECK(error_of("string.dump(print)") == "escape.lua:1: attempt to call field 'dump' (a nil value)");
  CHECK(error_of("local mt = getmetatable('') ; mt.__index.x = 1") ==
        "escape.lua:1: attempt to index local 'mt' (a boolean value)");
  CHECK(error_of("setmetatable(_G, nil)") == "escape.lua:1: cannot change a protected metatable");
  CHECK(error_of("leaked = 1") == "escape.lua:1: assignment to the global 'leaked'; declare it local");
  CHECK(error_of("\x1bLJ\x02") == "escape.lua: precompiled Lua bytecode is refused");
}

TEST_CASE("a runaway loop is stopped at the time limit even in a loop the JIT would compile") {
  auto start = std::chrono::steady_clock::now();
  CHECK(error_of("local i = 0 while true do i = i + 1 end", {200ms, 64u << 20}) ==
        "escape.lua:1: ran past its time limit of 200 ms");
  CHECK(error_of("for i = 1, 1e15 do local x = i * 2 end", {200ms, 64u << 20}) ==
        "escape.lua:1: ran past its time limit of 200 ms");
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}

TEST_CASE("the limits end a script whatever it wraps its work in") {
  const SandboxLimits limits{200ms, 16u << 20};
  auto start = std::chrono::steady_clock::now();
  CHECK(error_of("while true do pcall(function() while true do end end) end", limits) ==
        "escape.lua:1: ran past its time limit of 200 ms");
  CHECK(error_of("while true do xpcall(function() while true do end end, function(e) return e end) end", limits) ==
        "escape.lua:1: ran past its time limit of 200 ms");
  CHECK(error_of("local function f() pcall(f) while true do end end f()", limits) ==
        "escape.lua:1: ran past its time limit of 200 ms");
  CHECK(error_of("while true do pcall(error, {}) end", limits) == "escape.lua:1: ran past its time limit of 200 ms");
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  const SandboxLimits memory{10s, 16u << 20};
  CHECK(error_of("while true do pcall(string.rep, 'x', 1e9) end", memory) ==
        "escape.lua: not enough memory (exceeded the memory limit of 16.00 MiB)");
  CHECK(error_of("local t = {} while true do pcall(function() t[#t + 1] = table.concat({'x', #t}, string.rep('z', 1e6)) end) end",
                 memory) == "escape.lua: not enough memory (exceeded the memory limit of 16.00 MiB)");
}

TEST_CASE("pcall and xpcall still catch a script's own errors") {
  LuaSandbox sandbox;
  sandbox.run("local ok, e = pcall(error, {code = 7})\n"
              "local ok2, r = xpcall(function(a) return a * 2 end, print, 21)\n"
              "local ok3, h = xpcall(function() error('x') end, function(m) return 'handled ' .. m end)\n"
              "return (not ok and e.code == 7 and ok2 and r == 42 and not ok3 and h:find('handled') ~= nil)",
              "ok.lua", 0, 1);
  CHECK(lua_toboolean(sandbox.state(), -1));
}

TEST_CASE("the memory cap and stack overflow are errors and the process carries on") {
  CHECK(error_of("local t = {} for i = 1, 1e8 do t[i] = string.rep('x', 1000) .. i end", {10s, 16u << 20}) ==
        "escape.lua: not enough memory (exceeded the memory limit of 16.00 MiB)");
  CHECK_THAT(error_of("local function f() return 1 + f() end return f()"), Catch::Contains("stack overflow"));
  LuaSandbox after;  // a fresh state still works
  after.run("return 1 + 1", "after.lua", 0, 1);
  CHECK(lua_tonumber(after.state(), -1) == 2);
}

TEST_CASE("syntax errors name the script and line") {
  CHECK(error_of("local x = = 1") == "escape.lua:1: unexpected symbol near '='");
  CHECK(error_of("error('custom failure')") == "escape.lua:1: custom failure");
}
