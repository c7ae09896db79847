#include "server/store/file_system.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>

namespace kvd {

int FileSystem::Open(const char* path, int flags, mode_t mode) { return ::open(path, flags, mode); }
ssize_t FileSystem::Write(int fd, const void* data, size_t size) { return ::write(fd, data, size); }
ssize_t FileSystem::Pread(int fd, void* out, size_t size, off_t offset) { return ::pread(fd, out, size, offset); }
int FileSystem::Fsync(int fd) { return ::fsync(fd); }
int FileSystem::Rename(const char* from, const char* to) { return ::rename(from, to); }
int FileSystem::Unlink(const char* path) { return ::unlink(path); }

FileSystem* FileSystem::Default() {
  static FileSystem* const fs = new FileSystem();
  return fs;
}

}  // namespace kvd
