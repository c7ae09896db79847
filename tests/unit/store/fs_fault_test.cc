// Every step of a flush, a manifest rewrite and a warm restart against injected file-system
// failures (FileSystem seam): for each system call the disk tier makes, fail its 1st, 2nd, ...
// call in turn, and check that the answer says so, that nothing reported durable is lost, that
// no wrong byte is ever served, and that the store recovers once the disk does.
#include <fcntl.h>

#include <atomic>
#include <cerrno>
#include <filesystem>

#include <catch2/catch.hpp>

#include "server/store/file_system.h"
#include "server/store/segment_file.h"
#include "tests/unit/store/store_fixture.h"

namespace kvd {
namespace {

using testing::Node;
using testing::ScopedDir;
using testing::Seq;
using testing::Tiers;

enum class Op { kOpenWrite, kWrite, kFsync, kRename, kOpenRead, kPread };
const char* OpName(Op op) {
  switch (op) {
    case Op::kOpenWrite: return "open for writing";
    case Op::kWrite: return "write";
    case Op::kFsync: return "fsync";
    case Op::kRename: return "rename";
    case Op::kOpenRead: return "open for reading";
    case Op::kPread: return "pread";
  }
  return "?";
}

// Fails the n-th call (0-based) of one kind with `err`, once; counts the calls it saw.
class FaultyFileSystem final : public FileSystem {
 public:
  void FailNth(Op op, int n, int err) {
    op_ = op;
    remaining_ = n;
    err_ = err;
    armed_ = true;
    fired_ = false;
  }
  void Disarm() { armed_ = false; }
  bool fired() const { return fired_; }

  int Open(const char* path, int flags, mode_t mode) override {
    const bool writing = (flags & (O_WRONLY | O_RDWR)) != 0 || (flags & O_DIRECTORY) != 0;
    if (Fail(writing ? Op::kOpenWrite : Op::kOpenRead)) return -1;
    return FileSystem::Open(path, flags, mode);
  }
  ssize_t Write(int fd, const void* data, size_t size) override {
    return Fail(Op::kWrite) ? -1 : FileSystem::Write(fd, data, size);
  }
  ssize_t Pread(int fd, void* out, size_t size, off_t offset) override {
    return Fail(Op::kPread) ? -1 : FileSystem::Pread(fd, out, size, offset);
  }
  int Fsync(int fd) override { return Fail(Op::kFsync) ? -1 : FileSystem::Fsync(fd); }
  int Rename(const char* from, const char* to) override {
    return Fail(Op::kRename) ? -1 : FileSystem::Rename(from, to);
  }

 private:
  bool Fail(Op op) {
    if (!armed_.load() || op != op_ || fired_.load()) return false;
    if (remaining_-- > 0) return false;
    fired_ = true;
    errno = err_;
    return true;
  }

