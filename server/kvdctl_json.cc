#include "server/kvdctl_json.h"

#include <cmath>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvd {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

void AppendString(std::string* out, const std::string& s) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (c < 0x20) absl::StrAppendFormat(out, "\\u%04x", c);
        else out->push_back(static_cast<char>(c));
    }
  }
  out->push_back('"');
}

void AppendDouble(std::string* out, double v) {
  if (!std::isfinite(v)) {
    out->append("null");
  } else {
    absl::StrAppendFormat(out, "%.17g", v);
  }
}

void AppendMessage(std::string* out, const Message& m);

// One value of `field`: element `index` of a repeated field, or the singular value (index < 0).
void AppendValue(std::string* out, const Message& m, const FieldDescriptor* f, int index) {
  const Reflection* r = m.GetReflection();
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: absl::StrAppend(out, rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f)); break;
    case FieldDescriptor::CPPTYPE_INT64: absl::StrAppend(out, rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f)); break;
    case FieldDescriptor::CPPTYPE_UINT32: absl::StrAppend(out, rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f)); break;
    case FieldDescriptor::CPPTYPE_UINT64: absl::StrAppend(out, rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f)); break;
    case FieldDescriptor::CPPTYPE_DOUBLE: AppendDouble(out, rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f)); break;
    case FieldDescriptor::CPPTYPE_FLOAT: AppendDouble(out, rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f)); break;
    case FieldDescriptor::CPPTYPE_BOOL: out->append((rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f)) ? "true" : "false"); break;
    case FieldDescriptor::CPPTYPE_ENUM: {
      const int number = rep ? r->GetRepeatedEnumValue(m, f, index) : r->GetEnumValue(m, f);
      const auto* v = f->enum_type()->FindValueByNumber(number);
      if (v != nullptr) AppendString(out, v->name());
      else absl::StrAppend(out, number);
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string s = rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
      AppendString(out, f->type() == FieldDescriptor::TYPE_BYTES ? absl::BytesToHexString(s) : s);
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE: AppendMessage(out, rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f)); break;
  }
}

void AppendMessage(std::string* out, const Message& m) {
  const Reflection* r = m.GetReflection();
  const auto* d = m.GetDescriptor();
  out->push_back('{');
  bool first = true;
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (!f->is_repeated() && (f->containing_oneof() != nullptr || f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) &&
        !r->HasField(m, f)) {
      continue;  // an unset sub-message or oneof member
    }
    if (!first) out->append(", ");
    first = false;
    AppendString(out, f->name());
    out->append(": ");
    if (f->is_map()) {  // repeated entries {key, value} -> an object keyed by the key's text
      out->push_back('{');
      const FieldDescriptor* key = f->message_type()->map_key();
      const FieldDescriptor* value = f->message_type()->map_value();
      for (int k = 0; k < r->FieldSize(m, f); ++k) {
        const Message& entry = r->GetRepeatedMessage(m, f, k);
        if (k > 0) out->append(", ");
        std::string key_text;
        AppendValue(&key_text, entry, key, -1);
        if (key_text.empty() || key_text[0] != '"') key_text = absl::StrCat("\"", key_text, "\"");
        absl::StrAppend(out, key_text, ": ");
        AppendValue(out, entry, value, -1);
      }
      out->push_back('}');
    } else if (f->is_repeated()) {
      out->push_back('[');
      for (int k = 0; k < r->FieldSize(m, f); ++k) {
        if (k > 0) out->append(", ");
        AppendValue(out, m, f, k);
      }
      out->push_back(']');
    } else {
      AppendValue(out, m, f, -1);
    }
  }
  out->push_back('}');
}

}  // namespace

std::string JsonString(const std::string& s) {
  std::string out;
  AppendString(&out, s);
  return out;
}

std::string ToJsonLine(const Message& message) {
  std::string out;
  AppendMessage(&out, message);
  return out;
}

}  // namespace kvd
