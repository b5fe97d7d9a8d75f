"""Runtime side of ahead-of-time kernels: find and launch precompiled binaries."""
