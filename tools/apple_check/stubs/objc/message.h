// Stub of objc_msgSend, through which metal-cpp sends every message. As on
// arm64 macOS, only the plain entry point exists (no _stret/_fpret variants),
// so code taking an x86-only path would fail to compile here.
#pragma once

#include <objc/runtime.h>

extern "C" void objc_msgSend(void);
