// The uid/gid allow-list, checked with a process running as another user (created by the test
// when it runs as root; skipped with a message otherwise): refused peers get PERMISSION_DENIED on
// gRPC and "ERR" on the side socket; allowing the user's group (a supplementary group) lets the
// same user run a full worker.
#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;

constexpr char kUser[] = "kvd-test-peer";
constexpr char kGroup[] = "kvd-test-group";

bool EnsureUser() {
  ProcessResult r = RunProcess("/bin/sh", {"-c", absl::StrCat(
      "getent group ", kGroup, " >/dev/null || groupadd --system ", kGroup, " && "
      "(id -u ", kUser, " >/dev/null 2>&1 || useradd --system --no-create-home --shell /bin/sh ", kUser, ") && "
      "usermod -a -G ", kGroup, " ", kUser)});
  return r.exit_code == 0 && getpwnam(kUser) != nullptr;
}

// Opens the daemon's directory and sockets to everyone, so that only the allow-list decides.
void OpenUp(const DaemonProcess& d) {
  chmod(d.dir().c_str(), 0755);
  chmod((d.dir() + "/kvd.sock").c_str(), 0666);
  chmod(d.side_socket().c_str(), 0666);
}

ProcessResult RunAs(const std::string& binary, std::vector<std::string> args) {
  std::vector<std::string> full = {"-u", kUser, "--", binary};
  full.insert(full.end(), args.begin(), args.end());
  return RunProcess("/usr/sbin/runuser", full);
}

