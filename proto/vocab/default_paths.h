// Where kvd listens when nothing says otherwise, shared by the daemon and the tools that talk to
// it (kvdctl, kvd-bench), so that all of them agree: /run/kvd as root, else
// $XDG_RUNTIME_DIR/kvd, else /tmp/kvd-<uid>. Header-only: the tools need no daemon library.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace kvd {

inline std::string DefaultSocketDir() {
  if (geteuid() == 0) return "/run/kvd";
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && *xdg != '\0') {
    return std::string(xdg) + "/kvd";
  }
  return "/tmp/kvd-" + std::to_string(geteuid());
}

// The gRPC address a tool connects to: $KVD_TARGET, else the daemon's default socket.
inline std::string DefaultTarget() {
  if (const char* t = std::getenv("KVD_TARGET"); t != nullptr && *t != '\0') return t;
  return "unix://" + DefaultSocketDir() + "/kvd.sock";
}

}  // namespace kvd
