// Client::StepSubmit (client/client.h): a step whose round trip stays in flight while the engine
// computes, against a real kvd. Credit-covered growth is placed before it returns; the answer is
// applied at Get, equal to what Step gives; a second step meanwhile is refused and changes
// nothing; a kvd that stops answering and is killed under a step in flight fails Get without
// hanging, and the held growth that step carried makes its request unusable.
#include <dirent.h>
#include <signal.h>

#include <fstream>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "tests/integration/harness.h"

namespace kvd {
namespace {

using namespace kvd::testing;
using client::Client;

std::unique_ptr<Client> Connect(const DaemonProcess& d) {
  auto c = Client::Connect({.target = d.target(), .worker_name = "submit", .step_credit_blocks = 8});
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  return std::move(*c);
}

// SIGSTOPs the daemon and waits until every thread of it is stopped: kill() only queues the signal,
// and a thread running on another CPU may still answer a call sent right after it.
void StopDaemon(DaemonProcess& d) {
  d.Signal(SIGSTOP);
  const std::string tasks = absl::StrCat("/proc/", d.pid(), "/task");
  for (const absl::Time deadline = absl::Now() + absl::Seconds(5); absl::Now() < deadline;
       absl::SleepFor(absl::Milliseconds(1))) {
    bool all = true;
    DIR* dir = opendir(tasks.c_str());
    REQUIRE(dir != nullptr);
    while (dirent* e = readdir(dir)) {
      if (e->d_name[0] == '.') continue;
      std::ifstream stat(absl::StrCat(tasks, "/", e->d_name, "/stat"));
      std::string line;
      std::getline(stat, line);
      const size_t paren = line.rfind(')');
      const char state = paren != std::string::npos && paren + 2 < line.size() ? line[paren + 2] : 'T';
      all &= state == 'T' || state == 't';
    }
    closedir(dir);
    if (all) return;
  }
  FAIL("kvd did not stop within 5 s");
}

RequestSpec Spec(const std::string& id, int tokens) {
  RequestSpec spec;
  spec.id = RequestId(id);
  spec.ns.pool = "default";
  spec.prompt = std::vector<Token>(tokens, 7);
  spec.max_new_tokens = 64;
  return spec;
}

TEST_CASE("A submitted step places credit growth at once and applies kvd's answer at Get", "[integration][step][submit]") {
  DaemonProcess d(SmallPoolConfig(128));
  auto c = Connect(d);
  client::StepRequest a, b;
  client::StepBatch first;
  first.Start(&a, Spec("a", 8));  // two full blocks of 4 tokens
  REQUIRE(c->Step(first)->items[0].status.ok());
  REQUIRE(c->StepCredit(0) == 8);

  // a crosses into a third block on credit; b's start needs kvd.
  client::StepBatch step;
  step.Grow(&a, 1);
  step.Start(&b, Spec("b", 6));
  auto f = c->StepSubmit(step);
  REQUIRE(f.ok());
  REQUIRE(a.blocks.size() == 3);  // placed before the round trip's answer
  REQUIRE(a.num_tokens == 9);

  SECTION("the answer, taken once") {
    auto answer = (*f)->Get();
    REQUIRE(answer.ok());
    REQUIRE(answer->sent);
    REQUIRE(answer->items[0].status.ok());
    REQUIRE(answer->items[1].status.ok());
    REQUIRE(b.live);
    REQUIRE(b.blocks.size() == 2);
    REQUIRE(b.num_tokens == 6);
    REQUIRE((*f)->ready());
    auto again = (*f)->Get();
    REQUIRE(absl::IsFailedPrecondition(again.status()));
    // The client steps on: kvd learned of a's growth with the submitted step.
    client::StepBatch end;
    end.End(&a, 2, {7}, true);
    end.End(&b, 1, {}, true);
    auto ended = c->Step(end);
    REQUIRE(ended.ok());
    REQUIRE(ended->items[0].status.ok());
    REQUIRE(ended->items[1].status.ok());
    REQUIRE(c->Report()->live_requests == 0);
  }
  SECTION("a step or a submit before Get is refused and changes nothing") {
    client::StepRequest x;
    client::StepBatch other;
    other.Start(&x, Spec("x", 4));
    auto refused = c->Step(other);
    REQUIRE(absl::IsFailedPrecondition(refused.status()));
    REQUIRE_THAT(std::string(refused.status().message()), Catch::Contains("StepFuture::Get"));
    REQUIRE(absl::IsFailedPrecondition(c->StepSubmit(other).status()));
    REQUIRE(!x.live);
    auto answer = (*f)->Get();
    REQUIRE(answer.ok());
    REQUIRE(answer->items[1].status.ok());
    REQUIRE(c->Report()->live_requests == 2);  // x was never started
    REQUIRE(c->Step(other)->items[0].status.ok());
  }
  SECTION("a future dropped untaken still applies the answer") {
    f->reset();
    REQUIRE(b.live);
    client::StepBatch grow;
    grow.Grow(&b, 1);
    REQUIRE(c->Step(grow)->items[0].status.ok());
  }
}

TEST_CASE("A step with nothing to send is answered by its future at once", "[integration][step][submit]") {
  DaemonProcess d(SmallPoolConfig(128));
  auto c = Connect(d);
  client::StepRequest a;
  client::StepBatch first;
  first.Start(&a, Spec("a", 4));
  REQUIRE(c->Step(first)->items[0].status.ok());
  client::StepBatch grow;
  grow.Grow(&a, 1);
  auto f = c->StepSubmit(grow);
  REQUIRE(f.ok());
  REQUIRE((*f)->ready());
  auto answer = (*f)->Get();
  REQUIRE(answer.ok());
  REQUIRE(!answer->sent);
  REQUIRE(answer->items[0].status.ok());
  REQUIRE(a.blocks.size() == 2);
}

TEST_CASE("kvd stopped, then killed, under a submitted step: Get fails, no hang, the held growth's request is unusable",
          "[integration][step][submit]") {
  DaemonProcess d(SmallPoolConfig(128));
  auto c = Connect(d);
  client::StepRequest a, b;
  client::StepBatch first;
  first.Start(&a, Spec("a", 4));
  REQUIRE(c->Step(first)->items[0].status.ok());
  client::StepBatch step;
  step.Grow(&a, 1);  // on credit: held, carried by the next step that goes out
  step.Start(&b, Spec("b", 4));
  StopDaemon(d);
  auto f = c->StepSubmit(step);
  REQUIRE(f.ok());
  absl::SleepFor(absl::Milliseconds(300));
  REQUIRE(!(*f)->ready());
  d.Signal(SIGKILL);
  const absl::Time t0 = absl::Now();
  auto answer = (*f)->Get();
  REQUIRE(!answer.ok());
  REQUIRE(absl::Now() - t0 < absl::Seconds(20));
  REQUIRE(!b.live);
  REQUIRE(!a.error.ok());  // kvd may or may not have applied its growth: only End it now
  client::StepBatch grow;
  grow.Grow(&a, 1);
  auto refused = c->Step(grow);
  REQUIRE(refused.ok());
  REQUIRE(!refused->items[0].status.ok());
}

}  // namespace
}  // namespace kvd