TEST_CASE("The allow-list refuses other users on gRPC and the side socket, and admits a group",
          "[integration][access]") {
  if (geteuid() != 0) {
    WARN("skipped: creating a second user needs root");
    return;
  }
  if (!EnsureUser()) {
    WARN("skipped: could not create user " << kUser);
    return;
  }
  const gid_t group = getgrnam(kGroup)->gr_gid;
  {
    DaemonProcess d(SmallPoolConfig(), {"--allowed-uids=4242"});
    OpenUp(d);
    ProcessResult ctl = RunAs(KVDCTL_BINARY, {"--target=" + d.target(), "status"});
    INFO(ctl.out);
    REQUIRE(ctl.exit_code != 0);
    REQUIRE(ctl.out.find("kvdctl: PERMISSION_DENIED: ") != std::string::npos);
    REQUIRE(ctl.out.find("is not in kvd's allowed_uids / allowed_gids") != std::string::npos);
    ProcessResult worker = RunAs(ExampleWorkerBinary(), {"--target=" + d.target(), "--id=x", "--prompt-range=0:9"});
    REQUIRE(worker.exit_code != 0);
    REQUIRE(worker.out.find("PERMISSION_DENIED") != std::string::npos);
    // The side socket refuses the same peer before reading anything it sends.
    ProcessResult side = RunAs("/usr/bin/python3", {"-c",
        "import socket,struct,sys\n"
        "s=socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(sys.argv[1])\n"
        "def read(n):\n"
        "  b=b''\n"
        "  while len(b)<n:\n"
        "    c=s.recv(n-len(b))\n"
        "    if not c: break\n"
        "    b+=c\n"
        "  return b\n"
        "print(read(struct.unpack('<I',read(4))[0]))", d.side_socket()});  // one framed message,
                                                                         // sent before it reads
    INFO(side.out);
    REQUIRE(side.out.find("ERR") != std::string::npos);
    REQUIRE(side.out.find("not in kvd") != std::string::npos);
    // gRPC's own services: reflection is cancelled for the refused peer, health answers it
    // (probes). Raw bytes: a ServerReflectionRequest{list_services: ""} and an empty request.
    ProcessResult grpc_services = RunAs("/usr/bin/python3", {"-c",
        "import grpc,sys\n"
        "ch=grpc.insecure_channel(sys.argv[1])\n"
        "try:\n"
        "  r=list(ch.stream_stream('/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo')(iter([b'\\x3a\\x00']),timeout=10))\n"
        "  print('REFLECTION answered', len(r))\n"
        "except grpc.RpcError as e:\n"
        "  print('REFLECTION', e.code().name)\n"
        "ch.unary_unary('/grpc.health.v1.Health/Check')(b'',timeout=10)\n"
        "print('HEALTH OK')\n", d.target()});
    INFO(grpc_services.out);
    REQUIRE(grpc_services.out.find("REFLECTION CANCELLED") != std::string::npos);
    REQUIRE(grpc_services.out.find("HEALTH OK") != std::string::npos);
    // Root still gets through.
    REQUIRE(RunProcess(KVDCTL_BINARY, {"--target=" + d.target(), "status"}).exit_code == 0);
  }
  // The sockets' group is configurable: with socket_group the group alone reaches kvd (0660).
  DaemonProcess d(SmallPoolConfig(), {absl::StrCat("--allowed-gids=", group), absl::StrCat("--socket-group=", kGroup)});
  struct stat st;
  REQUIRE(stat((d.dir() + "/kvd.sock").c_str(), &st) == 0);
  REQUIRE(st.st_gid == group);
  REQUIRE((st.st_mode & 0777) == 0660);
  REQUIRE(stat(d.side_socket().c_str(), &st) == 0);
  REQUIRE(st.st_gid == group);
  chmod(d.dir().c_str(), 0755);
  ProcessResult worker = RunAs(ExampleWorkerBinary(), {"--target=" + d.target(), "--id=y", "--prompt-range=0:9"});
  INFO(worker.out);
  REQUIRE(worker.exit_code == 0);
  REQUIRE(JsonInt(worker.out, "mismatches") == 0);
  // An allowed user is a worker, not an operator: what sees across tenants or changes the node is
  // refused (every request's handle, the event stream with its tokens, gc, drain); the worker's
  // own RPCs and the aggregate report are not.
  for (const auto& op : {std::vector<std::string>{"requests"}, {"events"}, {"gc", "--all"}, {"drain"}}) {
    std::vector<std::string> args = {"--target=" + d.target()};
    args.insert(args.end(), op.begin(), op.end());
    ProcessResult ctl = RunAs(KVDCTL_BINARY, args);
    INFO(op[0] << ": " << ctl.out);
    REQUIRE(ctl.exit_code != 0);
    REQUIRE(ctl.out.find("is for operators") != std::string::npos);
  }
  REQUIRE(RunAs(KVDCTL_BINARY, {"--target=" + d.target(), "status"}).exit_code == 0);
  REQUIRE(RunProcess(KVDCTL_BINARY, {"--target=" + d.target(), "requests"}).exit_code == 0);  // root
}

// The unit and the manifests tell operators to put worker users in kvd's group: without any
// allow-list, a member of the sockets' group maps slabs (the 0660 mode already lets it connect);
// a user outside it still cannot.
TEST_CASE("Without an allow-list, members of the sockets' group may map slabs", "[integration][access]") {
  if (geteuid() != 0 || !EnsureUser()) {
    WARN("skipped: creating a second user needs root");
    return;
  }
  DaemonProcess d(SmallPoolConfig(), {absl::StrCat("--socket-group=", kGroup)});
  chmod(d.dir().c_str(), 0755);
  ProcessResult member = RunAs(ExampleWorkerBinary(), {"--target=" + d.target(), "--id=m", "--prompt-range=0:9"});
  INFO(member.out);
  REQUIRE(member.exit_code == 0);
  REQUIRE(JsonInt(member.out, "mismatches") == 0);
  // Another group owns the sockets: the same user, now outside it, is refused the slabs.
  DaemonProcess other(SmallPoolConfig(), {"--socket-group=root"});
  OpenUp(other);
  ProcessResult outsider = RunAs(ExampleWorkerBinary(), {"--target=" + other.target(), "--id=o", "--prompt-range=0:9"});
  INFO(outsider.out);
  REQUIRE(outsider.exit_code != 0);
  REQUIRE(outsider.out.find("may not map slabs") != std::string::npos);
}

}  // namespace
}  // namespace kvd
