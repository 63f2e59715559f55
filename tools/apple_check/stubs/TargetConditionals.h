// Stub of the SDK's platform switches, with the values a macOS build sees.
// metal-cpp tests them only in its implementation section, which our
// translation units do not compile, but it includes the header unconditionally.
#pragma once

#define TARGET_OS_MAC 1
#define TARGET_OS_OSX 1
#define TARGET_OS_IPHONE 0
