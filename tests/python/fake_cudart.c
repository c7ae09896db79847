/* A stand-in for libcudart with the four entry points kvd.cuda calls, for testing the ctypes
 * marshalling on machines without a GPU. cudaIpcOpenMemHandle "maps" a handle by returning a
 * pointer derived from its bytes, and records what it received; a handle whose first byte is 0xFF
 * fails with cudaErrorInvalidResourceHandle (400), as a handle from another node would. */
#include <stdint.h>
#include <string.h>

typedef struct { char reserved[64]; } cudaIpcMemHandle_t;

static int g_device = -1;
static unsigned g_flags = 0;
static unsigned char g_handle[64];
static void* g_open = 0;

int cudaSetDevice(int device) { g_device = device; return device < 0 ? 101 : 0; }

int cudaIpcOpenMemHandle(void** ptr, cudaIpcMemHandle_t handle, unsigned flags) {
  memcpy(g_handle, handle.reserved, 64);
  g_flags = flags;
  if ((unsigned char)handle.reserved[0] == 0xFF) return 400;
  uint64_t base = 0;
  memcpy(&base, handle.reserved, sizeof(base));
  *ptr = (void*)(uintptr_t)(0x7f0000000000ULL | (base & 0xffffff000ULL));
  g_open = *ptr;
  return 0;
}

int cudaIpcCloseMemHandle(void* ptr) {
  if (ptr != g_open) return 1;
  g_open = 0;
  return 0;
}

const char* cudaGetErrorName(int code) {
  return code == 400 ? "cudaErrorInvalidResourceHandle" : code == 101 ? "cudaErrorInvalidDevice" : "cudaErrorUnknown";
}
const char* cudaGetErrorString(int code) { return code == 400 ? "invalid resource handle" : "error"; }

/* Test inspection. */
int fake_device(void) { return g_device; }
unsigned fake_flags(void) { return g_flags; }
const unsigned char* fake_handle(void) { return g_handle; }
int fake_open(void) { return g_open != 0; }
