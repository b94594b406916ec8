"""Decode attention over a paged KV cache: an XLA reference and the Pallas TPU / GPU kernels.

Layout shared by every implementation (one query token per row):
  q_RHD          [rows, num_heads, head_dim], already RoPE'd, in the model's dtype
  kv_pages_PSCD  [num_pages, page_size, 2 * num_kv_heads, head_dim], K at even and V at odd
                 combined heads (the layout of JAX's TPU ragged paged attention kernel;
                 an int8 pool, quant.Int8Pages, stores its pages head-major)
  page_table_RN  int32 [rows, pages_per_row]: the row's pages in token order
  kv_lens_R      int32 [rows]: valid tokens in the row's cache; 0 marks an idle row (output 0)
The kernels are imported lazily: each module pulls in its own Pallas backend.
"""
