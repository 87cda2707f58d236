"""Ground-floor machinery shared by every op: loading the compiled C++ kernels."""
