// kvdctl's JSON: any API message as one line of JSON for scripts and jq, with numbers as numbers
// (protobuf's own JSON prints 64-bit integers as strings), bytes as lowercase hex (block keys
// read as in the tables and in logs, not base64), enums by name, the proto's field names, every
// scalar field present even at its default, unset sub-messages left out.
#pragma once

#include <string>

#include <google/protobuf/message.h>

namespace kvd {

std::string ToJsonLine(const google::protobuf::Message& message);

// `s` as a quoted JSON string.
std::string JsonString(const std::string& s);

}  // namespace kvd
