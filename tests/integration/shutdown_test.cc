// Daemon teardown in dependency order: a daemon run in this process is destroyed while /metrics
// is scraped without pause (the exposer reads the tier store, the router-event publisher and the
// cache through raw pointers). Under the sanitizer pass any use after free aborts the test.
#include <atomic>
#include <thread>

#include <catch2/catch.hpp>

#include "server/daemon.h"
#include "tests/integration/harness.h"
#include "tests/util/small_pool.h"

namespace kvd {
namespace {

using namespace kvd::testing;

TEST_CASE("A daemon torn down while /metrics is scraped stops cleanly", "[integration][shutdown]") {
  for (int round = 0; round < 5; ++round) {
    TempDir dir;
    Options o;
    o.server.listen = "unix://" + dir.path() + "/kvd.sock";
    o.server.side_socket = dir.path() + "/kvd.sock.slabs";
    o.server.metrics_listen = "127.0.0.1:0";
    o.cache.pools.push_back(SmallPool());
    o.tiers.host_bytes = 1 << 20;
    o.tiers.disk_dir = dir.path() + "/disk";
    o.router_events.endpoint = "ipc://" + dir.path() + "/events";
    auto d = Daemon::Start(o);
    INFO(d.status().ToString());
    REQUIRE(d.ok());
    const int port = (*d)->metrics_port();
    std::atomic<bool> stop{false};
    std::atomic<int> scrapes{0};
    std::thread scraper([&] {
      while (!stop.load()) {
        if (HttpGet(port, "/metrics").ok()) ++scrapes;
      }
    });
    while (scrapes.load() < 3) std::this_thread::yield();
    d->reset();  // while the scraper keeps asking
    stop = true;
    scraper.join();
    REQUIRE(scrapes.load() >= 3);
  }
}

}  // namespace
}  // namespace kvd
