// A stand-in for CUB's radix sort (tests/gpu/emu): a stable sort of the
// pairs by key, as DeviceRadixSort::SortPairs is.
#pragma once
#include "cuda_runtime.h"
namespace cub { struct DeviceRadixSort {
  template <class K, class V> static cudaError_t SortPairs(void *temp, size_t &bytes, const K *kin, K *kout, const V *vin, V *vout, int n, int = 0, int = 32, cudaStream_t = 0) {
    if (!temp) { bytes = 64; return 0; }
    emu_check_pointer("cub sort", 0, kin), emu_check_pointer("cub sort", 1, kout);
    emu_check_pointer("cub sort", 2, vin), emu_check_pointer("cub sort", 3, vout);
    emu_enqueue([=]() {
      emu_device_open();
      std::vector<std::pair<K, V>> p(n);
      for (int i = 0; i < n; i++) p[i] = {kin[i], vin[i]};
      std::stable_sort(p.begin(), p.end(), [](auto &a, auto &b) { return a.first < b.first; });
      for (int i = 0; i < n; i++) kout[i] = p[i].first, vout[i] = p[i].second;
      emu_device_close();
    });
    return 0; } }; }
