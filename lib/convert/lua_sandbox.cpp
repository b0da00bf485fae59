#include "convert/lua_sandbox.hpp"

#include <lua.hpp>
#include <luajit.h>


#include "util/error.hpp"
#include "util/format.hpp"
#include "util/utf8.hpp"

namespace vramd::convert {

struct LuaSandbox::State {
  SandboxLimits limits;
  lua_Alloc inner = nullptr;  // LuaJIT's own allocator, which does the work
  void* inner_state = nullptr;
  size_t used = 0;
  bool out_of_memory = false;
  std::string timed_out;  // the time limit's error, once it has fired
  std::chrono::steady_clock::time_point deadline;
  std::vector<std::string> printed;
  std::string chunk;  // the name of the last chunk run, for errors that have no position
  lua_State* lua = nullptr;
};

namespace {

constexpr int kHookEvery = 1000;  // instructions between looks at the clock

// Lua cuts chunk names in messages to 60 characters; chunks run under this short name, which
// call() replaces with the real one.
constexpr std::string_view kChunkId = "@chunk@";

// Counts what LuaJIT's own allocator (faster than malloc for Lua's many small objects) hands out.
void* allocate(void* userdata, void* block, size_t old_size, size_t new_size) {
  auto* state = static_cast<LuaSandbox::State*>(userdata);
  if (block == nullptr) old_size = 0;  // for a new block, old_size says what kind of object it is
  if (new_size > old_size && state->used - old_size + new_size > state->limits.memory) {
    state->out_of_memory = true;
    return nullptr;
  }
  void* result = state->inner(state->inner_state, block, old_size, new_size);
  if (result || new_size == 0) state->used = state->used - old_size + new_size;
  return result;
}

LuaSandbox::State* state_of(lua_State* L) {
  void* userdata = nullptr;
  lua_getallocf(L, &userdata);
  return static_cast<LuaSandbox::State*>(userdata);
}

void watch_clock(lua_State* L, lua_Debug* where) {
  auto* state = state_of(L);
  if (std::chrono::steady_clock::now() <= state->deadline) return;
  lua_getinfo(L, "Sl", where);
  lua_pushfstring(L, "%s:%d: ran past its time limit of %d ms", where->short_src, where->currentline,
                  static_cast<int>(state->limits.timeout.count()));
  if (state->timed_out.empty()) state->timed_out = lua_tostring(L, -1);
  lua_error(L);
}

// Once the time or the memory limit has fired, the script is over: raises that error again,
// whatever a pcall in between made of it (as Redis keeps its kill error from being caught).
void stop_if_over(lua_State* L) {
  const auto* state = state_of(L);
  if (!state->timed_out.empty()) {
    lua_pushstring(L, state->timed_out.c_str());
    lua_error(L);
  }
  if (state->out_of_memory) {
    lua_pushliteral(L, "not enough memory");
    lua_error(L);
  }
}

// pcall(f, ...) and xpcall(f, handler, ...) as Lua's, except that they cannot catch the stop.
int sandbox_pcall(lua_State* L) {
  // [f, arguments...]
  luaL_checkany(L, 1);
  const int status = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);  // [results...] or [error]
  stop_if_over(L);
  lua_pushboolean(L, status == 0);
  lua_insert(L, 1);  // [ok, results...]
  return lua_gettop(L);
}

int sandbox_xpcall(lua_State* L) {
  // [f, handler, arguments...]
  luaL_checktype(L, 2, LUA_TFUNCTION);
  lua_pushvalue(L, 2);
  lua_remove(L, 2);
  lua_insert(L, 1);  // [handler, f, arguments...]
  const int status = lua_pcall(L, lua_gettop(L) - 2, LUA_MULTRET, 1);  // [handler, results...]
  stop_if_over(L);
  lua_pushboolean(L, status == 0);
  lua_replace(L, 1);  // [ok, results...]
  return lua_gettop(L);
}

int traceback(lua_State* L) {
  // [message]
  const char* message = lua_tostring(L, 1);
  luaL_traceback(L, L, message ? message : "(error object is not a string)", 1);
  return 1;
}

// Each argument is escaped as escape_invalid_utf8 does, so a line holds no control byte but the
// tabs print puts between arguments: it goes to a terminal or the daemon's log.
int print_to_log(lua_State* L) {
  std::string line;
  const int count = lua_gettop(L);
  lua_getfield(L, LUA_REGISTRYINDEX, "vramd.tostring");  // [arguments..., tostring]
  for (int i = 1; i <= count; ++i) {
    lua_pushvalue(L, -1);
    lua_pushvalue(L, i);
    lua_call(L, 1, 1);  // [arguments..., tostring, text]
    size_t length = 0;
    const char* text = lua_tolstring(L, -1, &length);
    if (i > 1) line += '\t';
    if (text) line += escape_invalid_utf8({text, length});
    lua_pop(L, 1);
  }
  state_of(L)->printed.push_back(std::move(line));
  return 0;
}

const char* key_text(lua_State* L, int index) {
  const char* text = lua_type(L, index) == LUA_TSTRING ? lua_tostring(L, index) : nullptr;
  return text ? text : "?";
}

int unknown_global(lua_State* L) {
  // [globals, key]
  return luaL_error(L, "unknown global '%s'", key_text(L, 2));
}

int assigned_global(lua_State* L) {
  // [globals, key, value]
  return luaL_error(L, "assignment to the global '%s'; declare it local", key_text(L, 2));
}

void open_library(lua_State* L, lua_CFunction open, const char* name) {
  lua_pushcfunction(L, open);
  lua_pushstring(L, name);
  lua_call(L, 1, 0);
}

void remove_field(lua_State* L, const char* table, const char* field) {
  lua_getglobal(L, table);  // [table]
  lua_pushnil(L);
  lua_setfield(L, -2, field);
  lua_pop(L, 1);
}

// The last line of a traceback-decorated message is not needed in a one-line error. What the
// script put in it (error("..."), a global's name, a token) is made printable: it reaches the
// daemon's replies and log.
std::string first_line(const char* text) {
  std::string message = text ? text : "(no message)";
  return printable(message.substr(0, message.find('\n')));
}

std::string real_name(std::string message, const std::string& name) {
  for (size_t at = message.find(kChunkId); at != std::string::npos; at = message.find(kChunkId, at + name.size()))
    message.replace(at, kChunkId.size(), name);
  return message;
}

}  // namespace

