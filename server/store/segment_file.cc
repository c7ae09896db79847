#include "server/store/segment_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "gpu/unique_fd.h"
#include "server/store/codec.h"

namespace kvd {
namespace {

static_assert(std::endian::native == std::endian::little,
              "kvd's files are little-endian and read with memcpy: port Put/Load first");

constexpr char kSegmentMagic[8] = {'K', 'V', 'D', 'S', 'E', 'G', '1', '\0'};
constexpr char kManifestMagic[8] = {'K', 'V', 'D', 'M', 'A', 'N', '1', '\0'};
constexpr int64_t kSegmentPreamble = kSegmentPreambleBytes;

absl::Status Errno(absl::string_view what, int err) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  if (err == ENOENT) return absl::NotFoundError(msg);
  return absl::InternalError(msg);
}

template <typename T>
void Put(std::string* out, T v) {
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));
  out->append(buf, sizeof(T));
}

template <typename T>
T Load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

absl::Status WriteAll(FileSystem* fs, int fd, absl::string_view data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = fs->Write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno(absl::StrCat("write ", path), errno);
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status PreadAll(FileSystem* fs, int fd, char* out, size_t size, int64_t offset, const std::string& path) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = fs->Pread(fd, out + done, size - done, offset + static_cast<int64_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno(absl::StrCat("read ", path), errno);
    if (n == 0) return absl::DataLossError(absl::StrCat(path, " is shorter than its headers say"));
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteFileDurably(const std::string& dir, const std::string& name,
                              absl::string_view data, FileSystem* fs) {
  return WriteFileDurably(dir, name, std::vector<absl::string_view>{data}, fs);
}

absl::Status WriteFileDurably(const std::string& dir, const std::string& name,
                              const std::vector<absl::string_view>& pieces, FileSystem* fs) {
  const std::string path = absl::StrCat(dir, "/", name);
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    UniqueFd fd(fs->Open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640));
    if (!fd.valid()) return Errno(absl::StrCat("open ", tmp), errno);
    absl::Cleanup remove_tmp = [&] { fs->Unlink(tmp.c_str()); };
    for (absl::string_view piece : pieces) {
      if (absl::Status s = WriteAll(fs, fd.get(), piece, tmp); !s.ok()) return s;
    }
    if (fs->Fsync(fd.get()) != 0) return Errno(absl::StrCat("fsync ", tmp), errno);
    if (fs->Rename(tmp.c_str(), path.c_str()) != 0) return Errno(absl::StrCat("rename ", tmp), errno);
    std::move(remove_tmp).Cancel();
  }
  UniqueFd dfd(fs->Open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0));
  if (!dfd.valid()) return Errno(absl::StrCat("open ", dir), errno);
  if (fs->Fsync(dfd.get()) != 0) return Errno(absl::StrCat("fsync ", dir), errno);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> WriteSegment(const std::string& dir, const std::string& name,
                                     std::vector<RecordHeader>& headers,
                                     const std::vector<absl::string_view>& payloads,
                                     FileSystem* fs) {
  // Offsets depend on the header section's size, which does not depend on the offsets' values.
  std::string section;
  for (const RecordHeader& h : headers) EncodeRecordHeader(h, &section);
  int64_t offset = kSegmentPreamble + static_cast<int64_t>(section.size());
  for (size_t i = 0; i < headers.size(); ++i) {
    headers[i].offset = static_cast<uint64_t>(offset);
    offset += static_cast<int64_t>(payloads[i].size());
  }
  section.clear();
  for (const RecordHeader& h : headers) EncodeRecordHeader(h, &section);
  std::string head;
  head.append(kSegmentMagic, sizeof(kSegmentMagic));
  Put<uint32_t>(&head, static_cast<uint32_t>(headers.size()));
  Put<uint32_t>(&head, 0);
  Put<uint64_t>(&head, section.size());
  Put<uint64_t>(&head, Checksum(section.data(), section.size()));
  head += section;
  std::vector<absl::string_view> pieces{head};
  pieces.insert(pieces.end(), payloads.begin(), payloads.end());
  if (absl::Status s = WriteFileDurably(dir, name, pieces, fs); !s.ok()) return s;
  return offset;
}

