#include "server/obs/process_stats.h"

#include <dirent.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvd {
namespace {

// /proc/stat's btime (seconds since the epoch; 0 when unreadable), read once: it never changes.
int64_t BootTimeSeconds() {
  static const int64_t boot = [] {
    std::ifstream proc_stat("/proc/stat");
    std::string key;
    int64_t value = 0;
    while (proc_stat >> key) {
      if (key == "btime" && proc_stat >> value) return value;
      proc_stat.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
    }
    return int64_t{0};
  }();
  return boot;
}

}  // namespace

ProcessStats ReadProcessStats() {
  ProcessStats s;
  const int64_t page = sysconf(_SC_PAGESIZE);
  if (std::ifstream statm("/proc/self/statm"); statm) {
    int64_t size = 0, resident = 0;
    statm >> size >> resident;
    s.virtual_bytes = size * page;
    s.resident_bytes = resident * page;
  }
  if (std::ifstream stat("/proc/self/stat"); stat) {
    std::string line;
    std::getline(stat, line);
    // Fields after the command name (which may hold spaces) start after the last ')'.
    std::istringstream rest(line.substr(line.rfind(')') + 2));
    std::string field;
    unsigned long long utime = 0, stime = 0, start_ticks = 0;
    for (int i = 3; i <= 22 && rest >> field; ++i) {
      if (i == 14) utime = std::stoull(field);
      if (i == 15) stime = std::stoull(field);
      if (i == 22) start_ticks = std::stoull(field);  // since boot (proc(5))
    }
    const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
    s.cpu_seconds = static_cast<double>(utime + stime) / tick;
    if (start_ticks > 0 && BootTimeSeconds() > 0) {
      s.start_time_seconds = static_cast<double>(BootTimeSeconds()) + static_cast<double>(start_ticks) / tick;
    }
  }
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') ++s.open_fds;
    }
    closedir(d);
    --s.open_fds;  // the directory's own descriptor
  }
  if (rlimit r{}; getrlimit(RLIMIT_NOFILE, &r) == 0) s.max_fds = static_cast<int64_t>(r.rlim_cur);
  return s;
}

bool ProcessGone(pid_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return true;
  char buf[512] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  const char* paren = std::strrchr(buf, ')');  // the state follows the command name's ')'
  if (n == 0 || paren == nullptr) return false;
  if (paren[2] == 'Z' || paren[2] == 'X') return true;
  // A process killed by a signal closes its descriptors in do_exit() before it becomes a zombie, so
  // a broken stream can be seen while the state still reads R or D. The kernel sets PF_EXITING
  // (0x4, include/linux/sched.h) in the flags, field 9 of proc(5)'s stat, as do_exit() begins:
  // from then on the process runs no code of its own and writes nothing.
  char state = 0;
  unsigned flags = 0;
  if (std::sscanf(paren + 2, "%c %*d %*d %*d %*d %*d %u", &state, &flags) != 2) return false;
  constexpr unsigned kPfExiting = 0x4;
  return (flags & kPfExiting) != 0;
}

}  // namespace kvd
