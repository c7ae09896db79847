#include "client/tools/self_spawn.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace kvd::tools {

absl::StatusOr<SpawnedChild> SpawnSelf(const std::string& argv0, const std::vector<std::string>& args) {
  int fds[2];
  if (pipe(fds) != 0) return absl::InternalError("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  std::vector<std::string> all = {argv0};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    return absl::InternalError(absl::StrCat("posix_spawn failed: ", rc));
  }
  return SpawnedChild{pid, fds[0]};
}

ChildResult Collect(SpawnedChild& child) {
  ChildResult r;
  char buf[65536];
  ssize_t n;
  while ((n = read(child.stdout_fd, buf, sizeof(buf))) > 0) r.out.append(buf, n);
  close(child.stdout_fd);
  child.stdout_fd = -1;
  int status = 0;
  waitpid(child.pid, &status, 0);
  r.ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return r;
}

}  // namespace kvd::tools
