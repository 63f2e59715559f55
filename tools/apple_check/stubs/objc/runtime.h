// Stub of the Objective-C runtime's C interface: metal-cpp looks classes,
// protocols and selectors up by name through these (declarations only; the
// check never links).
#pragma once

typedef struct objc_class* Class;
typedef struct objc_object {
  Class isa;
}* id;
typedef struct objc_selector* SEL;
typedef struct objc_object Protocol;  // what the SDK gives C and C++ (not Objective-C)

extern "C" {
Class objc_lookUpClass(const char* name);
Protocol* objc_getProtocol(const char* name);
SEL sel_registerName(const char* name);
}
