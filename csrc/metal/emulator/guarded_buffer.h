// A buffer with sentinel guard bytes on both sides: ASan cannot see an
// overrun that stays inside one allocation, so every executor of the emulator
// checks these after each dispatch.
#pragma once

#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace metal_emulator {

constexpr size_t kGuardBytes = 64;
constexpr std::byte kSentinel{0xa5};
constexpr std::byte kUnwritten{0xff};  // NaN in every float format

// One buffer with guard bytes on both sides.
class GuardedBuffer {
 public:
  GuardedBuffer(std::string name, size_t bytes)
      : name_(std::move(name)),
        bytes_(bytes),
        storage_(bytes + 2 * kGuardBytes, kUnwritten) {
    std::memset(storage_.data(), int(kSentinel), kGuardBytes);
    std::memset(
        storage_.data() + kGuardBytes + bytes, int(kSentinel), kGuardBytes);
  }
  std::byte* data() {
    return storage_.data() + kGuardBytes;
  }
  size_t size() const {
    return bytes_;
  }
  const std::string& name() const {
    return name_;
  }
  void check_guards(const std::string& after) const {
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (storage_[i] != kSentinel) {
        fail(after, "before its start", i);
      }
      if (storage_[kGuardBytes + bytes_ + i] != kSentinel) {
        fail(after, "past its end", i);
      }
    }
  }

 private:
  [[noreturn]] void fail(
      const std::string& after, const char* where, size_t offset) const {
    throw std::runtime_error(
        "metal emulator: " + after + " wrote " + where + " of buffer " + name_ +
        " (" + std::to_string(bytes_) + " bytes; guard byte " +
        std::to_string(offset) + ")");
  }
  std::string name_;
  size_t bytes_;
  std::vector<std::byte> storage_;
};

}  // namespace metal_emulator
