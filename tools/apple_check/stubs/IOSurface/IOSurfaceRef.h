// Stub of IOSurface: Metal can wrap an IOSurface in a texture; metal-cpp only
// passes the opaque handle through.
#pragma once

typedef struct __IOSurface* IOSurfaceRef;