absl::StatusOr<std::vector<RecordHeader>> ReadSegmentHeaders(const std::string& path,
                                                             int64_t* file_size,
                                                             int64_t* truncated_records,
                                                             FileSystem* fs) {
  if (truncated_records != nullptr) *truncated_records = 0;
  UniqueFd fd(fs->Open(path.c_str(), O_RDONLY | O_CLOEXEC, 0));
  if (!fd.valid()) return Errno(absl::StrCat("open ", path), errno);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return Errno(absl::StrCat("stat ", path), errno);
  *file_size = st.st_size;
  char pre[kSegmentPreamble];
  if (st.st_size < kSegmentPreamble) return absl::DataLossError(absl::StrCat(path, ": too short"));
  if (absl::Status s = PreadAll(fs, fd.get(), pre, sizeof(pre), 0, path); !s.ok()) return s;
  if (std::memcmp(pre, kSegmentMagic, sizeof(kSegmentMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": not a kvd segment"));
  }
  const uint32_t count = Load<uint32_t>(pre + 8);
  const uint32_t zero = Load<uint32_t>(pre + 12);
  const uint64_t hbytes = Load<uint64_t>(pre + 16);
  const uint64_t hsum = Load<uint64_t>(pre + 24);
  if (zero != 0) return absl::DataLossError(absl::StrCat(path, ": reserved preamble word is not zero"));
  if (hbytes > static_cast<uint64_t>(st.st_size - kSegmentPreamble)) {
    return absl::DataLossError(absl::StrCat(path, ": header section past the end of the file"));
  }
  // The count is outside the checksum: bound it by what the section could hold before trusting it.
  if (count > hbytes / kMinRecordHeaderBytes) {
    return absl::DataLossError(absl::StrCat(path, ": record count ", count, " does not fit the header section"));
  }
  std::string section(hbytes, '\0');
  if (absl::Status s = PreadAll(fs, fd.get(), section.data(), hbytes, kSegmentPreamble, path); !s.ok()) {
    return s;
  }
  if (Checksum(section.data(), section.size()) != hsum) {
    return absl::DataLossError(absl::StrCat(path, ": header checksum mismatch"));
  }
  std::vector<RecordHeader> out;
  out.reserve(count);
  absl::string_view in(section);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  for (uint32_t i = 0; i < count; ++i) {
    absl::StatusOr<RecordHeader> h = DecodeRecordHeader(&in);
    if (!h.ok()) return absl::DataLossError(absl::StrCat(path, ": ", h.status().message()));
    const uint64_t stored = static_cast<uint64_t>(h->stored_length);  // >= 0: checked by decoding
    if (h->offset < kSegmentPreamble + hbytes || stored > size || h->offset > size - stored) {
      if (truncated_records != nullptr) ++*truncated_records;
      continue;  // past the end (the file was truncated), or an offset into the headers
    }
    out.push_back(*std::move(h));
  }
  if (!in.empty()) {
    return absl::DataLossError(absl::StrCat(path, ": record count ", count, " does not match the header section"));
  }
  return out;
}

absl::Status ReadRecordBytes(const std::string& path, const RecordHeader& h, std::string* stored,
                             FileSystem* fs) {
  UniqueFd fd(fs->Open(path.c_str(), O_RDONLY | O_CLOEXEC, 0));
  if (!fd.valid()) return Errno(absl::StrCat("open ", path), errno);
  stored->resize(static_cast<size_t>(h.stored_length));
  if (absl::Status s = PreadAll(fs, fd.get(), stored->data(), stored->size(),
                                static_cast<int64_t>(h.offset), path);
      !s.ok()) {
    return s;
  }
  if (Checksum(stored->data(), stored->size()) != h.checksum) {
    return absl::DataLossError(absl::StrCat(path, ": checksum mismatch in block ", h.key.ToHex()));
  }
  return absl::OkStatus();
}