  std::atomic<bool> armed_{false};
  std::atomic<bool> fired_{false};
  Op op_ = Op::kWrite;
  std::atomic<int> remaining_{0};
  int err_ = EIO;
};

const std::vector<std::vector<Token>> kPrompts = {Seq(100, 13), Seq(200, 13), Seq(300, 13)};

void PublishAll(Node& node) {
  for (size_t i = 0; i < kPrompts.size(); ++i) node.Publish("p" + std::to_string(i), kPrompts[i]);
}

// Serves every prompt (Serve checks each served byte); returns the prompts served in full.
int ServedInFull(Node& node, const std::string& tag) {
  int full = 0;
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    if (node.Serve(tag + std::to_string(i), kPrompts[i]) == 12) ++full;
  }
  return full;
}

TEST_CASE("Flush and manifest rewrite: any failed call is reported; nothing durable is lost",
          "[store][faults]") {
  for (Op op : {Op::kOpenWrite, Op::kWrite, Op::kFsync, Op::kRename}) {
    for (int err : {EIO, ENOSPC}) {
      for (int n = 0;; ++n) {
        INFO(OpName(op) << " call " << n << " fails with " << std::strerror(err));
        const ScopedDir dir;
        FaultyFileSystem fs;
        TierOptions t = Tiers(dir, Codec::kNone, /*host_blocks=*/16);
        t.file_system = &fs;
        t.segment_bytes = 3 * testing::kBlockBytes;  // several segments and manifest writes
        bool durable_before_restart = false;
        {
          Node node(t, /*capacity_blocks=*/16);
          PublishAll(node);
          fs.FailNth(op, n, err);
          auto r = node.store->Flush();
          REQUIRE(r.ok());
          fs.Disarm();
          if (!fs.fired()) {
            REQUIRE(r->durable);  // every call of this kind done: the loop is over
            break;
          }
          REQUIRE_FALSE(r->durable);
          REQUIRE(r->failed_blocks > 0);
          REQUIRE_FALSE(r->error.empty());
          if (err == ENOSPC && op == Op::kWrite) REQUIRE(r->error.find("No space") != std::string::npos);
          // The device tier keeps serving, and the next flush (the disk is back) is durable.
          REQUIRE(ServedInFull(node, "during") == 3);
          auto again = node.store->Flush();
          REQUIRE(again.ok());
          REQUIRE(again->durable);
          durable_before_restart = again->durable;
        }
        // A restart from the disk alone: what the last flush made durable is all there, and every
        // byte served is the one written (Serve checks).
        Node node(Tiers(dir));
        if (durable_before_restart) REQUIRE(ServedInFull(node, "after") == 3);
        // No temporary file survives a failed write.
        for (const auto& e : std::filesystem::directory_iterator(dir.path)) {
          REQUIRE(e.path().extension() != ".tmp");
        }
      }
    }
  }
}

TEST_CASE("Warm restart: a failed read loses nothing; the next restart serves everything",
          "[store][faults]") {
  for (Op op : {Op::kOpenRead, Op::kPread}) {
    for (int n = 0;; ++n) {
      INFO(OpName(op) << " call " << n << " fails with EIO");
      const ScopedDir dir;
      {
        TierOptions t = Tiers(dir, Codec::kNone, 16);
        t.segment_bytes = 3 * testing::kBlockBytes;
        Node node(t, 16);
        PublishAll(node);
        REQUIRE(node.store->Flush()->durable);
      }
      FaultyFileSystem fs;
      fs.FailNth(op, n, EIO);
      {
        TierOptions t = Tiers(dir);
        t.file_system = &fs;
        CacheOptions o = testing::SmallOptions(8);
        auto arena = *HostArena::Create(o.pools);
        auto cache = testing::MakeCache(o, SystemClock::Get());
        auto store = TierStore::Open(t, arena.get(), cache.get());
        REQUIRE(store.ok());
        cache->SetEvictionSink(store->get());
        const absl::Status loaded = (*store)->Load();
        if (!loaded.ok()) {
          // Only an unreadable manifest stops a start, naming it; nothing was changed on disk.
          REQUIRE(loaded.code() == absl::StatusCode::kFailedPrecondition);
          REQUIRE(loaded.message().find("manifest") != absl::string_view::npos);
        } else {
          REQUIRE((*store)->Stats().checksum_failures == 0);  // an I/O error is not damage
          REQUIRE((*store)->Stats().quarantined_segments == 0);
        }
        cache->SetEvictionSink(nullptr);
        store->reset();
      }
      fs.Disarm();
      const bool fired = fs.fired();
      Node node(Tiers(dir));
      REQUIRE(node.store->Stats().reloaded_records == 9);
      REQUIRE(ServedInFull(node, "r") == 3);
      if (!fired) break;  // every call of this kind in a restart was tried
    }
  }
}

TEST_CASE("A segment write that fails under disk pressure evicts nothing", "[store][faults]") {
  const ScopedDir dir;
  FaultyFileSystem fs;
  TierOptions t = Tiers(dir);
  t.file_system = &fs;
  t.segment_bytes = 64 * testing::kBlockBytes;
  {
    Node node(t, 16);
    node.Publish("a", kPrompts[0]);
    REQUIRE(node.store->Flush()->durable);
  }
  {
    // Room for one and a half segments: the next one needs the first one's room, and its write
    // fails.
    TierOptions tight = t;
    tight.disk_bytes = std::filesystem::file_size(dir.path + "/" + SegmentName(1)) * 3 / 2;
    Node node(tight, 16);
    REQUIRE(node.store->Stats().reloaded_records == 3);
    node.Publish("b", kPrompts[1]);
    fs.FailNth(Op::kFsync, 0, EIO);  // the new segment's fsync
    auto r = node.store->Flush();
    fs.Disarm();
    REQUIRE(r.ok());
    REQUIRE_FALSE(r->durable);
    // The first prompt's segment is still indexed and on disk.
    REQUIRE(node.store->Stats().disk_segments == 1);
    REQUIRE(node.store->Stats().disk_records == 3);
  }
  Node node(Tiers(dir));
  REQUIRE(node.store->Stats().reloaded_records == 3);
  REQUIRE(node.Serve("r", kPrompts[0]) == 12);
}

TEST_CASE("Serving: a failed read of a stored block is a miss, never a drop", "[store][faults]") {
  const ScopedDir dir;
  FaultyFileSystem fs;
  TierOptions t = Tiers(dir);
  t.file_system = &fs;
  Node node(t);
  node.Publish("a", kPrompts[0]);
  node.cache->Gc();
  REQUIRE(node.store->Flush()->durable);
  node.store->DropMemory();
  fs.FailNth(Op::kPread, 0, EIO);
  REQUIRE(node.Serve("b", kPrompts[0]) == 0);  // the first block's read failed: nothing promoted
  REQUIRE(node.store->Stats().read_errors == 1);
  REQUIRE(node.store->Stats().checksum_failures == 0);
  fs.Disarm();
  REQUIRE(node.Serve("c", kPrompts[0]) == 12);  // still there
}

}  // namespace
}  // namespace kvd
