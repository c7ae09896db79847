/* A stand-in for libcuda's virtual-memory entry points kvd.cuda calls for VMM slabs, for testing
 * the ctypes marshalling on machines without a GPU. A "device allocation" is the host memfd kvd
 * would pass: importing keeps a duplicate of the fd, reserving takes an address range, mapping
 * maps the fd there (MAP_SHARED), so the test reads and writes the slab's bytes through the
 * returned pointer. It records what it was given; an fd handle type other than POSIX fd fails
 * with CUDA_ERROR_INVALID_VALUE (1). */
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct { int type; int id; } Location;
typedef struct {
  int type;
  int requested_handle_types;
  Location location;
  void* win32;
  unsigned char compression, rdma;
  unsigned short usage;
  unsigned char reserved[4];
} Prop;
typedef struct { Location location; int flags; } Access;

static Prop g_prop;
static Access g_access;
static int g_live = 0;  /* imported handles not yet released */

int cuMemGetAllocationGranularity(size_t* granularity, const Prop* prop, int option) {
  g_prop = *prop;
  *granularity = option == 0 ? (size_t)2 << 20 : 0;
  return 0;
}

int cuMemImportFromShareableHandle(unsigned long long* handle, void* os_handle, int type) {
  if (type != 1) return 1;
  int fd = dup((int)(intptr_t)os_handle);
  if (fd < 0) return 1;
  *handle = (unsigned long long)fd;
  ++g_live;
  return 0;
}

int cuMemAddressReserve(unsigned long long* ptr, size_t size, size_t align, unsigned long long addr,
                        unsigned long long flags) {
  (void)align; (void)addr; (void)flags;
  void* p = mmap(0, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return 2;
  *ptr = (unsigned long long)(uintptr_t)p;
  return 0;
}

int cuMemMap(unsigned long long ptr, size_t size, size_t offset, unsigned long long handle, unsigned long long flags) {
  (void)flags;
  void* p = mmap((void*)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, (int)handle, (off_t)offset);
  return p == MAP_FAILED ? 2 : 0;
}

int cuMemSetAccess(unsigned long long ptr, size_t size, const Access* desc, size_t count) {
  (void)ptr; (void)size;
  if (count != 1) return 1;
  g_access = *desc;
  return 0;
}

int cuMemUnmap(unsigned long long ptr, size_t size) { return munmap((void*)(uintptr_t)ptr, size) == 0 ? 0 : 1; }
int cuMemAddressFree(unsigned long long ptr, size_t size) { (void)ptr; (void)size; return 0; }
int cuMemRelease(unsigned long long handle) {
  --g_live;
  return close((int)handle) == 0 ? 0 : 1;
}
int cuGetErrorString(int code, const char** text) {
  *text = code == 1 ? "invalid argument" : "out of memory";
  return 0;
}

/* Test inspection. */
int fake_prop_type(void) { return g_prop.type; }
int fake_prop_handle_types(void) { return g_prop.requested_handle_types; }
int fake_prop_location(void) { return g_prop.location.type * 100 + g_prop.location.id; }
int fake_access(void) { return g_access.location.type * 10000 + g_access.location.id * 100 + g_access.flags; }
int fake_live(void) { return g_live; }
