// FileSystem: the system calls through which the disk tier (G3) reads and writes its files,
// behind one interface (leveldb's Env idea), so that tests can fail any one of them
// deterministically: an fsync, a rename, a write or a read at a chosen step of a flush, a
// manifest rewrite or a warm restart. Default() is the real thing.
//
// Every method has the POSIX contract of the call it is named after: -1 (or a short count) with
// errno set on failure. Directory listing, stat and mkdir are not behind it (nothing worth
// injecting fails there that open and read do not cover).
#pragma once

#include <sys/types.h>

#include <cstddef>

namespace kvd {

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  virtual int Open(const char* path, int flags, mode_t mode);
  virtual ssize_t Write(int fd, const void* data, size_t size);
  virtual ssize_t Pread(int fd, void* out, size_t size, off_t offset);
  virtual int Fsync(int fd);
  virtual int Rename(const char* from, const char* to);
  virtual int Unlink(const char* path);

  // The process-wide real file system.
  static FileSystem* Default();
};

}  // namespace kvd
