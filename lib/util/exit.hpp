// How vramd's executables end: once a run is over, without static destructors.
//
// A process that links LibTorch spends its exit in LibTorch's static destructors, which take
// every operator out of the dispatcher again: on the development VM 0.1 s of each exit with its
// CPU half, and 0.13-0.2 s and 110 MiB more touched with its CUDA half open, for memory the
// kernel frees anyway. On the first GPU machine lent (an H200), those destructors aborted every
// process of ours at exit (`free(): invalid pointer`, a std::locale freed in TorchLibraryInit's
// destructor); scripts/gpu-check's exit probe, which ends normally on purpose, tells where that
// lies. LibTorch-free.
#pragma once

namespace vramd {

// Flushes the C++ streams and C stdio, runs LeakSanitizer's check in sanitizer builds (as the
// normal exit would), then ends the process with `status`, running no static destructors and no
// atexit handlers. Call it from main with what the run returned, every object of the run already
// destroyed: nothing that needs a destructor to keep data (a file, a socket's path) may live in
// static storage.
[[noreturn]] void exit_without_destructors(int status);

}  // namespace vramd
