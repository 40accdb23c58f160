// The paged decode kernels' (and the key index builder's) view of one layer of a device KV cache: what
// cache::cuda::DeviceLayerView holds (pools, raw pools, block tables, the codec fields of its
// scheme) copied into PagedDecodeParams. The shape, the queries, the outputs and the lengths stay
// the caller's. Host code only (the kernels' translation units are C++17).
#pragma once

#include "attention/cuda/key_index_cuda.h"
#include "attention/cuda/paged_decode_cuda.h"
#include "cache/cuda/device_kv_cache.h"

namespace certkv::attention::cuda {

inline void set_layer_pages(const cache::cuda::DeviceLayerView& v, PagedDecodeParams& p) {
  p.k_pages = v.k_pages;
  p.v_pages = v.v_pages;
  p.k_page_stride = v.k_page_stride;
  p.v_page_stride = v.v_page_stride;
  p.n_k_pages = v.n_k_pages;
  p.n_v_pages = v.n_v_pages;
  p.k_raw_pages = p.v_raw_pages = v.raw_pages;
  p.raw_page_stride = v.raw_page_stride;
  p.n_k_raw_pages = p.n_v_raw_pages = v.n_raw_pages;
  p.k_table = v.k_table;
  p.v_table = v.v_table;
  p.table_stride = v.table_stride;
  p.table_row_stride = v.table_row_stride;
  p.n_table_rows = v.n_table_rows;
  p.gaac_bases = v.gaac_bases;
  p.k_escape_capacity = v.k_escape_capacity;
  p.v_escape_capacity = v.v_escape_capacity;
  p.dither_keys = v.dither_keys;
  p.outlier_channels = v.outlier_channels;
  p.n_outlier_pairs = v.n_outlier_pairs;
}

// The key index builder's view of the same layer (bf16 pages: the raw pool and its tables; the
// records and centroids). The shape, ranges, rotation and error word stay the caller's.
inline void set_layer_index(const cache::cuda::DeviceLayerView& v, KeyIndexBuildParams& p) {
  p.k_pages = v.k_pages;
  p.k_page_stride = v.k_page_stride;
  p.n_k_pages = v.n_k_pages;
  p.k_table = v.k_table;
  p.table_stride = v.table_stride;
  p.table_row_stride = v.table_row_stride;
  p.n_table_rows = v.n_table_rows;
  p.centroids = v.index_centroids;
  p.records = v.index_records;
  p.record_stride = v.index_record_stride;
}

}  // namespace certkv::attention::cuda
