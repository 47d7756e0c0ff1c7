// deepfuse's emulator: the fixed-width integer types, from the compiler's own macros. Kernels are
// compiled with no C or C++ library header visible (-nostdinc, as on the AI core, where there is
// no host library), so these are the only standard names they get. The types equal glibc's, so
// host code may include this next to <cstdint>.
#pragma once
typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef __UINTPTR_TYPE__ uintptr_t;
typedef __SIZE_TYPE__ size_t;
