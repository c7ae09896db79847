// Status propagation and invariant checks used in every layer of kvd.
//
// KVD_RETURN_IF_ERROR(expr): returns the absl::Status of `expr` from the enclosing function when it
// is not OK. KVD_ASSIGN_OR_RETURN(lhs, expr): evaluates an absl::StatusOr, returns its status on
// error, else assigns (or declares) `lhs` from its value. KVD_CHECK(cond) is for broken invariants
// only (bugs): it logs the condition and aborts. Expected failures are statuses, never checks.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVD_STATUS_CONCAT_INNER_(a, b) a##b
#define KVD_STATUS_CONCAT_(a, b) KVD_STATUS_CONCAT_INNER_(a, b)

#define KVD_RETURN_IF_ERROR(expr)                    \
  do {                                               \
    ::absl::Status kvd_status_ = (expr);             \
    if (!kvd_status_.ok()) return kvd_status_;       \
  } while (0)

#define KVD_ASSIGN_OR_RETURN(lhs, expr) \
  KVD_ASSIGN_OR_RETURN_IMPL_(KVD_STATUS_CONCAT_(kvd_statusor_, __LINE__), lhs, expr)

#define KVD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                               \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#define KVD_CHECK(cond)                                                                  \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "KVD_CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)
