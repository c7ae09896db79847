#include "gpu/device_identity.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvd {

std::string FormatGpuUuid(const std::array<uint8_t, 16>& b) {
  std::string hex;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) hex += '-';
    hex += absl::StrFormat("%02x", b[i]);
  }
  return "GPU-" + hex;
}

std::string CanonicalPciBusId(absl::string_view id) {
  std::string out = absl::AsciiStrToLower(id);
  // "bb:dd.f" has one colon; the full form "dddd:bb:dd.f" has two.
  if (std::count(out.begin(), out.end(), ':') == 1) out = "0000:" + out;
  // Domains may print with 8 digits ("00000000:17:00.0"); keep the last 4.
  if (size_t first = out.find(':'); first > 4 && first != std::string::npos) out.erase(0, first - 4);
  return out;
}

absl::StatusOr<int> ResolveDevice(const std::vector<DeviceIdentity>& visible, absl::string_view uuid,
                                  absl::string_view pci_bus_id, int daemon_ordinal) {
  const std::string want_uuid = absl::AsciiStrToLower(uuid);
  const std::string want_pci = pci_bus_id.empty() ? "" : CanonicalPciBusId(pci_bus_id);
  if (want_uuid.empty() && want_pci.empty()) return daemon_ordinal;
  for (const DeviceIdentity& d : visible) {
    if (!want_uuid.empty() && !d.uuid.empty()) {
      if (absl::AsciiStrToLower(d.uuid) == want_uuid) return d.ordinal;
      continue;  // both sides have a UUID: it alone decides
    }
    if (!want_pci.empty() && !d.pci_bus_id.empty() && CanonicalPciBusId(d.pci_bus_id) == want_pci) {
      return d.ordinal;
    }
  }
  std::vector<std::string> seen;
  for (const DeviceIdentity& d : visible) {
    seen.push_back(absl::StrCat(d.ordinal, "=", d.uuid, "@", d.pci_bus_id));
  }
  return absl::NotFoundError(absl::StrCat(
      "this process cannot see GPU ", uuid.empty() ? "(no uuid)" : uuid, " (PCI ",
      pci_bus_id.empty() ? "?" : pci_bus_id, ") that kvd's slab is on; it sees [",
      absl::StrJoin(seen, ", "),
      "] — grant the pod that GPU through the device plugin, or check CUDA_VISIBLE_DEVICES"));
}

}  // namespace kvd
