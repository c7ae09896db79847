// DeviceIdentity names a GPU the way every process on the node agrees on: its UUID and PCI bus
// id. CUDA ordinals are per process — a worker pod granted one GPU sees it as device 0 whatever
// the daemon calls it, and CUDA_VISIBLE_DEVICES renumbers devices — so kvd's slab descriptors
// carry the identity and each worker resolves it to its own ordinal (ResolveDevice).
//
// Pure functions on plain data: compiled without the CUDA toolkit and unit-tested without a GPU.
// gpu/cuda_device.h lists the identities the CUDA runtime shows this process.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvd {

struct DeviceIdentity {
  int ordinal = -1;         // this process's CUDA ordinal
  std::string uuid;         // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it
  std::string pci_bus_id;   // "0000:17:00.0" (domain:bus:device.function), lower case
  std::string name;         // e.g. "NVIDIA H200"; for messages only
};

// The nvidia-smi spelling of a 16-byte CUDA UUID (cudaDeviceProp::uuid).
std::string FormatGpuUuid(const std::array<uint8_t, 16>& bytes);

// PCI bus ids compare case-insensitively and with or without the 4-digit domain
// ("17:00.0" == "0000:17:00.0"); this is the canonical lower-case form with the domain.
std::string CanonicalPciBusId(absl::string_view id);

// This process's ordinal for the device a descriptor names. The UUID decides when both sides
// have one; else the PCI bus id; else (an old daemon that sent neither) `daemon_ordinal` is taken
// as is. NOT_FOUND naming the UUID, the bus id and the devices this process sees when none
// matches (the pod was not granted that GPU, or CUDA_VISIBLE_DEVICES hides it).
absl::StatusOr<int> ResolveDevice(const std::vector<DeviceIdentity>& visible,
                                  absl::string_view uuid, absl::string_view pci_bus_id,
                                  int daemon_ordinal);

}  // namespace kvd
