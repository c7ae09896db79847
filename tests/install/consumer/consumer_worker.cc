// A worker built out of kvd's tree against the installed headers and library (find_package(kvd)
// or pkg-config): attaches, starts a 40-token request in pool "default", writes one byte pattern
// into every block it must compute (through LayerPointer, in place), checks the pattern in the
// blocks it reused, publishes and ends. Prints "cached=N verified=M" and exits 0, or 1 on any
// error, 3 when a reused byte is wrong.
//   consumer_worker TARGET REQUEST_ID
#include <cstdio>
#include <string>
#include <vector>

#include <kvd/client/client.h>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: consumer_worker TARGET REQUEST_ID\n");
    return 2;
  }
  auto client = kvd::client::Client::Connect({.target = argv[1], .worker_name = "consumer"});
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  auto pool = (*client)->FindPool("default");
  if (!pool.ok()) {
    std::fprintf(stderr, "%s\n", pool.status().ToString().c_str());
    return 1;
  }
  const kvd::PoolGeometry& g = (*pool)->geometry;
  kvd::RequestSpec spec;
  spec.id = kvd::RequestId(argv[2]);
  spec.ns.pool = "default";
  for (int t = 0; t < 40; ++t) spec.prompt.push_back(1000 + t);
  auto req = (*client)->Start(spec);
  if (!req.ok()) {
    std::fprintf(stderr, "start: %s\n", req.status().ToString().c_str());
    return 1;
  }
  const int64_t block_bytes = int64_t{g.block_tokens} * g.bytes_per_token_per_layer;
  const int64_t cached_blocks = (*req)->cached_tokens() / g.block_tokens;
  int64_t verified = 0;
  for (size_t i = 0; i < (*req)->blocks().size(); ++i) {
    for (int layer = 0; layer < g.num_layers; ++layer) {
      auto p = (*client)->LayerPointer((*req)->pool(), (*req)->blocks()[i], layer);
      if (!p.ok()) return 1;
      const uint8_t want = static_cast<uint8_t>(i * 31 + layer);
      if (static_cast<int64_t>(i) < cached_blocks) {
        for (int64_t b = 0; b < block_bytes; ++b) {
          if ((*p)[b] != want) return 3;
        }
        verified += block_bytes;
      } else {
        for (int64_t b = 0; b < block_bytes; ++b) (*p)[b] = want;
      }
    }
  }
  auto end = (*req)->End(/*publish_blocks=*/spec.prompt.size() / g.block_tokens, {}, /*completed=*/true);
  if (!end.ok()) {
    std::fprintf(stderr, "end: %s\n", end.status().ToString().c_str());
    return 1;
  }
  std::printf("cached=%lld verified=%lld\n", static_cast<long long>((*req)->cached_tokens()),
              static_cast<long long>(verified));
  return 0;
}
