"""CUDA decode of kvwire blobs (PyCUDA), bit-exact with the CPU decoder up to the GEMM's
summation order (codec/FORMAT.md, "Inverse transform").

Importing this package registers the CUDA section decoder with ``codec`` (the codec
never imports it); pycuda itself is imported only when a decoder is first built, so
the import works, and ``device="cuda"`` then raises ``codec.GpuUnavailable`` saying
what is missing, on machines without pycuda or a GPU.
"""
import codec

from kvwire_kernels import gpu

codec.register_backend("cuda", gpu.decoder)