LuaSandbox::LuaSandbox(SandboxLimits limits) : state_(std::make_unique<State>()) {
  state_->limits = limits;
  lua_State* L = luaL_newstate();
  if (!L) throw Error("cannot create a Lua state");
  state_->lua = L;
  state_->inner = lua_getallocf(L, &state_->inner_state);
  state_->used = static_cast<size_t>(lua_gc(L, LUA_GCCOUNT, 0)) * 1024 + static_cast<size_t>(lua_gc(L, LUA_GCCOUNTB, 0));
  lua_setallocf(L, allocate, state_.get());
  luaJIT_setmode(L, 0, LUAJIT_MODE_ENGINE | LUAJIT_MODE_OFF);

  open_library(L, luaopen_base, "");
  open_library(L, luaopen_string, LUA_STRLIBNAME);
  open_library(L, luaopen_table, LUA_TABLIBNAME);
  open_library(L, luaopen_math, LUA_MATHLIBNAME);
  open_library(L, luaopen_bit, LUA_BITLIBNAME);
  for (const char* name : {"dofile", "loadfile", "load", "loadstring", "getfenv", "setfenv", "newproxy",
                           "collectgarbage", "module", "require", "gcinfo", "coroutine"}) {
    lua_pushnil(L);
    lua_setglobal(L, name);
  }
  remove_field(L, "string", "dump");
  lua_getglobal(L, "tostring");
  lua_setfield(L, LUA_REGISTRYINDEX, "vramd.tostring");
  lua_pushcfunction(L, print_to_log);
  lua_setglobal(L, "print");
  lua_pushcfunction(L, sandbox_pcall);
  lua_setglobal(L, "pcall");
  lua_pushcfunction(L, sandbox_xpcall);
  lua_setglobal(L, "xpcall");

  // Strings share one metatable whose __index is the string library: hide it.
  lua_pushliteral(L, "");
  lua_getmetatable(L, -1);  // ["", metatable]
  lua_pushboolean(L, 0);
  lua_setfield(L, -2, "__metatable");
  lua_pop(L, 2);

  // Globals: unknown names are errors, the table cannot be unlocked.
  lua_pushvalue(L, LUA_GLOBALSINDEX);  // [globals]
  lua_newtable(L);                     // [globals, metatable]
  lua_pushcfunction(L, unknown_global);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, assigned_global);
  lua_setfield(L, -2, "__newindex");
  lua_pushboolean(L, 0);
  lua_setfield(L, -2, "__metatable");
  lua_setmetatable(L, -2);
  lua_pop(L, 1);
}

LuaSandbox::~LuaSandbox() { lua_close(state_->lua); }

lua_State* LuaSandbox::state() const { return state_->lua; }

const std::vector<std::string>& LuaSandbox::printed() const { return state_->printed; }

void LuaSandbox::run(const std::string& code, const std::string& name, int arguments, int results) {
  lua_State* L = state_->lua;
  state_->chunk = name;
  if (!code.empty() && code[0] == LUA_SIGNATURE[0]) throw Error(name + ": precompiled Lua bytecode is refused");
  if (luaL_loadbuffer(L, code.data(), code.size(), ("=" + std::string(kChunkId)).c_str()) != 0) {
    std::string message = real_name(first_line(lua_tostring(L, -1)), name);
    lua_pop(L, 1 + arguments);
    throw Error(message);
  }
  lua_insert(L, -1 - arguments);  // [chunk, arguments...]
  call(arguments, results);
}

void LuaSandbox::call(int arguments, int results) {
  lua_State* L = state_->lua;
  const int base = lua_gettop(L) - arguments;  // the function's slot
  lua_pushcfunction(L, traceback);
  lua_insert(L, base);  // [traceback, function, arguments...]
  state_->deadline = std::chrono::steady_clock::now() + state_->limits.timeout;
  state_->out_of_memory = false;
  state_->timed_out.clear();
  lua_sethook(L, watch_clock, LUA_MASKCOUNT, kHookEvery);
  const int status = lua_pcall(L, arguments, results, base);
  lua_sethook(L, nullptr, 0, 0);
  lua_remove(L, base);  // the traceback handler
  if (status == 0) return;
  std::string message = real_name(first_line(lua_tostring(L, -1)), state_->chunk);
  lua_pop(L, 1);
  if (state_->out_of_memory || status == LUA_ERRMEM)
    throw Error(state_->chunk + ": " + message + " (exceeded the memory limit of " +
                format_bytes(state_->limits.memory) + ")");
  throw Error(message);
}

}  // namespace vramd::convert
