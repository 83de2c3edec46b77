"""Run the CUDA kernels of runtime/exec/kernels on the CPU: an emulation for tests.

* ``cuda_emu.h`` - the C++ header that lets g++ compile each ``.cu`` source unchanged
  (threads as fibers, barriers, warp shuffles, shared memory, the fp16 PTX conversions);
* :mod:`runtime.exec.emu.module` - builds one shared library per kernel module (cached) and
  launches its kernels through ctypes, checking every argument and CUDA's launch limits;
* :mod:`runtime.exec.emu.cupy_standin` - the part of CuPy that runtime.exec.ops_gpu and the
  GPU executor use, on NumPy, with ``RawModule`` backed by the emulation.

Nothing here is imported by the runtime itself; the tests inject the stand-in explicitly
(see kernels/NOTES.md, "Testing without a GPU").
"""
