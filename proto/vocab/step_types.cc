#include "proto/vocab/step_types.h"

namespace kvd {

std::string StepOpKindName(StepOpKind kind) {
  switch (kind) {
    case StepOpKind::kGrow: return "grow";
    case StepOpKind::kPublish: return "publish";
    case StepOpKind::kCheckpoint: return "checkpoint";
    case StepOpKind::kEnd: return "end";
    case StepOpKind::kPreempt: return "preempt";
  }
  return "unknown";
}

}  // namespace kvd
