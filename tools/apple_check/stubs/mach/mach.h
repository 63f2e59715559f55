// Stub of the Mach kernel interface: MTL::Resource::setOwner returns a Mach
// status and takes a task identity token (declarations only).
#pragma once

typedef int kern_return_t;
typedef unsigned int mach_port_t;
typedef mach_port_t task_id_token_t;
