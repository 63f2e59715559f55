// Stub of CoreFoundation: metal-cpp's Foundation and Metal headers use only
// its time interval type (declarations only).
#pragma once

typedef double CFTimeInterval;
