// Router-event topics and endpoints: which topics may share a PUB socket, and when it binds.
#include <catch2/catch.hpp>

#include "server/events/router_event_publisher.h"

namespace kvd {
namespace {

RouterEventsOptions WithPools(std::vector<std::string> pools) {
  RouterEventsOptions o;
  o.endpoint = "tcp://*:5557";
  o.node = "n1";
  o.pools = std::move(pools);
  return o;
}

TEST_CASE("Topics that would prefix-match under ZMQ subscription are refused, naming both", "[events]") {
  CHECK(CheckRouterEventsOptions(WithPools({"m", "n", "llama"})).ok());
  const absl::Status s = CheckRouterEventsOptions(WithPools({"llama", "llama-70b"}));
  REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message().find("'kv@n1@llama'") != std::string::npos);
  CHECK(s.message().find("'kv@n1@llama-70b'") != std::string::npos);
  RouterEventsOptions fenced = WithPools({"llama", "llama-70b"});
  fenced.topic = "kv@{node}@{pool}@";  // text after {pool}: no topic is a prefix of another
  CHECK(CheckRouterEventsOptions(fenced).ok());
  RouterEventsOptions one = WithPools({"llama", "llama-70b"});
  one.topic = "kv@{node}";  // every pool on one topic would put two sequences on it
  CHECK(CheckRouterEventsOptions(one).code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("A per-pool medium names a configured pool and is one word", "[events]") {
  RouterEventsOptions o = WithPools({"m", "n"});
  o.medium = {{"n", "GPU"}};
  CHECK(CheckRouterEventsOptions(o).ok());
  o.medium = {{"", "GPU"}};  // every pool
  CHECK(CheckRouterEventsOptions(o).ok());
  o.medium = {{"x", "GPU"}};
  CHECK(CheckRouterEventsOptions(o).message().find("no pool named 'x'") != std::string::npos);
  o.medium = {{"m", "G PU"}};
  CHECK(CheckRouterEventsOptions(o).code() == absl::StatusCode::kInvalidArgument);
  o.medium = {{"m", ""}};
  CHECK(CheckRouterEventsOptions(o).code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("The PUB socket binds or connects by vLLM's rule unless told", "[events]") {
  RouterEventsOptions sideways = WithPools({"m"});
  sideways.endpoint_mode = "sideways";
  CHECK(CheckRouterEventsOptions(sideways).message().find("endpoint_mode") != std::string::npos);
  CHECK(RouterEndpointBinds("tcp://*:5557", "auto"));
  CHECK(RouterEndpointBinds("tcp://[::]:5557", "auto"));
  CHECK(RouterEndpointBinds("ipc:///run/kvd/events", "auto"));
  CHECK(RouterEndpointBinds("inproc://events", "auto"));
  CHECK_FALSE(RouterEndpointBinds("tcp://indexer.llm-d:5557", "auto"));
  CHECK_FALSE(RouterEndpointBinds("tcp://10.0.0.7:5557", "auto"));
  CHECK(RouterEndpointBinds("tcp://10.0.0.7:5557", "bind"));
  CHECK_FALSE(RouterEndpointBinds("tcp://*:5557", "connect"));
}

}  // namespace
}  // namespace kvd
