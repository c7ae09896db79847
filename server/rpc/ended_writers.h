// Fences of writers whose process has ended (docs/security.md, "Leases and fencing"). A writer
// that is gone writes nothing more, so the blocks fenced for it can be lifted at once: the reaper
// does it on each look, and a resume does it before it takes a checkpoint, so that a generation
// resumed right after its worker died gets the whole checkpoint, tail block included.
//
// Reads /proc once per fenced pid: never call it under the engine lock (KvCache takes its own,
// briefly, to list the pids and to lift each one's fences).
#pragma once

#include <cstdint>

namespace kvd {

class KvCache;

// Lifts the fences of every fenced pid whose process has ended; the blocks lifted.
int64_t LiftFencesOfEndedWriters(KvCache& cache);

}  // namespace kvd
