#include "util/exit.hpp"

#include <cstdio>
#include <cstdlib>
#include <iostream>

#if defined(__SANITIZE_ADDRESS__)
#define VRAMD_LEAK_CHECK 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define VRAMD_LEAK_CHECK 1
#endif
#endif
#ifdef VRAMD_LEAK_CHECK
#include <sanitizer/lsan_interface.h>
#endif

namespace vramd {

void exit_without_destructors(int status) {
  std::cout.flush();
  std::cerr.flush();
  std::clog.flush();
  std::fflush(nullptr);
#ifdef VRAMD_LEAK_CHECK
  __lsan_do_leak_check();  // the check LeakSanitizer runs at a normal exit; it ends the process on a leak
#endif
  std::_Exit(status);
}

}  // namespace vramd
