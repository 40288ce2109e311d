// Empty stand-in: tests/simt/simt.h defines what CUDA code uses from cuda_runtime.h.
#pragma once
