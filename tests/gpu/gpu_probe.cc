// kvd_gpu_probe: one JSON line about what CUDA shows this process, for the GPU proof bundle's
// run.sh (and an operator checking a node):
//   {"driver": "13.0", "runtime": "13.0", "devices": [{"ordinal": 0, "uuid": "GPU-…",
//    "pci_bus_id": "0000:17:00.0", "name": "NVIDIA H200"}], "error": ""}
// Exit status: 0 with at least one device; 2 when no NVIDIA driver is installed; 3 when the driver
// is there but CUDA shows no usable device (the error says why).
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpu/cuda_device.h"

namespace {

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}

}  // namespace

int main() {
  const int driver = kvd::CudaDriverVersion();
  auto devices = kvd::ListCudaDevices();
  std::vector<std::string> listed;
  if (devices.ok()) {
    for (const kvd::DeviceIdentity& d : *devices) {
      listed.push_back(absl::StrCat("{\"ordinal\": ", d.ordinal, ", \"uuid\": ", Quote(d.uuid),
                                    ", \"pci_bus_id\": ", Quote(d.pci_bus_id), ", \"name\": ",
                                    Quote(d.name), "}"));
    }
  }
  std::string error;
  if (driver == 0) {
    error = "no NVIDIA driver (libcuda.so.1 not found or not loadable)";
  } else if (!devices.ok()) {
    error = std::string(devices.status().message());
  } else if (devices->empty()) {
    error = "the driver shows no device";
  }
  std::printf("{\"driver\": %s, \"runtime\": %s, \"devices\": [%s], \"error\": %s}\n",
              Quote(kvd::CudaVersionString(driver)).c_str(),
              Quote(kvd::CudaVersionString(kvd::CudaRuntimeVersion())).c_str(),
              absl::StrJoin(listed, ", ").c_str(), Quote(error).c_str());
  if (driver == 0) return 2;
  return error.empty() ? 0 : 3;
}
