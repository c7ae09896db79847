#include "gpu/cuda_vmm.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu/cuda_device.h"
#include "gpu/cuda_status.h"
#include "proto/vocab/status_macros.h"

namespace kvd {
namespace {

// The driver entry points VmmSlab uses, with cuda.h's signatures (stable from CUDA 10.2 to 13).
struct VmmApi {
  decltype(&cuDeviceGetAttribute) device_attribute = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&cuGetErrorString) error_string = nullptr;
  bool complete() const {
    return device_attribute && granularity && create && release && reserve && address_free && map && unmap &&
           set_access && export_handle && import_handle;
  }
};

const VmmApi& Api() {
  static VmmApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    auto get = [](auto& fn, const char* name) { fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(CudaDriverSymbol(name)); };
    get(api.device_attribute, "cuDeviceGetAttribute");
    get(api.granularity, "cuMemGetAllocationGranularity");
    get(api.create, "cuMemCreate");
    get(api.release, "cuMemRelease");
    get(api.reserve, "cuMemAddressReserve");
    get(api.address_free, "cuMemAddressFree");
    get(api.map, "cuMemMap");
    get(api.unmap, "cuMemUnmap");
    get(api.set_access, "cuMemSetAccess");
    get(api.export_handle, "cuMemExportToShareableHandle");
    get(api.import_handle, "cuMemImportFromShareableHandle");
    get(api.error_string, "cuGetErrorString");
  });
  return api;
}

absl::Status DriverStatus(CUresult r, absl::string_view what) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const char* text = nullptr;
  if (Api().error_string != nullptr) Api().error_string(r, &text);
  return absl::InternalError(absl::StrCat(what, " failed: CUDA driver error ", static_cast<int>(r), " (",
                                          text != nullptr ? text : "unknown", ")"));
}

absl::Status CheckApi(int device) {
  if (!Api().complete()) {
    return absl::UnavailableError(absl::StrCat("the CUDA driver's virtual-memory API is not available (NVIDIA driver ",
                                               CudaVersionString(CudaDriverVersion()),
                                               "); allocator vmm needs a driver with it, or use allocator ipc"));
  }
  int supported = 0;
  KVD_RETURN_IF_ERROR(DriverStatus(
      Api().device_attribute(&supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device),
      "cuDeviceGetAttribute(POSIX_FILE_DESCRIPTOR_SUPPORTED)"));
  if (supported == 0) {
    return absl::FailedPreconditionError(absl::StrCat("device ", device, " cannot export memory as a POSIX fd; "
                                                      "use allocator ipc for its pools"));
  }
  return absl::OkStatus();
}

CUmemAllocationProp Properties(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

// `size` rounded up to a multiple of `granularity`.
int64_t RoundUp(int64_t size, size_t granularity) {
  return static_cast<int64_t>((static_cast<size_t>(size) + granularity - 1) / granularity * granularity);
}

}  // namespace

absl::StatusOr<VmmSlab> VmmSlab::Create(int device, int64_t size) {
  KVD_RETURN_IF_ERROR(CheckApi(device));
  KVD_CUDA_SCOPED_DEVICE(device);
  VmmSlab slab;
  slab.device_ = device;
  KVD_ASSIGN_OR_RETURN(const size_t granularity, slab.Granularity());
  slab.size_ = RoundUp(size, granularity);
  const CUmemAllocationProp prop = Properties(device);
  CUmemGenericAllocationHandle handle = 0;
  KVD_RETURN_IF_ERROR(DriverStatus(Api().create(&handle, static_cast<size_t>(slab.size_), &prop, 0),
                                   absl::StrCat("cuMemCreate(", slab.size_, ") on device ", device)));
  slab.handle_ = handle;  // released by Reset from here on
  int fd = -1;
  KVD_RETURN_IF_ERROR(DriverStatus(Api().export_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                                   "cuMemExportToShareableHandle"));
  slab.fd_ = UniqueFd(fd);
  KVD_RETURN_IF_ERROR(slab.MapAll(granularity));
  KVD_CUDA_RETURN_IF_ERROR(cudaMemset(slab.data(), 0, static_cast<size_t>(slab.size_)), "cudaMemset");
  KVD_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return slab;
}

absl::StatusOr<VmmSlab> VmmSlab::Import(int device, UniqueFd fd, int64_t size) {
  if (size <= 0) return absl::InvalidArgumentError(absl::StrCat("a VMM slab of ", size, " bytes"));
  KVD_RETURN_IF_ERROR(CheckApi(device));
  KVD_CUDA_SCOPED_DEVICE(device);
  VmmSlab slab;
  slab.device_ = device;
  slab.fd_ = std::move(fd);
  KVD_ASSIGN_OR_RETURN(const size_t granularity, slab.Granularity());
  slab.size_ = RoundUp(size, granularity);  // as Create rounded it
  CUmemGenericAllocationHandle handle = 0;
  KVD_RETURN_IF_ERROR(DriverStatus(
      Api().import_handle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(slab.fd_.get())),
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      "cuMemImportFromShareableHandle"));
  slab.handle_ = handle;
  KVD_RETURN_IF_ERROR(slab.MapAll(granularity));
  return slab;
}

absl::StatusOr<size_t> VmmSlab::Granularity() const {
  const CUmemAllocationProp prop = Properties(device_);
  size_t granularity = 0;
  KVD_RETURN_IF_ERROR(DriverStatus(Api().granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                                   "cuMemGetAllocationGranularity"));
  return granularity;
}

absl::Status VmmSlab::MapAll(size_t granularity) {
  CUdeviceptr ptr = 0;
  KVD_RETURN_IF_ERROR(DriverStatus(Api().reserve(&ptr, static_cast<size_t>(size_), granularity, 0, 0),
                                   "cuMemAddressReserve"));
  ptr_ = ptr;  // freed by Reset from here on
  KVD_RETURN_IF_ERROR(DriverStatus(Api().map(ptr, static_cast<size_t>(size_), 0, handle_, 0),
                                   "cuMemMap (an imported fd must be a VMM slab of this size)"));
  CUmemAccessDesc access{};
  access.location = Properties(device_).location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return DriverStatus(Api().set_access(ptr, static_cast<size_t>(size_), &access, 1), "cuMemSetAccess");
}

VmmSlab::VmmSlab(VmmSlab&& o) noexcept
    : handle_(std::exchange(o.handle_, 0)),
      ptr_(std::exchange(o.ptr_, 0)),
      size_(o.size_),
      device_(o.device_),
      fd_(std::move(o.fd_)) {}

VmmSlab& VmmSlab::operator=(VmmSlab&& o) noexcept {
  if (this != &o) {
    Reset();
    handle_ = std::exchange(o.handle_, 0);
    ptr_ = std::exchange(o.ptr_, 0);
    size_ = o.size_;
    device_ = o.device_;
    fd_ = std::move(o.fd_);
  }
  return *this;
}

VmmSlab::~VmmSlab() { Reset(); }

void VmmSlab::Reset() {
  if (ptr_ == 0 && handle_ == 0) return;
  ScopedCudaDevice scope(device_);
  if (ptr_ != 0) {
    // Unmapping fails harmlessly for a range that was reserved but never mapped.
    (void)Api().unmap(ptr_, static_cast<size_t>(size_));
    (void)Api().address_free(ptr_, static_cast<size_t>(size_));
    ptr_ = 0;
  }
  if (handle_ != 0) {
    (void)Api().release(handle_);
    handle_ = 0;
  }
}

}  // namespace kvd
