// A kernel's shared-memory layout (its SharedStorage struct) placed at the first 1024-byte boundary of the
// dynamic shared memory (128-byte-swizzled TMA boxes need 1024-byte alignment; launches ask for 1 KB of slack).
// The offset is added to the __shared__ array as pointer arithmetic, never through an integer: the compiler
// then still knows every access into the struct is a shared-memory one and emits LDS / STS, where a pointer
// rebuilt from an integer leaves it generic loads and stores (LD.E / ST.E, each resolving its address space
// at run time).
#pragma once

#include <cstdint>

#include "device/ptx/mbarrier.cuh"

namespace megamoe::device {

template <class Storage>
__device__ __forceinline__ Storage& shared_storage() {
  extern __shared__ __align__(16) uint8_t dynamic_smem[];
  const uint32_t offset = (1024u - (smem_addr(dynamic_smem) & 1023u)) & 1023u;
  return *reinterpret_cast<Storage*>(dynamic_smem + offset);
}

}  // namespace megamoe::device