std::string SegmentName(uint64_t number) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "seg-%016llu.kvd", static_cast<unsigned long long>(number));
  return buf;
}

std::optional<uint64_t> ParseSegmentName(absl::string_view name) {
  unsigned long long num = 0;
  const std::string s(name);
  if (std::sscanf(s.c_str(), "seg-%llu.kvd", &num) != 1 || SegmentName(num) != s) return std::nullopt;
  return static_cast<uint64_t>(num);
}

absl::Status WriteManifest(const std::string& dir, const Manifest& m, FileSystem* fs) {
  std::string out(kManifestMagic, sizeof(kManifestMagic));
  Put<uint64_t>(&out, m.generation);
  Put<uint64_t>(&out, m.next_segment);
  Put<uint32_t>(&out, static_cast<uint32_t>(m.segments.size()));
  for (uint64_t s : m.segments) Put(&out, s);
  Put<uint32_t>(&out, static_cast<uint32_t>(m.deleted.size()));
  for (const Tombstone& t : m.deleted) {
    Put(&out, t.key.hi);
    Put(&out, t.key.lo);
    Put(&out, t.segment);
  }
  Put<uint64_t>(&out, Checksum(out.data(), out.size()));
  return WriteFileDurably(dir, kManifestName, out, fs);
}

absl::StatusOr<Manifest> ReadManifest(const std::string& dir, FileSystem* fs) {
  const std::string path = absl::StrCat(dir, "/", kManifestName);
  UniqueFd fd(fs->Open(path.c_str(), O_RDONLY | O_CLOEXEC, 0));
  if (!fd.valid()) return Errno(absl::StrCat("open ", path), errno);
  std::string data;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = fs->Pread(fd.get(), buf, sizeof(buf), static_cast<off_t>(data.size()));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno(absl::StrCat("read ", path), errno);
    if (n == 0) break;
    data.append(buf, static_cast<size_t>(n));
  }
  const auto bad = [&](const char* why) { return absl::DataLossError(absl::StrCat(path, ": ", why)); };
  if (data.size() < sizeof(kManifestMagic) + 8 ||
      std::memcmp(data.data(), kManifestMagic, sizeof(kManifestMagic)) != 0) {
    return bad("not a kvd manifest");
  }
  const size_t body = data.size() - 8;
  if (Checksum(data.data(), body) != Load<uint64_t>(data.data() + body)) return bad("checksum mismatch");
  Manifest m;
  size_t pos = sizeof(kManifestMagic);
  const auto need = [&](size_t n) { return pos + n <= body; };
  if (!need(20)) return bad("truncated");
  m.generation = Load<uint64_t>(data.data() + pos);
  m.next_segment = Load<uint64_t>(data.data() + pos + 8);
  const uint32_t nseg = Load<uint32_t>(data.data() + pos + 16);
  pos += 20;
  if (!need(size_t{nseg} * 8)) return bad("truncated");
  for (uint32_t i = 0; i < nseg; ++i) {
    m.segments.push_back(Load<uint64_t>(data.data() + pos));
    pos += 8;
  }
  if (!need(4)) return bad("truncated");
  const uint32_t ndel = Load<uint32_t>(data.data() + pos);
  pos += 4;
  if (!need(size_t{ndel} * 24)) return bad("truncated");
  for (uint32_t i = 0; i < ndel; ++i) {
    const char* p = data.data() + pos;
    m.deleted.push_back(Tombstone{BlockKey{Load<uint64_t>(p), Load<uint64_t>(p + 8)}, Load<uint64_t>(p + 16)});
    pos += 24;
  }
  return m;
}

}  // namespace kvd
