// A crash's C++ stack on the GPU machine, which has no gdb: preloaded, it prints the native backtrace of a
// SIGSEGV to stderr (then dies as before). Build and use there (tools/device/README.md, "A segfault"):
//   gcc -shared -fPIC -o /tmp/segv.so tools/device/segv_backtrace.c
//   LD_PRELOAD=/tmp/segv.so python3 script.py 2>&1 | c++filt
// Frames print as lib(+0xoffset); `addr2line -f -C -i -e lib 0xoffset` names the source line (build with -g1).
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

static void on_fault(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) { signal(SIGSEGV, on_fault); }
