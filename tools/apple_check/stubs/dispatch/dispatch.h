// Stub of libdispatch: metal-cpp passes dispatch queues and data to Metal as
// opaque handles, as the SDK declares them for C++ (not Objective-C).
#pragma once

typedef struct dispatch_queue_s* dispatch_queue_t;
typedef struct dispatch_data_s* dispatch_data_t;
