#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "util/torch_cuda.hpp"

int main(int argc, char** argv) {
  vramd::torch_cuda::load();  // as vramd and vramctl run do, before any LibTorch call
  return Catch::Session().run(argc, argv);
}
