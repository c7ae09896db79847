// kvd_daemon_bench --decode: what a decode step costs an engine's scheduler in kvd's control
// plane, per-request calls against the step protocol (client/step.h), with Ping in the same run.
#pragma once

#include <string>
#include <vector>

#include "client/client.h"

namespace kvd::bench {

// Batches of `batches` requests (512-token prompts, pool "bench") grow one position per step for
// `steps` steps, the engine computing `compute_us` between steps (the step protocol's refills go
// out meanwhile; per-request calls have nothing to overlap); prints a table. Also times one step admitting 64 new 2,048-token prompts (half
// prefix hits) against Ping + the engine in-process. False on an error (printed).
// `target`: kvd's address, for a raw stream round trip against unary Ping first.
bool RunDecodeBench(client::Client& c, const std::vector<int>& batches, int steps, int compute_us,
                    const std::string& target);

}  // namespace kvd::bench
