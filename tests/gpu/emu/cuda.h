// The driver API's virtual memory for the emulated GPU (kernels/cuda/device.cu reaches it
// through cudaGetDriverEntryPointByVersion, emu.cpp): the types and constants it uses.
// Reserved address space is device memory (emu_is_device) whose pages are readable only
// where mapped, as on a GPU.
#pragma once
#include <cstddef>
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef int CUresult;
enum { CUDA_SUCCESS = 0 };
enum CUmemAllocationType { CU_MEM_ALLOCATION_TYPE_PINNED = 1 };
enum CUmemLocationType { CU_MEM_LOCATION_TYPE_DEVICE = 1 };
enum CUmemAccess_flags { CU_MEM_ACCESS_FLAGS_PROT_NONE = 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 };
enum CUmemAllocationGranularity_flags { CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0 };
struct CUmemLocation { CUmemLocationType type; int id; };
struct CUmemAllocationProp { CUmemAllocationType type; int requestedHandleTypes; CUmemLocation location; void *win32HandleMetaData; unsigned char allocFlags[8]; };
struct CUmemAccessDesc { CUmemLocation location; CUmemAccess_flags flags; };
